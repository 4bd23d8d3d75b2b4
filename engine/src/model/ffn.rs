//! A layer's feed-forward: the gated MLP, or a mixture of them that a router picks from
//! for each token.
//!
//! The mixture runs expert by expert over the batch: each token's chosen experts are
//! grouped ([`by_expert`]), and an expert multiplies all the rows routed to it at once, so
//! its weights are read once per step however many tokens chose it.

use candle_core::{DType, Tensor};

mod grouped;

use crate::error::Result;
use crate::swiglu;
use crate::weights::{with_f32_rows, Linear, Stacked};
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
    /// The experts' matrices, where all of them can be multiplied together.
    grouped: Option<grouped::KExperts>,
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
    pub(super) fn new(
        router: Linear,
        experts: Vec<Mlp>,
        top_k: usize,
        normalize: bool,
        shared: Option<SharedExpert>,
    ) -> Self {
        Self {
            grouped: grouped::KExperts::of(&experts),
            router,
            experts,
            top_k,
            normalize,
            shared,
        }
    }

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
        let batches = by_expert(&routes, self.experts.len());
        let (n, hidden) = xs.dims2()?;
        // Summed in place: `index_add` copied the whole `(rows, hidden)` sum once per
        // expert, 64 times a layer in a 512-token prefill of 64 experts.
        let mut sum = vec![0f32; n * hidden];
        match &self.grouped {
            Some(experts) => with_f32_rows(xs, |x| experts.add(x, &batches, &mut sum))?,
            None => self.add_by_expert(xs, &batches, &mut sum)?,
        }
        let mut out = Tensor::from_vec(sum, (n, hidden), xs.device())?;
        if let Some(shared) = &self.shared {
            let gate = candle_nn::ops::sigmoid(&shared.gate.forward(xs)?)?;
            out = (out + shared.mlp.forward(xs)?.broadcast_mul(&gate)?)?;
        }
        Ok(out)
    }

    /// Adds each expert's weighted outputs for its rows of `xs` to `sum`, one expert's
    /// products after another.
    fn add_by_expert(&self, xs: &Tensor, batches: &[ExpertBatch], sum: &mut [f32]) -> Result<()> {
        for (expert, batch) in batches.iter().enumerate() {
            if batch.rows.is_empty() {
                continue;
            }
            let rows = Tensor::from_slice(&batch.rows, batch.rows.len(), xs.device())?;
            let ys = self.experts[expert].forward(&xs.index_select(&rows, 0)?)?;
            add_weighted(sum, batch, &ys.flatten_all()?.to_vec1()?);
        }
        Ok(())
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

/// Adds to `sum`'s rows the expert outputs `ys` of `batch`'s rows (one row of `ys` each,
/// in order), each times its weight.
fn add_weighted(sum: &mut [f32], batch: &ExpertBatch, ys: &[f32]) {
    let hidden = ys.len() / batch.rows.len();
    for ((&row, &weight), y) in batch.rows.iter().zip(&batch.weights).zip(ys.chunks(hidden)) {
        let row = row as usize * hidden;
        for (s, &v) in sum[row..row + hidden].iter_mut().zip(y) {
            *s += v * weight;
        }
    }
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
    fn expert_outputs_are_added_to_their_rows_times_their_weights() {
        let mut sum = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let batch = ExpertBatch {
            rows: vec![2, 0],
            weights: vec![0.5, 0.25],
        };
        add_weighted(&mut sum, &batch, &[10.0, 20.0, 40.0, 80.0]);
        assert_eq!(sum, [11.0, 22.0, 3.0, 4.0, 10.0, 16.0]);
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
