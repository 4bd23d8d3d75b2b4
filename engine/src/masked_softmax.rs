//! The scale, causal mask and softmax of a prefill chunk's attention scores, in place and
//! in one pass. candle took three ops for it: `scores * scale`, plus an additive mask
//! tensor built for the chunk (0 or -inf per score), then `softmax_last_dim`, each
//! allocating and filling a tensor as large as the scores, and computing `exp(-inf)` for
//! every score a row cannot see, which is nearly half of them in a long prompt. At 2048
//! prompt tokens those three were about a third of a prefill (`perf`).
//!
//! The values are the same bit for bit: each visible score is candle's `x * scale + 0`
//! (never -0, so adding the mask's 0 leaves it as it is), each hidden one -inf as the mask
//! makes it; the softmax is candle-nn's, with candle's own max and sum over the whole row,
//! and `exp(-inf - max)` is exactly the 0 written in its place.

use candle_core::cpu::kernels::VecOps;
use candle_core::{CpuStorage, InplaceOp1, Layout};
use rayon::prelude::*;

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
        let keys = row.len();
        let visible = (self.first_pos + r + 1).min(keys);
        // candle's affine casts its factor to the tensor's dtype.
        let scale = self.scale as f32;
        let (seen, hidden) = row.split_at_mut(visible);
        for x in seen.iter_mut() {
            *x = *x * scale + 0.0;
        }
        hidden.fill(f32::NEG_INFINITY);
        let mut max = f32::NEG_INFINITY;
        // SAFETY: the pointer and length describe `row`.
        unsafe { f32::vec_reduce_max(row.as_ptr(), &mut max, keys) };
        let (seen, hidden) = row.split_at_mut(visible);
        for x in seen.iter_mut() {
            *x = (*x - max).exp();
        }
        hidden.fill(0.0);
        let mut sum = 0f32;
        // SAFETY: as above.
        unsafe { f32::vec_reduce_sum(row.as_ptr(), &mut sum, keys) };
        for x in row.iter_mut() {
            *x /= sum;
        }
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
    use crate::act_quant::testing::xorshift_data;

    /// The values of `t`, as bits.
    fn bits(t: &Tensor) -> Vec<u32> {
        let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        values.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn equals_scale_mask_and_softmax_bit_for_bit() {
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
            assert!(bits(&general) == bits(&ours), "shape {i}: values differ");
        }
    }
}
