//! The registers the K-quant kernels run on: one group's eight rows across 256 bits
//! ([`Ymm`]), or two groups' side by side across 512 ([`Zmm`]), the first group in the low
//! half. Every operation here works within 128-bit lanes or narrower, so a 512-bit register
//! computes lane for lane what two 256-bit ones do: the same bits.
//!
//! A value of either type is where its groups' blocks are; its methods read them.

use std::arch::x86_64::*;

/// Registers of one or two groups.
///
/// # Safety
/// Every method needs AVX2, FMA and F16C, and for [`Zmm`] AVX-512 F, BW and VL besides;
/// those that read the blocks say what they read.
pub(super) trait Wide: Copy {
    /// Integer lanes.
    type I: Copy;
    /// Float lanes.
    type F: Copy;
    /// Float lanes in a register, the first group's eight first.
    const LANES: usize;

    /// The same blocks `by` bytes on.
    fn add(self, by: usize) -> Self;

    /// # Safety
    /// 32 bytes at `at` of each group's blocks are readable.
    unsafe fn load(self, at: usize) -> Self::I;

    /// Each group's 16 signed bytes at `at`, as i16.
    ///
    /// # Safety
    /// 16 bytes at `at` of each group's blocks are readable.
    unsafe fn pairs(self, at: usize) -> Self::I;

    /// Each group's eight f16 at `at`, as f32.
    ///
    /// # Safety
    /// 16 bytes at `at` of each group's blocks are readable.
    unsafe fn halves(self, at: usize) -> Self::F;

