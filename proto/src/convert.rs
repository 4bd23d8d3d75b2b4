//! Engine types to and from their wire messages, in one place for both nodes.

use crate::v1;

impl From<&v1::SamplingParams> for engine::SamplingParams {
    fn from(p: &v1::SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed,
        }
    }
}

impl From<&engine::SamplingParams> for v1::SamplingParams {
    fn from(p: &engine::SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed,
        }
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
    fn sampling_params_survive_the_wire() {
        let p = engine::SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            presence_penalty: -0.5,
            frequency_penalty: 0.25,
            seed: u64::MAX,
        };
        let back = engine::SamplingParams::from(&v1::SamplingParams::from(&p));
        assert_eq!(back, p);
    }
}
