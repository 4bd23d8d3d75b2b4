//! Sixteen blocks at a time on 512-bit registers: each block's largest magnitude and sum
//! found for all sixteen at once, so that a run takes two divisions and two reductions
//! where one block at a time takes them per block.

use std::arch::x86_64::*;

use super::{QK, RUN};

/// Blocks `RUN` at a time as `quantize_block` quantizes each: block `b`'s values into
/// `qs[QK * b..]`, its scale into `d[b]` and the sum of its quantized values into `sums[b]`.
///
/// # Safety
/// The CPU has AVX-512F; `xs` and `qs` hold at least `RUN * QK` values, `d` and `sums` at
/// least `RUN`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn quantize_run(xs: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i32]) {
    // Plain loops: `array::map` and `from_fn` are not compiled with this function's
    // features, and called the intrinsics out of line. The values are loaded twice, not
    // held: sixteen blocks fill every register.
    let load = |b: usize, h: usize| _mm512_loadu_ps(xs.as_ptr().add(QK * b + 16 * h));
    let zero = _mm512_setzero_ps();
    let mut m = [zero; RUN];
    for (b, m) in m.iter_mut().enumerate() {
        for h in 0..2 {
            // `max(a, m)` is `m` where `a` is NaN, as `f32::max` passes NaNs over: no
            // NaN reaches the reduction, whose order then does not matter.
            *m = _mm512_max_ps(_mm512_abs_ps(load(b, h)), *m);
        }
    }
    let amax = across(&m, Op::Max);
    let scale = _mm512_div_ps(amax, _mm512_set1_ps(((1 << 7) - 1) as f32));
    // `d != 0`, which is also true of a NaN.
    let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(scale, zero);
    let id = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), scale);
    _mm512_storeu_ps(d.as_mut_ptr(), scale);
    let mut ids = [0f32; RUN];
    _mm512_storeu_ps(ids.as_mut_ptr(), id);
    let mut totals = [zero; RUN];
    for (b, (total_b, &id)) in totals.iter_mut().zip(&ids).enumerate() {
        let id = _mm512_set1_ps(id);
        let mut total = _mm512_setzero_si512();
        for h in 0..2 {
            let ints = round(_mm512_mul_ps(load(b, h), id));
            let at = qs.as_mut_ptr().add(QK * b + 16 * h) as *mut __m128i;
            _mm_storeu_si128(at, _mm512_cvtepi32_epi8(ints));
            total = _mm512_add_epi32(total, ints);
        }
        *total_b = _mm512_castsi512_ps(total);
    }
    let total = across(&totals, Op::AddInts);
    _mm512_storeu_si512(
        sums.as_mut_ptr() as *mut __m512i,
        _mm512_castps_si512(total),
    );
}

/// `x` rounded half away from zero, as `f32::round`, then converted as `as i8` converts a
/// float: NaN to 0, the rest saturated to a byte's range; in 32-bit lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn round(x: __m512) -> __m512i {
    // Truncate, then step one away from zero where the dropped part is at least a half
    // (`x - trunc(x)` is exact).
    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
    let frac = _mm512_abs_ps(_mm512_sub_ps(x, t));
    let sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
    let away = _mm512_or_si512(sign, _mm512_castps_si512(_mm512_set1_ps(1.0)));
    let half = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
    let r = _mm512_mask_add_ps(t, half, t, _mm512_castsi512_ps(away));
    let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
    let r = _mm512_min_ps(
        _mm512_max_ps(r, _mm512_set1_ps(-128.0)),
        _mm512_set1_ps(127.0),
    );
    _mm512_maskz_cvttps_epi32(ordered, r)
}

/// What [`across`] reduces with: orders that do not matter.
#[derive(Clone, Copy)]
enum Op {
    Max,
    /// The lanes' bits as 32-bit integers, added: exact.
    AddInts,
}

impl Op {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn apply(self, a: __m512, b: __m512) -> __m512 {
        match self {
            Op::Max => _mm512_max_ps(a, b),
            Op::AddInts => _mm512_castsi512_ps(_mm512_add_epi32(
                _mm512_castps_si512(a),
                _mm512_castps_si512(b),
            )),
        }
    }
}

/// Lane `k`: `op` over the sixteen lanes of `v[k]`. Halves each step: pairs of vectors
/// interleaved within their 128-bit lanes, then quarters of them, then the 128-bit lanes
/// themselves, twice.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn across(v: &[__m512; 16], op: Op) -> __m512 {
    // Each 128-bit lane of `r[j]`: [a0∘a2, b0∘b2, a1∘a3, b1∘b3] of `v[2j]`, `v[2j + 1]`.
    let mut r = [_mm512_setzero_ps(); 8];
    for j in 0..8 {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        r[j] = op.apply(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // Each 128-bit lane of `s[j]`: `v[4j .. 4j + 4]`'s partial results in order.
    let mut s = [_mm512_setzero_ps(); 4];
    for j in 0..4 {
        let (a, b) = (r[2 * j], r[2 * j + 1]);
        let lo = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
        s[j] = op.apply(lo, _mm512_shuffle_ps::<0b11_10_11_10>(a, b));
    }
    let t0 = lanes(s[0], s[1], op);
    lanes(t0, lanes(s[2], s[3], op), op)
}

/// The 128-bit lanes 0, 2 of each of `a`, `b` against 1, 3: [a L01, a L23, b L01, b L23].
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lanes(a: __m512, b: __m512, op: Op) -> __m512 {
    op.apply(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
    )
}

/// Q8_1's scales from `RUN` blocks' scales `d` and sums: each scale rounded through f16 in
/// place, and `s[b] = f16(f16(sums[b]) * d[b])`, as `half` rounds them one at a time (with
/// F16C, the same conversion).
///
/// # Safety
/// The CPU has AVX-512F; `d`, `sums` and `s` hold at least `RUN` values.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn q81_scales(d: &mut [f32], sums: &[i32], s: &mut [f32]) {
    let d16 = through_f16(_mm512_loadu_ps(d.as_ptr()));
    let sum = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums.as_ptr() as *const __m512i));
    _mm512_storeu_ps(d.as_mut_ptr(), d16);
    _mm512_storeu_ps(
        s.as_mut_ptr(),
        through_f16(_mm512_mul_ps(through_f16(sum), d16)),
    );
}

/// `x` rounded to the nearest f16, ties to even, and widened back.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn through_f16(x: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(x))
}
