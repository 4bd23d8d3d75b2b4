//! `exp` eight lanes at a time, with a scalar twin that gives the same bits: libm's scalar
//! `expf` took about 4% of a batch-16 decode step in the MLP's silu and 3% in attention's
//! softmax, and more of a long prompt's prefill. Within 2 units in the last place of the
//! exact value, not libm's bits: every kernel that takes `exp` (the silu, both softmaxes)
//! takes it from here, so the decode step's and the prompt path's attention still agree.

/// `exp` (Cephes' `expf`): `x = n ln 2 + r`, `exp(r)` from a degree-6 polynomial, then
/// `2^n` put in the exponent. [`avx2::exp8`] does the same operations lane by lane.
/// Inputs are clamped to ±88.376, so the result is never infinite and under about
/// `1.2e-38` it is 0.
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-EXP_LIMIT, EXP_LIMIT);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let p = EXP_POLY[1..]
        .iter()
        .fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_LIMIT: f32 = 88.376_26;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts, so that `n ln 2` is exact in the first.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' coefficients, highest degree first.
const EXP_POLY: [f32; 6] = [
    1.987_569_2e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `xs[i] = exp(xs[i] - max)` for every value.
pub(crate) fn exp_minus(xs: &mut [f32], max: f32) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present, checked just above.
            done = unsafe { avx2::exp_minus(xs, max) };
        }
    }
    for x in &mut xs[done..] {
        *x = exp(*x - max);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{EXP_LIMIT, EXP_POLY, LN2_HI, LN2_LO, LOG2E};

    /// [`super::exp`] in eight lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline(always)]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-EXP_LIMIT)),
            _mm256_set1_ps(EXP_LIMIT),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
    }

    /// [`super::exp_minus`] for the whole groups of eight; returns how many it did.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_minus(xs: &mut [f32], max: f32) -> usize {
        let whole = xs.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        for i in (0..whole).step_by(8) {
            let p = xs.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m)));
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp` over its whole range: within 2 units in the last place of the exact value,
    /// and in every lane the scalar's bits.
    #[test]
    fn exp_is_within_two_ulp_and_the_lanes_match_the_scalar() {
        let mut xs: Vec<f32> = (-1_000_000..=1_000_000)
            .map(|i| i as f32 * 8.8e-5)
            .collect();
        xs.extend([
            0.0,
            -0.0,
            0.5 * std::f32::consts::LN_2,
            1e-30,
            -1e-30,
            87.0,
            -87.0,
        ]);
        xs.extend([88.5, -88.5, 100.0, -100.0, f32::MAX, f32::MIN]);
        for &x in &xs {
            let (got, want) = (exp(x), (x as f64).exp());
            if (-87.0..=88.3).contains(&x) {
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(
                    (got as f64 - want).abs() <= 2.0 * ulp as f64,
                    "exp({x}) = {got}, exactly {want}"
                );
            } else if x > 0.0 {
                assert!(got.is_finite() && got > 1e38, "exp({x}) = {got}");
            } else {
                assert!(got < 1e-37, "exp({x}) = {got}");
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            for chunk in xs.chunks_exact(8) {
                // SAFETY: AVX2 and FMA are present, checked above.
                let lanes = unsafe {
                    let mut out = [0f32; 8];
                    let v = std::arch::x86_64::_mm256_loadu_ps(chunk.as_ptr());
                    std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), avx2::exp8(v));
                    out
                };
                for (x, e) in chunk.iter().zip(lanes) {
                    assert_eq!(exp(*x).to_bits(), e.to_bits(), "exp({x})");
                }
            }
        }
    }

    #[test]
    fn exp_minus_gives_the_scalar_s_bits_wherever_a_value_falls() {
        let xs = crate::act_quant::testing::xorshift_data(1003, 5, 60.0);
        for start in [0, 1, 5] {
            let mut lanes = xs[start..].to_vec();
            exp_minus(&mut lanes, 3.5);
            for (x, e) in xs[start..].iter().zip(lanes) {
                assert_eq!(exp(x - 3.5).to_bits(), e.to_bits(), "exp({x} - 3.5)");
            }
        }
    }
}
