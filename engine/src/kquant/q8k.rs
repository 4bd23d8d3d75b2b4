//! Activation rows quantized as llama.cpp quantizes them for the K-quants: Q8_K, one scale
//! per 256 values (`quantize_row_q8_K_ref`, which ggml's x86 build runs), with the sums of
//! the quantized values over each 16 and each 32 that the kernels' minimum and offset
//! terms take. The AVX2 path and the scalar one give the same bits.
//!
//! A product's rows are quantized across candle's pool when there are enough of them: on
//! one thread, a 512-token prompt's rows took the other core's time too, which waited.

use crate::act_quant::each_run;
use crate::split::SharedOut;

/// Weights (and activations) in a super-block.
pub(crate) const QK_K: usize = 256;

/// Activation rows as Q8_K, row after row.
pub(crate) struct Q8KRows {
    cols: usize,
    qs: Vec<i8>,
    /// Each super-block's scale.
    d: Vec<f32>,
    /// The sum of each 16 quantized values.
    sums16: Vec<i16>,
    /// The sum of each 32.
    sums32: Vec<i16>,
}

/// One activation row of [`Q8KRows`].
#[derive(Clone, Copy)]
pub(crate) struct Q8KRow<'a> {
    pub(crate) qs: &'a [i8],
    pub(crate) d: &'a [f32],
    pub(crate) sums16: &'a [i16],
    pub(crate) sums32: &'a [i16],
}

/// One super-block's outputs: its values, scale and sums.
struct SuperBlockOut<'a> {
    qs: &'a mut [i8],
    d: &'a mut f32,
    sums16: &'a mut [i16],
    sums32: &'a mut [i16],
}

impl Q8KRows {
    /// Quantizes `x`, rows of `cols` values (a multiple of 256).
    pub(crate) fn quantize(x: &[f32], cols: usize) -> Self {
        assert!(cols.is_multiple_of(QK_K) && x.len().is_multiple_of(cols));
        let n = x.len() / cols;
        let blocks = x.len() / QK_K;
        let mut rows = Self {
            cols,
            qs: vec![0; x.len()],
            d: vec![0.0; blocks],
            sums16: vec![0; blocks * 16],
            sums32: vec![0; blocks * 8],
        };
        let (qs, d) = (SharedOut::new(&mut rows.qs), SharedOut::new(&mut rows.d));
        let (s16, s32) = (
            SharedOut::new(&mut rows.sums16),
            SharedOut::new(&mut rows.sums32),
        );
        each_run(n, cols / QK_K, |run| {
            for b in run {
                // SAFETY: each super-block's parts are written by the one worker that got it.
                let out = unsafe {
                    SuperBlockOut {
                        qs: qs.slice(b * QK_K, QK_K),
                        d: &mut d.slice(b, 1)[0],
                        sums16: s16.slice(b * 16, 16),
                        sums32: s32.slice(b * 8, 8),
                    }
                };
                quantize_super_block(&x[b * QK_K..(b + 1) * QK_K], out);
            }
        });
        rows
    }

    /// Row `y`.
    #[inline]
    pub(crate) fn row(&self, y: usize) -> Q8KRow<'_> {
        let nb = self.cols / QK_K;
        Q8KRow {
            qs: &self.qs[y * self.cols..(y + 1) * self.cols],
            d: &self.d[y * nb..(y + 1) * nb],
            sums16: &self.sums16[y * nb * 16..(y + 1) * nb * 16],
            sums32: &self.sums32[y * nb * 8..(y + 1) * nb * 8],
        }
    }
}

/// Quantizes 256 values: the scale `1 / (-127 / max)`, `max` the first value of largest
/// magnitude; each value times `-127 / max` rounded half to even (llama.cpp's
/// `nearest_int`), at most 127; then the sums.
fn quantize_super_block(xs: &[f32], out: SuperBlockOut<'_>) {
    *out.d = quantize_values(xs, out.qs);
    for (s, qs) in out.sums16.iter_mut().zip(out.qs.chunks_exact(16)) {
        *s = qs.iter().map(|&q| i16::from(q)).sum();
    }
    for (i, s) in out.sums32.iter_mut().enumerate() {
        *s = out.sums16[2 * i] + out.sums16[2 * i + 1];
    }
}

