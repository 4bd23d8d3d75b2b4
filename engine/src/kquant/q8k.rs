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
        // Not zeroed first, as Q4_1's activations are not (`q4`).
        let mut rows = Self {
            cols,
            qs: Vec::with_capacity(x.len()),
            d: Vec::with_capacity(blocks),
            sums16: Vec::with_capacity(blocks * 16),
            sums32: Vec::with_capacity(blocks * 8),
        };
        let (qs, d) = (
            SharedOut::spare(&mut rows.qs, x.len()),
            SharedOut::spare(&mut rows.d, blocks),
        );
        let (s16, s32) = (
            SharedOut::spare(&mut rows.sums16, blocks * 16),
            SharedOut::spare(&mut rows.sums32, blocks * 8),
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
        // SAFETY: `each_run` ran every super-block, each writing its values, its scale and
        // its sums.
        unsafe {
            rows.qs.set_len(x.len());
            rows.d.set_len(blocks);
            rows.sums16.set_len(blocks * 16);
            rows.sums32.set_len(blocks * 8);
        }
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
    assert!(
        xs.len() == QK_K && out.qs.len() == QK_K,
        "a super-block is 256 values"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present, checked just above; the lengths are checked above.
            return unsafe { avx2::quantize_super_block(xs, out) };
        }
    }
    *out.d = scalar_quantize_values(xs, out.qs);
    scalar_sums(out);
}

/// The sums of [`quantize_super_block`] over its values.
fn scalar_sums(out: SuperBlockOut<'_>) {
    for (s, qs) in out.sums16.iter_mut().zip(out.qs.chunks_exact(16)) {
        *s = qs.iter().map(|&q| i16::from(q)).sum();
    }
    for (i, s) in out.sums32.iter_mut().enumerate() {
        *s = out.sums16[2 * i] + out.sums16[2 * i + 1];
    }
}

/// The largest magnitude and the first value that has it (NaNs have none).
fn signed_max(xs: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &x in xs {
        if x.abs() > amax {
            (amax, max) = (x.abs(), x);
        }
    }
    (amax, max)
}

