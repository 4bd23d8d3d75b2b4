//! Engine values to and from the contracts' messages that the KV data plane and both nodes
//! carry: sampled tokens (a transfer's first tokens, every token event) and cache layouts.
//! They live here rather than in `proto`, so that the contracts compile without the model.

use proto::v1;

/// The wire form of a sampled token with its logprob and alternatives.
pub fn token_to_proto(s: &engine::Sampled) -> v1::Token {
    v1::Token {
        id: s.token,
        logprob: s.logprob,
        top: s
            .top
            .iter()
            .map(|t| v1::TopLogprob {
                id: t.token,
                logprob: t.logprob,
            })
            .collect(),
    }
}

/// A sampled token from its wire form.
pub fn token_from_proto(t: &v1::Token) -> engine::Sampled {
    engine::Sampled {
        token: t.id,
        logprob: t.logprob,
        top: t
            .top
            .iter()
            .map(|a| engine::sampling::TokenLogprob {
                token: a.id,
                logprob: a.logprob,
            })
            .collect(),
    }
}

/// The wire form of a cache layout.
pub fn layout_to_proto(l: &engine::KvLayout) -> v1::KvLayout {
    v1::KvLayout {
        n_layers: l.n_layers as u32,
        n_kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        dtype: l.dtype.name().into(),
    }
}

/// A cache layout as worker registrations carry it.
pub fn layout_info(l: &engine::KvLayout) -> discovery::Layout {
    discovery::Layout {
        n_layers: l.n_layers as u32,
        n_kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        dtype: l.dtype.name().into(),
    }
}

/// A cache layout from the wire: its element type by name, refused where no engine
/// stores it (its sizes are the assembler's to check, `engine::KvLayout::validate`).
pub fn layout_from_proto(l: &v1::KvLayout) -> Result<engine::KvLayout, engine::UnknownKvDtype> {
    Ok(engine::KvLayout {
        n_layers: l.n_layers as usize,
        n_kv_heads: l.n_kv_heads as usize,
        head_dim: l.head_dim as usize,
        dtype: l.dtype.parse()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_layouts_survive_the_wire() {
        let s = engine::Sampled {
            token: 7,
            logprob: -0.5,
            top: vec![engine::sampling::TokenLogprob {
                token: 7,
                logprob: -0.5,
            }],
        };
        assert_eq!(token_from_proto(&token_to_proto(&s)), s);
        for dtype in engine::KvDtype::ALL {
            let l = engine::KvLayout {
                n_layers: 30,
                n_kv_heads: 3,
                head_dim: 64,
                dtype,
            };
            assert_eq!(layout_from_proto(&layout_to_proto(&l)), Ok(l));
        }
    }

    #[test]
    fn a_dtype_no_engine_stores_is_refused_by_name() {
        for name in ["bf16", "f32", "", "F16", "f16 ", "q8_1", "Q8_0"] {
            let mut wire = layout_to_proto(&engine::KvLayout {
                n_layers: 30,
                n_kv_heads: 3,
                head_dim: 64,
                dtype: engine::KV_DTYPE,
            });
            wire.dtype = name.into();
            assert_eq!(
                layout_from_proto(&wire),
                Err(engine::UnknownKvDtype(name.into()))
            );
        }
    }
}