/// The values and scale of [`quantize_super_block`].
pub(crate) fn quantize_values(xs: &[f32], qs: &mut [i8]) -> f32 {
    assert!(
        xs.len() == QK_K && qs.len() == QK_K,
        "a super-block is 256 values"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present, checked just above; the lengths are checked above.
            return unsafe { avx2::quantize_values(xs, qs) };
        }
    }
    scalar_quantize_values(xs, qs)
}

/// The largest magnitude and the first value that has it.
fn signed_max(xs: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &x in xs {
        if x.abs() > amax {
            (amax, max) = (x.abs(), x);
        }
    }
    (amax, max)
}

fn scalar_quantize_values(xs: &[f32], qs: &mut [i8]) -> f32 {
    let (amax, max) = signed_max(xs);
    if amax == 0.0 {
        qs.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &x) in qs.iter_mut().zip(xs) {
        *q = ((iscale * x).round_ties_even() as i32).min(127) as i8;
    }
    1.0 / iscale
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{signed_max, QK_K};

    /// # Safety
    /// The CPU has AVX2; `xs` and `qs` hold `QK_K` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_values(xs: &[f32], qs: &mut [i8]) -> f32 {
        // The scan for the first value of largest magnitude stays scalar: it is the
        // scalar path's, tie for tie.
        let (amax, max) = signed_max(xs);
        if amax == 0.0 {
            qs.fill(0);
            return 0.0;
        }
        let iscale = -127.0 / max;
        let s = _mm256_set1_ps(iscale);
        let top = _mm256_set1_epi32(127);
        for i in (0..QK_K).step_by(8) {
            let v = _mm256_mul_ps(_mm256_loadu_ps(xs.as_ptr().add(i)), s);
            // Rounded half to even, as `round_ties_even`, then exact as an integer.
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            let q = _mm256_min_epi32(_mm256_cvtps_epi32(r), top);
            let mut ints = [0i32; 8];
            _mm256_storeu_si256(ints.as_mut_ptr() as *mut __m256i, q);
            for (o, i) in qs[i..i + 8].iter_mut().zip(ints) {
                // At least -127: no value is past the one `iscale` was taken from.
                *o = i as i8;
            }
        }
        1.0 / iscale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act_quant::testing::xorshift_data;
    use crate::act_quant::POOLED_ROWS;

    #[test]
    fn both_paths_give_the_same_bits() {
        let mut cases: Vec<Vec<f32>> = vec![vec![0.0; QK_K], vec![-0.0; QK_K]];
        // Values landing on halves once scaled, and a magnitude held by both signs (the
        // first is the one that counts).
        let mut halves: Vec<f32> = (0..QK_K).map(|i| i as f32 / 2.0 - 64.0).collect();
        halves[10] = 127.0;
        halves[20] = -127.0;
        cases.push(halves);
        for seed in 0..200 {
            cases.push(xorshift_data(QK_K, seed, 0.01 + seed as f32));
        }
        for xs in &cases {
            let (mut want, mut got) = ([0i8; QK_K], [0i8; QK_K]);
            let a = scalar_quantize_values(xs, &mut want);
            let b = quantize_values(xs, &mut got);
            assert_eq!((a.to_bits(), want), (b.to_bits(), got), "{xs:?}");
        }
    }

    #[test]
    fn rows_quantized_in_the_pool_are_the_rows_quantized_alone() {
        let cols = 2 * QK_K;
        let x = xorshift_data(3 * POOLED_ROWS * cols, 5, 8.0);
        let pooled = Q8KRows::quantize(&x, cols);
        for (y, xs) in x.chunks_exact(cols).enumerate() {
            let alone = Q8KRows::quantize(xs, cols);
            let (a, b) = (alone.row(0), pooled.row(y));
            assert_eq!((a.qs, a.sums16, a.sums32), (b.qs, b.sums16, b.sums32));
            assert_eq!(a.d, b.d);
            let sum = |qs: &[i8]| qs.iter().map(|&q| i16::from(q)).sum::<i16>();
            assert_eq!(a.sums32[3], sum(&a.qs[96..128]), "row {y}");
        }
    }
}
