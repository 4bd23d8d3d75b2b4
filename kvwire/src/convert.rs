//! Engine values to and from the contracts' messages, in one place for both nodes. They live
//! here rather than in `proto`, so that the contracts compile without the model: this crate
//! is the one that already stands between the two (its frames carry the engine's KV chunks,
//! the cache layout and the first tokens), and both nodes depend on it.

use proto::v1;

/// The sampling settings a node runs from the ones the router sent.
pub fn sampling_from_proto(p: &v1::SamplingParams) -> engine::SamplingParams {
    engine::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
    }
}

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
        dtype: l.dtype.clone(),
    }
}

/// A cache layout as worker registrations carry it.
pub fn layout_info(l: &engine::KvLayout) -> discovery::Layout {
    discovery::Layout {
        n_layers: l.n_layers as u32,
        n_kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        dtype: l.dtype.clone(),
    }
}

/// A cache layout from the wire.
pub fn layout_from_proto(l: &v1::KvLayout) -> engine::KvLayout {
    engine::KvLayout {
        n_layers: l.n_layers as usize,
        n_kv_heads: l.n_kv_heads as usize,
        head_dim: l.head_dim as usize,
        dtype: l.dtype.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_params_keep_every_field() {
        let wire = v1::SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            presence_penalty: -0.5,
            frequency_penalty: 0.25,
            seed: u64::MAX,
        };
        let p = sampling_from_proto(&wire);
        assert_eq!(
            p,
            engine::SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                repetition_penalty: 1.1,
                presence_penalty: -0.5,
                frequency_penalty: 0.25,
                seed: u64::MAX,
            }
        );
    }

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
        let l = engine::KvLayout {
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            dtype: "f32".into(),
        };
        assert_eq!(layout_from_proto(&layout_to_proto(&l)), l);
    }
}
