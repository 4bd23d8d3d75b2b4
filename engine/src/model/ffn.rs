//! A layer's feed-forward: the gated MLP, or a mixture of them that a router picks from
//! for each token.
//!
//! The mixture runs expert by expert over the batch: each token's chosen experts are
//! grouped ([`by_expert`]), and an expert multiplies all the rows routed to it at once, so
//! its weights are read once per step however many tokens chose it.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::swiglu;
use crate::weights::{Linear, Stacked};
use text::config::Activation;

/// `down(act(gate(x)) * up(x))`.
pub(super) struct Mlp {
    /// gate and up.
    pub(super) gate_up: Stacked,
    pub(super) down: Linear,
    pub(super) act: Activation,
}

impl Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let gate_up = self.gate_up.forward(xs)?;
        let (gate, up) = (&gate_up[0], &gate_up[1]);
        let gated = match self.act {
            Activation::Silu => swiglu::silu_mul(gate, up)?,
            Activation::GeluTanh => (gate.gelu()? * up)?,
        };
        self.down.forward(&gated)
    }

    fn weight_bytes(&self) -> usize {
        self.gate_up.weight_bytes() + self.down.weight_bytes()
    }
}

/// Experts and the router that picks `top_k` of them for each token.
pub(super) struct Mixture {
    pub(super) router: Linear,
    pub(super) experts: Vec<Mlp>,
    pub(super) top_k: usize,
    /// Whether the chosen weights are divided by their sum.
    pub(super) normalize: bool,
    pub(super) shared: Option<SharedExpert>,
}

/// An expert every token runs beside its chosen ones, its output scaled by
/// `sigmoid(gate(x))` (Qwen2-MoE's).
pub(super) struct SharedExpert {
    /// `[1, hidden]`.
    pub(super) gate: Linear,
    pub(super) mlp: Mlp,
}

impl SharedExpert {
    fn weight_bytes(&self) -> usize {
        self.gate.weight_bytes() + self.mlp.weight_bytes()
    }
}

/// A layer's feed-forward.
pub(super) enum Ffn {
    Dense(Mlp),
    Mixture(Mixture),
}

impl Ffn {
    /// The feed-forward of `(rows, hidden)` normalized activations.
    pub(super) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(xs),
            Self::Mixture(m) => m.forward(xs),
        }
    }

    /// Bytes the weights hold.
    pub(super) fn resident_bytes(&self) -> usize {
        match self {
            Self::Dense(mlp) => mlp.weight_bytes(),
            Self::Mixture(m) => m.bytes_with(m.experts.iter().map(Mlp::weight_bytes).sum()),
        }
    }

    /// Bytes one token's step reads: the router, the `top_k` experts it picks and the
    /// shared expert.
    pub(super) fn bytes_per_token(&self) -> usize {
        match self {
            Self::Dense(mlp) => mlp.weight_bytes(),
            Self::Mixture(m) => {
                let experts: usize = m.experts.iter().map(Mlp::weight_bytes).sum();
                m.bytes_with(experts / m.experts.len() * m.top_k)
            }
        }
    }
}

impl Mixture {
    /// The router's and the shared expert's bytes, plus `experts` bytes of experts.
    fn bytes_with(&self, experts: usize) -> usize {
        self.router.weight_bytes()
            + experts
            + self.shared.as_ref().map_or(0, SharedExpert::weight_bytes)
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let logits: Vec<Vec<f32>> = self.router.forward(xs)?.to_dtype(DType::F32)?.to_vec2()?;
        let routes: Vec<Vec<Choice>> = logits
            .iter()
            .map(|row| route(row, self.top_k, self.normalize))
            .collect();
        let mut out = xs.zeros_like()?;
        for (expert, batch) in by_expert(&routes, self.experts.len())
            .into_iter()
            .enumerate()
        {
            if batch.rows.is_empty() {
                continue;
            }
            let n = batch.rows.len();
            let rows = Tensor::from_vec(batch.rows, n, xs.device())?;
            let weights = Tensor::from_vec(batch.weights, (n, 1), xs.device())?;
            let ys = self.experts[expert].forward(&xs.index_select(&rows, 0)?)?;
            out = out.index_add(&rows, &ys.broadcast_mul(&weights)?, 0)?;
        }
        if let Some(shared) = &self.shared {
            let gate = candle_nn::ops::sigmoid(&shared.gate.forward(xs)?)?;
            out = (out + shared.mlp.forward(xs)?.broadcast_mul(&gate)?)?;
        }
        Ok(out)
    }
}

