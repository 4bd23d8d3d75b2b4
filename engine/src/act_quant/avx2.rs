//! One block at a time on 256-bit registers.

use std::arch::x86_64::*;

/// # Safety
/// The CPU has AVX2; `xs` and `qs` hold at least `QK` values.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let sign = _mm256_set1_ps(-0.0);
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xs.as_ptr().add(8 * i)));
    // `max(a, m)` is `m` where `a` is NaN, as `f32::max` passes NaNs over.
    let mut m = _mm256_setzero_ps();
    for &x in &v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, x), m);
    }
    // The lanes' largest: the order does not matter to a maximum of magnitudes.
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
    let d = amax / ((1 << 7) - 1) as f32;
    let id = _mm256_set1_ps(if d != 0f32 { 1. / d } else { 0. });
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let ints = v.map(|x| {
        // `f32::round` rounds halves away from zero: truncate, then step one away from
        // zero where the dropped part is at least a half (`x - trunc(x)` is exact).
        let x = _mm256_mul_ps(x, id);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(x, t));
        let away = _mm256_or_ps(_mm256_and_ps(x, sign), one);
        let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), away);
        let r = _mm256_add_ps(t, step);
        // As `as i8` takes a float: NaN to 0 (a NaN or infinite value's; the products
        // of a scale that underflowed), the rest saturated, so that the conversion
        // meets only the integers a byte holds.
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        let r = _mm256_min_ps(
            _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
            _mm256_set1_ps(127.0),
        );
        _mm256_cvttps_epi32(r)
    });
    // The packs interleave the 128-bit lanes: four values of each vector in turn, the
    // low halves first; the permutation puts them back in order.
    let bytes = _mm256_packs_epi16(
        _mm256_packs_epi32(ints[0], ints[1]),
        _mm256_packs_epi32(ints[2], ints[3]),
    );
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, bytes);
    // Their sum: byte pairs times one into i16, i16 pairs into i32, then the lanes.
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
    let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    let s = _mm_add_epi32(
        _mm256_castsi256_si128(quads),
        _mm256_extracti128_si256::<1>(quads),
    );
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
    (d, sum)
}
