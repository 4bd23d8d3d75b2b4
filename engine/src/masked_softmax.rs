//! The scale, causal mask and softmax of a prompt chunk's attention scores, in place and
//! in one pass. candle took three ops for it: `scores * scale`, plus an additive mask
//! tensor built for the chunk (0 or -inf per score), then `softmax_last_dim`, each
//! allocating and filling a tensor as large as the scores, and computing `exp(-inf)` for
//! every score a row cannot see, which is nearly half of them in a long prompt. At 2048
//! prompt tokens those three were about a third of a prefill (`perf`).
//!
//! Each visible score is candle's `x * scale + 0`; the softmax ([`softmax_visible`]) takes
//! candle's own max and sum over the whole row, and `exp` from `crate::vexp` (eight lanes
//! at a time, within 2 ulp, not libm's bits). The decode step's fused attention takes the
//! same softmax, so a position's attention has the same values whichever path runs it,
//! which stream migration depends on.

use candle_core::cpu::kernels::VecOps;
use candle_core::{CpuStorage, InplaceOp1, Layout};
use rayon::prelude::*;

use crate::vexp::exp_minus;

/// Scores of `heads` query heads per K/V head for query rows `first .. first + rows` of a
/// prompt whose first new row sits at position `pos`, over all its keys: a row sees the
/// keys up to its own position. The scores tensor is `(kv_heads, heads * rows, keys)`,
/// contiguous, the rows of one query head together.
pub(crate) struct MaskedSoftmax {
    /// Multiplies every score first (1 / sqrt(head_dim)).
    pub scale: f64,
    /// The chunk's query rows per head.
    pub rows: usize,
    /// Position of the chunk's first query row.
    pub first_pos: usize,
}

impl MaskedSoftmax {
    /// One row of scores, in place; `r` is its query row within the chunk.
    fn row(&self, row: &mut [f32], r: usize) {
        let visible = (self.first_pos + r + 1).min(row.len());
        // candle's affine casts its factor to the tensor's dtype.
        let scale = self.scale as f32;
        let (seen, hidden) = row.split_at_mut(visible);
        for x in seen.iter_mut() {
            *x = *x * scale + 0.0;
        }
        hidden.fill(f32::NEG_INFINITY);
        softmax_visible(row, visible);
    }
}

/// The softmax of a row whose first `visible` scores count and whose others are -inf, in
/// place: candle's max and sum over the whole row, `exp(x - max)` for the visible ones and
/// exactly 0 for the others.
pub(crate) fn softmax_visible(row: &mut [f32], visible: usize) {
    let keys = row.len();
    let mut max = f32::NEG_INFINITY;
    // SAFETY: the pointer and length describe `row`.
    unsafe { f32::vec_reduce_max(row.as_ptr(), &mut max, keys) };
    let (seen, hidden) = row.split_at_mut(visible);
    exp_minus(seen, max);
    hidden.fill(0.0);
    let mut sum = 0f32;
    // SAFETY: as above.
    unsafe { f32::vec_reduce_sum(row.as_ptr(), &mut sum, keys) };
    for x in row.iter_mut() {
        *x /= sum;
    }
}

impl InplaceOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("attention scores are f32");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("attention scores are one contiguous tensor");
        };
        let keys = layout.shape().dims().last().copied().unwrap_or(0);
        if keys == 0 || self.rows == 0 || self.first_pos + self.rows > keys {
            candle_core::bail!(
                "scores of {keys} keys for {} rows at {}",
                self.rows,
                self.first_pos
            );
        }
        // Like candle-nn's softmax, rows go out over rayon's pool.
        data[start..end]
            .par_chunks_mut(keys)
            .enumerate()
            .for_each(|(i, row)| self.row(row, i % self.rows));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::act_quant::testing::{values, xorshift_data};

    #[test]
    fn equals_scale_mask_and_softmax_within_exp_s_rounding() {
        let dev = Device::Cpu;
        // (kv heads, heads per kv head, chunk rows, first row's position, keys): chunks at
        // the start, in the middle and at the end of a prompt, on top of a cached prefix,
        // key counts off the multiple of 8.
        for (i, &(kv, group, rows, first_pos, keys)) in [
            (3, 3, 64, 0, 64),
            (3, 3, 70, 0, 203),
            (2, 7, 65, 65, 203),
            (3, 3, 73, 130, 203),
            (1, 1, 9, 500, 509),
            (4, 2, 128, 900, 1031),
        ]
        .iter()
        .enumerate()
        {
            let n = kv * group * rows * keys;
            let scores = Tensor::from_vec(
                xorshift_data(n, i as u64, 40.0),
                (kv, group * rows, keys),
                &dev,
            )
            .unwrap();
            let scale = 1.0 / 64f64.sqrt();
            let mask = crate::model::causal_mask(group, 0..rows, first_pos, keys, &dev).unwrap();
            let general = candle_nn::ops::softmax_last_dim(
                &(&scores * scale).unwrap().broadcast_add(&mask).unwrap(),
            )
            .unwrap();
            let ours = scores.copy().unwrap();
            ours.inplace_op1(&MaskedSoftmax {
                scale,
                rows,
                first_pos,
            })
            .unwrap();
            // candle's values but for `exp`'s last bits; what no row sees is exactly 0.
            let (general, ours) = (values(&general), values(&ours));
            for (j, (&c, &o)) in general.iter().zip(&ours).enumerate() {
                assert!(
                    (c - o).abs() <= c * 1e-6,
                    "shape {i}, value {j}: {o} against {c}"
                );
                assert_eq!(
                    c == 0.0,
                    o == 0.0,
                    "shape {i}, value {j}: hidden in one only"
                );
            }
        }
    }
}
