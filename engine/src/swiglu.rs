//! The gated MLP's `silu(gate) * up` in one pass shared out over candle's pool.
//!
//! candle runs `silu` and the product as two ops on the calling thread: a gate narrowed
//! from the stacked gate/up product is not contiguous, so neither op splits, and the pool
//! worker waits. That was about 8% of a batch-16 SmolLM2 step. Each value is
//! `g / (1 + exp(-g)) * up`, with `exp` computed eight lanes at a time (`crate::vexp`): libm's
//! scalar `expf` took another 4% of a batch-16 step. The lanes and the scalar twin that
//! finishes a row (and runs on CPUs without AVX2) give the same bits, so a value never
//! depends on where in a row it falls or on the CPU; they differ from libm's `expf` by at
//! most a few units in the last place.

use candle_core::Tensor;

use crate::cpu_rows::CpuRows;
use crate::error::Result;
use crate::split::SharedOut;
use crate::vexp::exp;

/// Values per work item: a few microseconds of `exp`, worth a hand-off to another thread.
const UNIT: usize = 256;

/// `silu(gate) * up` for `(rows, width)` tensors of the same shape. f32 tensors in CPU
/// memory whose rows are contiguous (views into a stacked product included) take the
/// kernel; other layouts take it on contiguous copies; other dtypes or devices, candle's
/// own ops.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (n, w) = gate.dims2()?;
    if up.dims2()? != (n, w) {
        return Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: gate.shape().clone(),
            rhs: up.shape().clone(),
            op: "silu_mul",
        }
        .into());
    }
    // A scope of its own: the storage guards go before any copy below reads the tensors.
    {
        let (g_store, g_layout) = gate.storage_and_layout();
        let (u_store, u_layout) = up.storage_and_layout();
        if let (Some(g), Some(u)) = (
            CpuRows::of(&g_store, g_layout, n, w),
            CpuRows::of(&u_store, u_layout, n, w),
        ) {
            let out = pooled(n, w, |r, c, o| {
                let g = &g.row(r)[c..][..o.len()];
                let u = &u.row(r)[c..][..o.len()];
                silu_mul_run(g, u, o);
            });
            return Ok(Tensor::from_vec(out, (n, w), gate.device())?);
        }
    }
    if !gate.is_contiguous() || !up.is_contiguous() {
        // Other layouts (never the model's): the same values, from contiguous copies.
        return silu_mul(&gate.contiguous()?, &up.contiguous()?);
    }
    // Not f32 in CPU memory.
    Ok((gate.silu()? * up)?)
}

/// `silu(gate) * up` of each of `rows`, each `width` gate values then `width` up values
/// (a mixture's gate/up products, several experts' rows one after another), shared out
/// over the pool as [`silu_mul`] is: `(rows, width)`, row-major.
pub(crate) fn silu_mul_rows(rows: &[&[f32]], width: usize) -> Vec<f32> {
    pooled(rows.len(), width, |r, c, o| {
        let (gate, up) = rows[r].split_at(width);
        silu_mul_run(&gate[c..][..o.len()], &up[c..][..o.len()], o);
    })
}

/// A `(rows, width)` output, row-major, shared out over the pool in runs of at most
/// [`UNIT`] values: `run(r, c, out)` writes values `c .. c + out.len()` of row `r`.
///
/// The output's memory comes from the allocator unwritten: `run` writes every value of
/// its `out` (`silu_mul_run` does). Clearing it first was 1% of a batch-16 step.
fn pooled(rows: usize, width: usize, run: impl Fn(usize, usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * width);
    let shared = SharedOut::spare(&mut out, rows * width);
    let per_row = width.div_ceil(UNIT);
    crate::split::in_ranges(rows * per_row, |items| {
        for item in items {
            let (r, c) = (item / per_row, item % per_row * UNIT);
            let len = UNIT.min(width - c);
            // SAFETY: each item owns its own `len` values of row `r`.
            run(r, c, unsafe { shared.slice(r * width + c, len) });
        }
    });
    // SAFETY: the items are every run of every row, each written whole by `run`.
    unsafe { out.set_len(rows * width) };
    out
}

/// `out[i] = g[i] / (1 + exp(-g[i])) * u[i]`.
fn silu_mul_run(g: &[f32], u: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present, checked just above.
            done = unsafe { avx2::silu_mul(g, u, out) };
        }
    }
    for ((o, &g), &u) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::vexp::avx2::exp8;

    /// `silu(g) * u` for the whole groups of eight; returns how many values it wrote.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `u` and `out` are at least as long as `g`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let whole = g.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let sign = _mm256_set1_ps(-0.0);
        for i in (0..whole).step_by(8) {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = exp8(_mm256_xor_ps(gv, sign));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            let o = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), o);
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::act_quant::testing::{values, xorshift_data};

    #[test]
    fn silu_times_up_is_within_rounding_and_the_same_wherever_a_value_falls() {
        let dev = Device::Cpu;
        // (rows, width): one row and a batch, widths on and off the unit and the lanes,
        // SmolLM2's 1536.
        for (i, &(n, w)) in [(1, 1536), (16, 1536), (5, 300), (3, 7), (1, 1)]
            .iter()
            .enumerate()
        {
            // Spread wide enough for exp to overflow and underflow at the ends.
            let data = xorshift_data(n * 2 * w, i as u64, 240.0);
            let stacked = Tensor::from_vec(data.clone(), (n, 2 * w), &dev).unwrap();
            let (gate, up) = (
                stacked.narrow(1, 0, w).unwrap(),
                stacked.narrow(1, w, w).unwrap(),
            );
            let ours = values(&silu_mul(&gate, &up).unwrap());
            for (r, row) in data.chunks_exact(2 * w).enumerate() {
                let (g, u) = row.split_at(w);
                for c in 0..w {
                    let (g, u) = (g[c] as f64, u[c] as f64);
                    let want = g / (1.0 + (-g).exp()) * u;
                    let got = ours[r * w + c] as f64;
                    assert!(
                        (got - want).abs() <= want.abs() * 1e-6 + 1e-30,
                        "{n}x{w} [{r}, {c}]: {got} against {want}"
                    );
                }
                // Each value alone, through the scalar twin, has the same bits.
                let mut alone = vec![0f32; w];
                for c in 0..w {
                    silu_mul_run(&g[c..c + 1], &u[c..c + 1], &mut alone[c..c + 1]);
                }
                assert_eq!(alone[..], ours[r * w..][..w], "{n}x{w} row {r}");
            }
        }
    }

    #[test]
    fn other_layouts_give_the_same_values() {
        let dev = Device::Cpu;
        let gate = Tensor::from_vec((0..12).map(|x| x as f32 - 6.0).collect(), (3, 4), &dev)
            .unwrap()
            .t()
            .unwrap();
        let up = Tensor::ones((4, 3), candle_core::DType::F32, &dev).unwrap();
        let ours = values(&silu_mul(&gate, &up).unwrap());
        let contiguous = values(&silu_mul(&gate.contiguous().unwrap(), &up).unwrap());
        assert_eq!(
            ours, contiguous,
            "a transposed gate is still silu(gate) * 1"
        );
        assert!(
            silu_mul(&gate, &up.t().unwrap()).is_err(),
            "shapes that differ"
        );
    }
}