/// The values and scale of [`quantize_super_block`].
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

    use super::{SuperBlockOut, QK_K};

    /// [`super::quantize_super_block`] on 256-bit registers, 32 values at a time: the
    /// scalar path's values, scale and sums, bit for bit. A 1.5B's prompt spent 4% of its
    /// samples in the scalar scan and byte stores this replaces.
    ///
    /// # Safety
    /// The CPU has AVX2; `xs` and `out.qs` hold `QK_K` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_super_block(xs: &[f32], out: SuperBlockOut<'_>) {
        let x = |i: usize| _mm256_loadu_ps(xs.as_ptr().add(i));
        let (amax, max) = signed_max(&x);
        if amax == 0.0 {
            out.qs.fill(0);
            *out.d = 0.0;
            out.sums16.fill(0);
            out.sums32.fill(0);
            return;
        }
        let iscale = -127.0 / max;
        let s = _mm256_set1_ps(iscale);
        let top = _mm256_set1_epi32(127);
        let q = |i: usize| {
            let v = _mm256_mul_ps(x(i), s);
            // A NaN (an infinite value times a zero scale, or a NaN) is 0, as the scalar
            // path's saturating cast makes it; every other value is within ±127.
            let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm256_min_epi32(_mm256_cvtps_epi32(r), top)
        };
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let flip = _mm256_set1_epi8(i8::MIN);
        for i in (0..QK_K).step_by(32) {
            // Saturating packs interleave the four registers by 128-bit lane; the
            // permutation puts their values back in order. Nothing saturates.
            let lo = _mm256_packs_epi32(q(i), q(i + 8));
            let hi = _mm256_packs_epi32(q(i + 16), q(i + 24));
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
            _mm256_storeu_si256(out.qs.as_mut_ptr().add(i) as *mut __m256i, bytes);
            // Each eight bytes' sum, offset by 128 a byte to make them unsigned.
            let mut eights = [0u64; 4];
            let sad = _mm256_sad_epu8(_mm256_xor_si256(bytes, flip), _mm256_setzero_si256());
            _mm256_storeu_si256(eights.as_mut_ptr() as *mut __m256i, sad);
            let sixteen = |a: u64, b: u64| (a + b) as i16 - 16 * 128;
            let (s0, s1) = (sixteen(eights[0], eights[1]), sixteen(eights[2], eights[3]));
            out.sums16[i / 16] = s0;
            out.sums16[i / 16 + 1] = s1;
            out.sums32[i / 32] = s0 + s1;
        }
        *out.d = 1.0 / iscale;
    }

    /// `super::signed_max` of the 256 values `x(i)` loads eight at a time: the largest
    /// magnitude (`vmaxps` returns its second operand where the first is a NaN, as the
    /// scalar comparison skips NaNs), then the first value that has it.
    ///
    /// # Safety
    /// The CPU has AVX2; `x(i)` reads values `i .. i + 8` for `i` under `QK_K`.
    #[inline(always)]
    unsafe fn signed_max(x: &impl Fn(usize) -> __m256) -> (f32, f32) {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for i in (0..QK_K).step_by(8) {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, x(i)), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let wanted = _mm256_set1_ps(amax);
        for i in (0..QK_K).step_by(8) {
            let v = x(i);
            let hit = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), wanted);
            let mask = _mm256_movemask_ps(hit);
            if mask != 0 {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                return (amax, lanes[mask.trailing_zeros() as usize]);
            }
        }
        // Every magnitude was zero or a NaN: no value holds one of zero that counts.
        (0.0, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act_quant::testing::xorshift_data;
    use crate::act_quant::POOLED_ROWS;

    /// A super-block's outputs: values, scale bits and sums.
    type Quantized = ([i8; QK_K], u32, [i16; 16], [i16; 8]);

    fn run(xs: &[f32], quantize: impl FnOnce(&[f32], SuperBlockOut<'_>)) -> Quantized {
        let (mut qs, mut d, mut sums16, mut sums32) = ([0; QK_K], 0f32, [0; 16], [0; 8]);
        let out = SuperBlockOut {
            qs: &mut qs,
            d: &mut d,
            sums16: &mut sums16,
            sums32: &mut sums32,
        };
        quantize(xs, out);
        (qs, d.to_bits(), sums16, sums32)
    }

    #[test]
    fn both_paths_give_the_same_bits() {
        let mut cases: Vec<Vec<f32>> = vec![vec![0.0; QK_K], vec![-0.0; QK_K]];
        // Values landing on halves once scaled, and a magnitude held by both signs (the
        // first is the one that counts).
        let mut halves: Vec<f32> = (0..QK_K).map(|i| i as f32 / 2.0 - 64.0).collect();
        halves[10] = 127.0;
        halves[20] = -127.0;
        cases.push(halves);
        // The last value the largest; sums at their extremes.
        let mut last = vec![-1.0; QK_K];
        last[QK_K - 1] = -1.5;
        cases.push(last);
        cases.push(vec![3.0; QK_K]);
        // NaNs are skipped by the search and quantize to 0; an infinite value is the
        // largest, and every value then quantizes to 0 or (itself) a NaN.
        for odd in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut xs = xorshift_data(QK_K, 7, 4.0);
            xs[3] = odd;
            xs[200] = odd;
            cases.push(xs);
        }
        let mut nans = vec![f32::NAN; QK_K];
        cases.push(nans.clone());
        nans[99] = -0.5;
        cases.push(nans);
        for seed in 0..200 {
            cases.push(xorshift_data(QK_K, seed, 0.01 + seed as f32));
        }
        for xs in &cases {
            let want = run(xs, |xs, out| {
                *out.d = scalar_quantize_values(xs, out.qs);
                scalar_sums(out);
            });
            assert_eq!(want, run(xs, quantize_super_block), "{xs:?}");
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
