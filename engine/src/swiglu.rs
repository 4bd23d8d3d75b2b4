//! The gated MLP's `silu(gate) * up` in one pass shared out over candle's pool, giving
//! candle's values bit for bit.
//!
//! candle runs `silu` and the product as two ops on the calling thread: a gate narrowed
//! from the stacked gate/up product is not contiguous, so neither op splits, and the pool
//! worker waits. That was about 8% of a batch-16 SmolLM2 step. Each value here is
//! candle's: `g / (1 + exp(-g))` rounded to f32, then times `up`.

use candle_core::{CpuStorage, Layout, Storage, Tensor};

use crate::error::Result;
use crate::split::SharedOut;

/// Values per work item: a few microseconds of `exp`, worth a hand-off to another thread.
const UNIT: usize = 256;

/// `silu(gate) * up` for `(rows, width)` f32 tensors in CPU memory whose rows are
/// contiguous (views into a stacked product included); other tensors go through candle's
/// own ops.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (n, w) = gate.dims2()?;
    if up.dims2()? == (n, w) {
        let (g_store, g_layout) = gate.storage_and_layout();
        let (u_store, u_layout) = up.storage_and_layout();
        if let (Some(g), Some(u)) = (
            rows(&g_store, g_layout, n, w),
            rows(&u_store, u_layout, n, w),
        ) {
            let mut out = vec![0f32; n * w];
            let shared = SharedOut::new(&mut out);
            let per_row = w.div_ceil(UNIT);
            candle_core::utils::barrier_pool().execute_chunked(n * per_row, |items| {
                for item in items {
                    let (r, c) = (item / per_row, item % per_row * UNIT);
                    let len = UNIT.min(w - c);
                    // SAFETY: each item owns its own `len` values of row `r`.
                    let o = unsafe { shared.slice(r * w + c, len) };
                    let g = &g.data[g.start + r * g.stride + c..][..len];
                    let u = &u.data[u.start + r * u.stride + c..][..len];
                    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                        *o = g / (1.0 + (-g).exp()) * u;
                    }
                }
            });
            return Ok(Tensor::from_vec(out, (n, w), gate.device())?);
        }
    }
    Ok((gate.silu()? * up)?)
}

/// An f32 matrix's rows: row `r` is `width` values from `start + r * stride`.
struct Rows<'a> {
    data: &'a [f32],
    start: usize,
    stride: usize,
}

/// `rows` rows of `width` contiguous f32 values, if that is how `layout` lays them out.
fn rows<'a>(storage: &'a Storage, layout: &Layout, rows: usize, width: usize) -> Option<Rows<'a>> {
    let Storage::Cpu(CpuStorage::F32(data)) = storage else {
        return None;
    };
    let (start, stride) = (layout.start_offset(), layout.stride());
    let fits = stride.len() == 2
        && (stride[1] == 1 || width == 1)
        && (stride[0] >= width || rows == 1)
        && (rows == 0 || start + (rows - 1) * stride[0] + width <= data.len());
    fits.then_some(Rows {
        data,
        start,
        stride: stride[0],
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::act_quant::testing::{bits_differ, values, xorshift_data};

    #[test]
    fn equals_candles_silu_then_product_bit_for_bit() {
        let dev = Device::Cpu;
        // (rows, width): one row and a batch, widths on and off the unit, SmolLM2's 1536.
        for (i, &(n, w)) in [(1, 1536), (16, 1536), (5, 300), (3, 7), (1, 1)]
            .iter()
            .enumerate()
        {
            // Spread wide enough for exp to overflow and underflow at the ends.
            let data = xorshift_data(n * 2 * w, i as u64, 240.0);
            let stacked = Tensor::from_vec(data, (n, 2 * w), &dev).unwrap();
            let (gate, up) = (
                stacked.narrow(1, 0, w).unwrap(),
                stacked.narrow(1, w, w).unwrap(),
            );
            let ours = values(&silu_mul(&gate, &up).unwrap());
            let differ = bits_differ(&ours, &values(&(gate.silu().unwrap() * &up).unwrap()));
            assert_eq!(differ, 0, "{n}x{w}: {differ} of {} values differ", n * w);
        }
    }

    #[test]
    fn other_layouts_go_through_candle() {
        let dev = Device::Cpu;
        let gate = Tensor::from_vec((0..12).map(|x| x as f32 - 6.0).collect(), (3, 4), &dev)
            .unwrap()
            .t()
            .unwrap();
        let up = Tensor::ones((4, 3), candle_core::DType::F32, &dev).unwrap();
        let ours = values(&silu_mul(&gate, &up).unwrap());
        let theirs = values(&gate.silu().unwrap());
        assert_eq!(ours, theirs, "a transposed gate is still silu(gate) * 1");
    }
}
