//! A mixture's experts multiplied together where all of them are on our K-quant kernel (a
//! Q4_K_M or Q5_K_M file's): the rows are quantized once, every chosen expert's gate/up
//! product goes to the pool in one hand-off, then every down product in another. Expert by
//! expert, a batch-16 step of a 64-expert model handed the pool about 110 products a layer
//! of two or three rows each, with candle's gathers and copies between them.
//!
//! Each output is the bits the expert-by-expert path gives: a row's quantized activations
//! and the kernel's outputs for it never depend on the rows beside it, and `silu * up` is
//! the same function of each value, so PD and colocated still agree.

use std::sync::Arc;

use text::config::Activation;

use super::{add_weighted, ExpertBatch, Mlp};
use crate::kquant::{KMatrix, KProduct, Q8KRows};
use crate::swiglu::silu_mul_rows;

/// Each expert's stacked gate/up matrix and its down matrix.
pub(super) struct KExperts {
    gate_up: Vec<Arc<KMatrix>>,
    down: Vec<Arc<KMatrix>>,
}

impl KExperts {
    /// The matrices of `experts`, where every one is a SiLU-gated MLP without biases on
    /// the K-quant kernel: a fact of the loaded model, decided once at load.
    pub(super) fn of(experts: &[Mlp]) -> Option<Self> {
        let mut k = Self {
            gate_up: Vec::with_capacity(experts.len()),
            down: Vec::with_capacity(experts.len()),
        };
        for mlp in experts {
            if mlp.act != Activation::Silu {
                return None;
            }
            k.gate_up.push(Arc::clone(mlp.gate_up.k_matrix()?));
            k.down.push(Arc::clone(mlp.down.k_matrix()?));
        }
        Some(k)
    }

    /// Adds to `sum` each expert's outputs for its rows of `x` (`(rows, hidden)`, row-major),
    /// times their weights, in the experts' order as the expert-by-expert path adds them.
    pub(super) fn add(&self, x: &[f32], batches: &[ExpertBatch], sum: &mut [f32]) {
        let hit: Vec<usize> = (0..batches.len())
            .filter(|&e| !batches[e].rows.is_empty())
            .collect();
        let Some(&first) = hit.first() else {
            return;
        };
        let quantized = Q8KRows::quantize(x, self.gate_up[first].cols());
        let gate_up = KMatrix::products(
            &hit.iter()
                .map(|&e| KProduct {
                    matrix: &self.gate_up[e],
                    rows: batches[e]
                        .rows
                        .iter()
                        .map(|&r| quantized.row(r as usize))
                        .collect(),
                })
                .collect::<Vec<_>>(),
        );
        let inter = self.down[first].cols();
        let rows: Vec<&[f32]> = gate_up
            .iter()
            .flat_map(|ys| ys.chunks_exact(2 * inter))
            .collect();
        let gated = silu_mul_rows(&rows, inter);
        let quantized = Q8KRows::quantize(&gated, inter);
        let mut at = 0;
        let downs: Vec<KProduct<'_>> = hit
            .iter()
            .map(|&e| {
                let rows = (at..at + batches[e].rows.len())
                    .map(|y| quantized.row(y))
                    .collect();
                at += batches[e].rows.len();
                KProduct {
                    matrix: &self.down[e],
                    rows,
                }
            })
            .collect();
        for (&e, ys) in hit.iter().zip(KMatrix::products(&downs)) {
            add_weighted(sum, &batches[e], &ys);
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::model::ffn::Mixture;
    use crate::weights::{quantized_linear, stack_quantized, Linear};

    const HIDDEN: usize = 256;
    const INTER: usize = 512;

    fn quantized(rows: usize, cols: usize, dtype: GgmlDType) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    /// An expert of Q4_K gate and up, and a down of `down`.
    fn expert(down: GgmlDType) -> Mlp {
        let parts = vec![
            quantized(INTER, HIDDEN, GgmlDType::Q4K),
            quantized(INTER, HIDDEN, GgmlDType::Q4K),
        ];
        Mlp {
            gate_up: stack_quantized(
                parts,
                vec![None, None],
                vec![INTER; 2],
                HIDDEN,
                &Device::Cpu,
            )
            .unwrap(),
            down: quantized_linear(
                quantized(HIDDEN, INTER, down),
                (HIDDEN, INTER),
                &Device::Cpu,
            )
            .unwrap(),
            act: Activation::Silu,
        }
    }

    #[test]
    fn grouped_experts_give_the_expert_by_expert_bits() {
        let downs = [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5K,
            GgmlDType::Q4K,
        ];
        let mixture = Mixture::new(
            Linear::dense(Tensor::zeros((downs.len(), HIDDEN), DType::F32, &Device::Cpu).unwrap()),
            downs.map(expert).into(),
            2,
            true,
            None,
        );
        let n = 5;
        let xs = Tensor::randn(0f32, 1.0, (n, HIDDEN), &Device::Cpu).unwrap();
        let batch = |rows: &[u32], weights: &[f32]| ExpertBatch {
            rows: rows.to_vec(),
            weights: weights.to_vec(),
        };
        // One expert unused, one with every row, the rows out of order in another.
        let batches = [
            batch(&[4, 0, 2], &[0.5, 0.25, 0.75]),
            batch(&[], &[]),
            batch(&[0, 1, 2, 3, 4], &[0.5, 0.75, 0.25, 1.0, 0.5]),
            batch(&[3, 1], &[0.125, 0.25]),
        ];
        let experts = mixture
            .grouped
            .as_ref()
            .expect("every expert on the K-quant kernel");
        let mut grouped = vec![0f32; n * HIDDEN];
        experts.add(
            &xs.flatten_all().unwrap().to_vec1().unwrap(),
            &batches,
            &mut grouped,
        );
        let mut by_expert = vec![0f32; n * HIDDEN];
        mixture
            .add_by_expert(&xs, &batches, &mut by_expert)
            .unwrap();
        assert!(by_expert.iter().all(|v| v.is_finite() && *v != 0.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&grouped), bits(&by_expert));
    }

    #[test]
    fn experts_off_the_k_quant_kernel_are_not_grouped() {
        let mut mixture_expert = expert(GgmlDType::Q4K);
        mixture_expert.act = Activation::GeluTanh;
        let router = Linear::dense(Tensor::zeros((1, HIDDEN), DType::F32, &Device::Cpu).unwrap());
        let mixture = Mixture::new(router, vec![mixture_expert], 1, true, None);
        assert!(mixture.grouped.is_none());
    }
}