/// One expert a token goes to, and the weight of its output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Choice {
    pub(super) expert: usize,
    pub(super) weight: f32,
}

/// The `top_k` experts of one token from its router logits, as transformers routes: a
/// softmax over all experts, the `top_k` largest (ties to the lowest index), their
/// probabilities divided by their sum when `normalize`.
pub(super) fn route(logits: &[f32], top_k: usize, normalize: bool) -> Vec<Choice> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let total: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable, so equal probabilities keep the lower index first.
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
    let mut chosen: Vec<Choice> = order
        .into_iter()
        .take(top_k)
        .map(|expert| Choice {
            expert,
            weight: exp[expert] / total,
        })
        .collect();
    if normalize {
        let sum: f32 = chosen.iter().map(|c| c.weight).sum();
        chosen.iter_mut().for_each(|c| c.weight /= sum);
    }
    chosen
}

/// The rows routed to one expert and the weight of each.
#[derive(Debug, Default, PartialEq)]
pub(super) struct ExpertBatch {
    pub(super) rows: Vec<u32>,
    pub(super) weights: Vec<f32>,
}

/// Each expert's rows, in row order, from every row's choices.
pub(super) fn by_expert(routes: &[Vec<Choice>], experts: usize) -> Vec<ExpertBatch> {
    let mut batches: Vec<ExpertBatch> = (0..experts).map(|_| ExpertBatch::default()).collect();
    for (row, choices) in routes.iter().enumerate() {
        for c in choices {
            batches[c.expert].rows.push(row as u32);
            batches[c.expert].weights.push(c.weight);
        }
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn experts(choices: &[Choice]) -> Vec<usize> {
        choices.iter().map(|c| c.expert).collect()
    }

    #[test]
    fn routing_takes_the_largest_softmax_probabilities_and_normalizes_on_request() {
        let logits = [0.0, 2.0, 1.0, 2.0_f32.ln() + 1.0];
        let raw = route(&logits, 2, false);
        assert_eq!(experts(&raw), [1, 3]);
        let total: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((raw[0].weight - 2.0_f32.exp() / total).abs() < 1e-6);
        assert!((raw[1].weight - 2.0 * 1.0_f32.exp() / total).abs() < 1e-6);
        let normalized = route(&logits, 2, true);
        let e = 2.0_f32.exp();
        assert!((normalized[0].weight - e / (e + 2.0 * 1.0_f32.exp())).abs() < 1e-6);
        let sum: f32 = normalized.iter().map(|c| c.weight).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }

    #[test]
    fn routing_ties_go_to_the_lower_expert() {
        assert_eq!(experts(&route(&[1.0, 3.0, 3.0, 3.0], 2, true)), [1, 2]);
    }

    #[test]
    fn rows_are_grouped_by_expert_in_row_order() {
        let c = |expert, weight| Choice { expert, weight };
        let routes = vec![vec![c(2, 0.75), c(0, 0.25)], vec![c(0, 0.5), c(1, 0.5)]];
        let batches = by_expert(&routes, 4);
        assert_eq!(batches[0].rows, [0, 1]);
        assert_eq!(batches[0].weights, [0.25, 0.5]);
        assert_eq!(batches[1].rows, [1]);
        assert_eq!(batches[2].rows, [0]);
        assert_eq!(batches[3], ExpertBatch::default());
    }
}