    unsafe fn zero() -> Self::I;
    unsafe fn splat8(v: i8) -> Self::I;
    unsafe fn splat32(v: i32) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add16(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub32(a: Self::I, b: Self::I) -> Self::I;
    /// 16-bit lanes shifted left by `n` (`n` under 16).
    unsafe fn shl16(a: Self::I, n: i32) -> Self::I;
    /// 16-bit lanes shifted right by `n` (`n` under 16).
    unsafe fn shr16(a: Self::I, n: i32) -> Self::I;
    /// 32-bit lanes shifted left by `n` (`n` under 32).
    unsafe fn shl32(a: Self::I, n: i32) -> Self::I;
    /// Each 128-bit lane's bytes picked by `pattern`.
    unsafe fn shuffle(a: Self::I, pattern: &[i8; 16]) -> Self::I;
    /// Unsigned bytes `a` times signed `b`, adjacent pairs added, saturated to i16.
    unsafe fn maddubs(a: Self::I, b: Self::I) -> Self::I;
    /// i16 times i16, adjacent pairs added to i32.
    unsafe fn madd16(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn mullo32(a: Self::I, b: Self::I) -> Self::I;
    /// `acc` plus unsigned bytes `a` times signed `b`, four adjacent products a lane.
    ///
    /// # Safety
    /// The CPU has AVX-512 VNNI besides.
    unsafe fn dpbusd(acc: Self::I, a: Self::I, b: Self::I) -> Self::I;

    unsafe fn zero_f() -> Self::F;
    unsafe fn splat_f(v: f32) -> Self::F;
    unsafe fn to_f(a: Self::I) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a * b + c`, rounded once.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c - a * b`, rounded once.
    unsafe fn fnmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Stores `a` at `to`.
    ///
    /// # Safety
    /// `to` holds [`Wide::LANES`] floats.
    unsafe fn store(a: Self::F, to: &mut [f32]);
}

/// One group's blocks.
#[derive(Clone, Copy)]
pub(super) struct Ymm(pub(super) *const u8);

/// Two groups' blocks, in output order.
#[derive(Clone, Copy)]
pub(super) struct Zmm(pub(super) [*const u8; 2]);

// SAFETY (every method): the caller has the CPU's features and the blocks' bytes that
// [`Wide`] names.
impl Wide for Ymm {
    type I = __m256i;
    type F = __m256;
    const LANES: usize = 8;

    #[inline(always)]
    fn add(self, by: usize) -> Self {
        Self(self.0.wrapping_add(by))
    }
    #[inline(always)]
    unsafe fn load(self, at: usize) -> __m256i {
        _mm256_loadu_si256(self.0.add(at) as *const __m256i)
    }
    #[inline(always)]
    unsafe fn pairs(self, at: usize) -> __m256i {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(self.0.add(at) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn halves(self, at: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(self.0.add(at) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn zero() -> __m256i {
        _mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m256i {
        _mm256_set1_epi8(v)
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m256i {
        _mm256_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        _mm256_and_si256(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
        _mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn add16(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn add32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn shl16(a: __m256i, n: i32) -> __m256i {
        _mm256_sll_epi16(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn shr16(a: __m256i, n: i32) -> __m256i {
        _mm256_srl_epi16(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn shl32(a: __m256i, n: i32) -> __m256i {
        _mm256_sll_epi32(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn shuffle(a: __m256i, pattern: &[i8; 16]) -> __m256i {
        let p = _mm_loadu_si128(pattern.as_ptr() as *const __m128i);
        _mm256_shuffle_epi8(a, _mm256_broadcastsi128_si256(p))
    }
    #[inline(always)]
    unsafe fn maddubs(a: __m256i, b: __m256i) -> __m256i {
        _mm256_maddubs_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn madd16(a: __m256i, b: __m256i) -> __m256i {
        _mm256_madd_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn mullo32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_mullo_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn zero_f() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn to_f(a: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn fnmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fnmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(a: __m256, to: &mut [f32]) {
        _mm256_storeu_ps(to.as_mut_ptr(), a);
    }
}

// SAFETY (every method): as for `Ymm`'s.
impl Wide for Zmm {
    type I = __m512i;
    type F = __m512;
    const LANES: usize = 16;

    #[inline(always)]
    fn add(self, by: usize) -> Self {
        Self(self.0.map(|p| p.wrapping_add(by)))
    }
    #[inline(always)]
    unsafe fn load(self, at: usize) -> __m512i {
        let lo = _mm256_loadu_si256(self.0[0].add(at) as *const __m256i);
        let hi = _mm256_loadu_si256(self.0[1].add(at) as *const __m256i);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
    #[inline(always)]
    unsafe fn pairs(self, at: usize) -> __m512i {
        _mm512_cvtepi8_epi16(self.both_128(at))
    }
    #[inline(always)]
    unsafe fn halves(self, at: usize) -> __m512 {
        _mm512_cvtph_ps(self.both_128(at))
    }
    #[inline(always)]
    unsafe fn zero() -> __m512i {
        _mm512_setzero_si512()
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m512i {
        _mm512_set1_epi8(v)
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m512i {
        _mm512_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn add16(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn add32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn shl16(a: __m512i, n: i32) -> __m512i {
        _mm512_sll_epi16(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn shr16(a: __m512i, n: i32) -> __m512i {
        _mm512_srl_epi16(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn shl32(a: __m512i, n: i32) -> __m512i {
        _mm512_sll_epi32(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn shuffle(a: __m512i, pattern: &[i8; 16]) -> __m512i {
        let p = _mm_loadu_si128(pattern.as_ptr() as *const __m128i);
        _mm512_shuffle_epi8(a, _mm512_broadcast_i32x4(p))
    }
    #[inline(always)]
    unsafe fn maddubs(a: __m512i, b: __m512i) -> __m512i {
        _mm512_maddubs_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn madd16(a: __m512i, b: __m512i) -> __m512i {
        _mm512_madd_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn mullo32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_mullo_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn zero_f() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat_f(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn to_f(a: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn fnmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fnmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(a: __m512, to: &mut [f32]) {
        _mm512_storeu_ps(to.as_mut_ptr(), a);
    }
}

impl Zmm {
    /// Each group's 16 bytes at `at`, the first group's in the low half.
    ///
    /// # Safety
    /// As for [`Wide::pairs`].
    #[inline(always)]
    unsafe fn both_128(self, at: usize) -> __m256i {
        let lo = _mm_loadu_si128(self.0[0].add(at) as *const __m128i);
        let hi = _mm_loadu_si128(self.0[1].add(at) as *const __m128i);
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
    }
}
