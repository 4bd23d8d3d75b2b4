//! RMSNorm with candle's bits, eight rows' sums of squares run side by side, shared out over
//! candle's pool.
//!
//! candle's op sums each row's squares one after another, a chain of dependent adds, and
//! runs a batch of up to 32 rows on the calling thread while the pool's worker waits: in a
//! batch-16 SmolLM2 step on a Zen 5 that was 3.5% of the calling thread's samples, 70% of
//! it in the adds. Here each row's squares are still added in candle's order, one at a
//! time, so every value has candle's bits, but eight rows' chains are interleaved, and a
//! batch's blocks of eight rows go to the pool's threads.

use candle_core::{CpuStorage, Storage, Tensor};

use crate::cpu_rows::CpuRows;
use crate::error::Result;
use crate::split::SharedOut;

/// Rows whose sums of squares run side by side: enough independent adds to cover an add's
/// latency on the CPUs the engine targets (3-4 cycles, two or more a cycle).
const SIDE: usize = 8;

/// `x / sqrt(mean(x²) + eps) * weight` over the last dimension of `x`, as
/// `candle_nn::ops::rms_norm` computes it, to the bit. f32 tensors in CPU memory take the
/// kernel below; others (a GPU's, other dtypes, a layout whose rows are not contiguous)
/// take candle's op.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let width = weight.elem_count();
    if width > 0 && x.dims().last() == Some(&width) && x.is_contiguous() {
        let rows = x.elem_count() / width;
        let flat = x.reshape((rows, width))?;
        let (x_store, x_layout) = flat.storage_and_layout();
        let (w_store, w_layout) = weight.storage_and_layout();
        if let (Some(src), Storage::Cpu(CpuStorage::F32(w)), Some((from, to))) = (
            CpuRows::of(&x_store, x_layout, rows, width),
            &*w_store,
            w_layout.contiguous_offsets(),
        ) {
            let out = normed(&src, rows, &w[from..to], eps);
            return Ok(Tensor::from_vec(out, x.shape(), x.device())?);
        }
    }
    Ok(candle_nn::ops::rms_norm(x, weight, eps)?)
}

/// The `(rows, alpha.len())` normed rows of `src`, row-major: blocks of [`SIDE`] rows, over
/// the pool.
fn normed(src: &CpuRows<'_>, rows: usize, alpha: &[f32], eps: f32) -> Vec<f32> {
    let width = alpha.len();
    let mut out = Vec::with_capacity(rows * width);
    let shared = SharedOut::spare(&mut out, rows * width);
    let block = |b: usize| {
        let first = b * SIDE;
        let n = SIDE.min(rows - first);
        // SAFETY: block `b` owns its own rows' values.
        let dst = unsafe { shared.slice(first * width, n * width) };
        norm_block(src, first, n, alpha, eps, dst);
    };
    crate::split::in_ranges(rows.div_ceil(SIDE), |items| items.for_each(block));
    // SAFETY: the blocks are every row, each written whole by `norm_block`.
    unsafe { out.set_len(rows * width) };
    out
}

/// Rows `first .. first + n` (`n` at most [`SIDE`]) of `src` normed into `dst`.
fn norm_block(src: &CpuRows<'_>, first: usize, n: usize, alpha: &[f32], eps: f32, dst: &mut [f32]) {
    let width = alpha.len();
    // A block of fewer rows repeats its last: the chains run side by side, so the spare
    // ones cost no time.
    let rows: [&[f32]; SIDE] = std::array::from_fn(|i| src.row(first + i.min(n - 1)));
    let sums = sums_of_squares(&rows, width);
    for ((row, sum2), dst) in rows.iter().zip(sums).zip(dst.chunks_exact_mut(width)) {
        let m = (sum2 / width as f32 + eps).sqrt();
        for ((d, s), a) in dst.iter_mut().zip(row.iter()).zip(alpha) {
            *d = *s / m * *a;
        }
    }
}

/// Each row's squares added one after another from the first, as candle's `sum` of them
/// adds them. Its sum starts from -0.0 and these from 0.0; a square is never -0.0, so the
/// first add gives the same bits either way.
#[inline(always)]
fn sums_of_squares(rows: &[&[f32]; SIDE], width: usize) -> [f32; SIDE] {
    let mut acc = [0f32; SIDE];
    for k in 0..width {
        for (acc, row) in acc.iter_mut().zip(rows) {
            let v = row[k];
            *acc += v * v;
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::act_quant::testing::xorshift_data;

    /// Every row's bits are candle's op's, for batches that fill blocks, leave a partial
    /// one, take one block or several over the pool, and a wide row of 3-D input.
    #[test]
    fn has_candles_bits() {
        for (shape, width) in [
            (vec![1, 576], 576),
            (vec![5, 64], 64),
            (vec![16, 576], 576),
            (vec![33, 100], 100),
            (vec![2, 3, 1536], 1536),
        ] {
            let n: usize = shape.iter().product();
            let x =
                Tensor::from_vec(xorshift_data(n, 7, 4.0), shape.clone(), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(xorshift_data(width, 11, 4.0), width, &Device::Cpu).unwrap();
            let ours = rms_norm(&x, &w, 1e-5).unwrap();
            let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(ours.dims(), theirs.dims());
            let bits = |t: &Tensor| -> Vec<u32> {
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(&ours), bits(&theirs), "{shape:?}");
        }
    }

    /// Another dtype takes candle's op, and so does a weight of the wrong width, which
    /// candle refuses.
    #[test]
    fn others_take_candles_op() {
        let x = Tensor::from_vec(xorshift_data(8 * 64, 3, 4.0), (8, 64), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(xorshift_data(64, 5, 4.0), 64, &Device::Cpu).unwrap();
        let (h, wh) = (
            x.to_dtype(DType::F16).unwrap(),
            w.to_dtype(DType::F16).unwrap(),
        );
        let values = |t: Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(
            values(rms_norm(&h, &wh, 1e-6).unwrap()),
            values(candle_nn::ops::rms_norm(&h, &wh, 1e-6).unwrap())
        );
        assert!(rms_norm(&x, &w.narrow(0, 0, 32).unwrap(), 1e-6).is_err());
    }
}
