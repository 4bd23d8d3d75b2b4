//! The Q8_0 kernels on x86: groups of eight rows on AVX2 and VNNI, two groups at once on
//! 512-bit registers, and the loose rows after the last whole group.

use std::arch::x86_64::*;

use half::f16;

use super::{GroupKernel, NextPair, Q80Row, GROUP, QK, TILE, VNNI_TILE};
use crate::act_quant::has_vnni;
use crate::ahead::BlockRuns;
use crate::split::Columns;

/// The integer sums of bytes `4k .. 4k + 4` of `w` times `y`, eight lanes of i32 added
/// into `acc`: |w| times y with w's sign, as candle's `mul_sum_i8_pairs_float` takes
/// them. Exact (at most 2 * 128 * 127 in a pair of i16).
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn add_products(acc: __m256i, abs: __m256i, w: __m256i, y: __m256i) -> __m256i {
    let signed = _mm256_sign_epi8(y, w);
    let pairs = _mm256_maddubs_epi16(abs, signed);
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi16(1), pairs))
}

/// Two groups against activation rows, on 512-bit registers: each row's sixteen outputs,
/// the first group's eight and then the second's, stored into its columns of `out`. Block
/// `b` of the next pair is asked for with block `b`.
pub(super) type PairKernel =
    unsafe fn([&[f16]; 2], [&[i8]; 2], &[Q80Row], Option<NextPair<'_>>, &Columns<'_>);

/// The pair kernel where this CPU has VNNI on 512-bit registers.
pub(super) fn pair_kernel() -> Option<PairKernel> {
    crate::act_quant::has_vnni_512().then_some(dot_pair_512 as PairKernel)
}

/// Two groups of eight interleaved weight rows against activation rows: both groups'
/// runs of 32 bytes side by side in one register, with [`dot_group_vnni`]'s integers and
/// then its float operations lane for lane, so the same bits.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI; each group's `d` holds
/// `GROUP` scales and its `qs` `GROUP * QK` bytes for each block of every row of `rows`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_pair_512(
    d: [&[f16]; 2],
    qs: [&[i8]; 2],
    rows: &[Q80Row],
    next: Option<NextPair<'_>>,
    out: &Columns<'_>,
) {
    let mut y = pair_tiles::<VNNI_TILE>(d, qs, rows, 0, next, out);
    y = pair_tiles::<TILE>(d, qs, rows, y, next, out);
    pair_tiles::<1>(d, qs, rows, y, next, out);
}

/// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the
/// row after them. The first tile of all asks for `next`, the others nothing.
///
/// # Safety
/// As for [`dot_pair_512`].
#[inline(always)]
unsafe fn pair_tiles<const T: usize>(
    d: [&[f16]; 2],
    qs: [&[i8]; 2],
    rows: &[Q80Row],
    mut y: usize,
    next: Option<NextPair<'_>>,
    out: &Columns<'_>,
) -> usize {
    while y + T <= rows.len() {
        let next = next.filter(|_| y == 0);
        for (i, acc) in pair_outputs::<T>(d, qs, &rows[y..y + T], next)
            .into_iter()
            .enumerate()
        {
            out.store_row(y + i, 2 * GROUP, |to| {
                _mm512_storeu_ps(to.as_mut_ptr(), acc)
            });
        }
        y += T;
    }
    y
}

/// `T` activation rows against two groups: [`tile_outputs`] with VNNI, sixteen lanes
/// wide, asking for block `b` of `next` with block `b`.
///
/// # Safety
/// As for [`dot_pair_512`]; `rows` has `T` rows.
#[inline(always)]
unsafe fn pair_outputs<const T: usize>(
    d: [&[f16]; 2],
    qs: [&[i8]; 2],
    rows: &[Q80Row],
    next: Option<NextPair<'_>>,
) -> [__m512; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    let lift = _mm512_set1_epi8(i8::MIN);
    for b in 0..rows[0].d.len() {
        if let Some(next) = next {
            next.ask(b);
        }
        let (w0, w1) = (
            qs[0].as_ptr().add(b * GROUP * QK),
            qs[1].as_ptr().add(b * GROUP * QK),
        );
        let mut sums = [_mm512_setzero_si512(); T];
        for k in 0..QK / 4 {
            let lo = _mm256_loadu_si256(w0.add(32 * k) as *const __m256i);
            let hi = _mm256_loadu_si256(w1.add(32 * k) as *const __m256i);
            let wv = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let lifted = _mm512_xor_si512(wv, lift);
            for (row, sum) in rows.iter().zip(sums.iter_mut()) {
                let at = row.qs.as_ptr().add(b * QK + 4 * k) as *const i32;
                let act = _mm512_set1_epi32(at.read_unaligned());
                *sum = _mm512_dpbusd_epi32(*sum, lifted, act);
            }
        }
        let scales = |g: usize| _mm_loadu_si128(d[g].as_ptr().add(b * GROUP) as *const _);
        let d16 = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(scales(0)), scales(1));
        let wd = _mm512_cvtph_ps(d16);
        for ((row, sum), acc) in rows.iter().zip(sums).zip(acc.iter_mut()) {
            let offset = _mm512_set1_epi32(*row.offsets.get_unchecked(b));
            let sum = _mm512_sub_epi32(sum, offset);
            let scale = _mm512_mul_ps(wd, _mm512_set1_ps(*row.d.get_unchecked(b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *acc);
        }
    }
    acc
}

/// The fastest group kernel this CPU runs, given AVX2, FMA and F16C.
pub(super) fn group_kernel() -> GroupKernel {
    if has_vnni() {
        dot_group_vnni
    } else {
        dot_group
    }
}

/// One group of eight interleaved weight rows against activation rows.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `d` holds `GROUP` scales and `qs` `GROUP * QK` bytes
/// for each block of every row of `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_group(
    d: &[f16],
    qs: &[i8],
    rows: &[Q80Row],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    tiles::<false>(d, qs, rows, emit)
}

/// [`dot_group`] with VNNI's four-way dot products.
///
/// # Safety
/// As for [`dot_group`], and the CPU has AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn dot_group_vnni(
    d: &[f16],
    qs: &[i8],
    rows: &[Q80Row],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    tiles::<true>(d, qs, rows, emit)
}

/// # Safety
/// As for [`dot_group`] (and [`dot_group_vnni`] when `VNNI`).
#[inline(always)]
unsafe fn tiles<const VNNI: bool>(
    d: &[f16],
    qs: &[i8],
    rows: &[Q80Row],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    let mut y = 0;
    if VNNI {
        y = whole_tiles::<VNNI_TILE, VNNI>(d, qs, rows, y, emit);
    }
    y = whole_tiles::<TILE, VNNI>(d, qs, rows, y, emit);
    whole_tiles::<1, VNNI>(d, qs, rows, y, emit);
}

/// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the
/// row after them.
///
/// # Safety
/// As for [`tiles`].
#[inline(always)]
unsafe fn whole_tiles<const T: usize, const VNNI: bool>(
    d: &[f16],
    qs: &[i8],
    rows: &[Q80Row],
    mut y: usize,
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) -> usize {
    while y + T <= rows.len() {
        for (i, out) in tile_outputs::<T, VNNI>(d, qs, &rows[y..y + T])
            .into_iter()
            .enumerate()
        {
            emit(y + i, out);
        }
        y += T;
    }
    y
}

/// `T` activation rows against a group: per row, lane `i` is weight row `i`'s output,
/// the blocks' integer sums times their scales' product added in block order.
///
/// # Safety
/// As for [`dot_group`] (and [`dot_group_vnni`] when `VNNI`); `rows` has `T` rows.
#[inline(always)]
unsafe fn tile_outputs<const T: usize, const VNNI: bool>(
    d: &[f16],
    qs: &[i8],
    rows: &[Q80Row],
) -> [[f32; GROUP]; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..rows[0].d.len() {
        let w = qs.as_ptr().add(b * GROUP * QK);
        let mut sums = [_mm256_setzero_si256(); T];
        for k in 0..QK / 4 {
            let wv = _mm256_loadu_si256(w.add(32 * k) as *const __m256i);
            let act = |row: &Q80Row| {
                let at = row.qs.as_ptr().add(b * QK + 4 * k) as *const i32;
                _mm256_set1_epi32(at.read_unaligned())
            };
            if VNNI {
                // VNNI multiplies unsigned bytes by signed ones: the weights plus 128,
                // one operation for the whole tile, where moving the weights' signs
                // onto the activations took one per row. The 128 times the block's
                // values come off below: the same exact integers.
                let lifted = _mm256_xor_si256(wv, _mm256_set1_epi8(i8::MIN));
                for (row, sum) in rows.iter().zip(sums.iter_mut()) {
                    *sum = _mm256_dpbusd_epi32(*sum, lifted, act(row));
                }
            } else {
                let abs = _mm256_sign_epi8(wv, wv);
                for (row, sum) in rows.iter().zip(sums.iter_mut()) {
                    *sum = add_products(*sum, abs, wv, act(row));
                }
            }
        }
        if VNNI {
            for (row, sum) in rows.iter().zip(sums.iter_mut()) {
                let offset = _mm256_set1_epi32(*row.offsets.get_unchecked(b));
                *sum = _mm256_sub_epi32(*sum, offset);
            }
        }
        let wd = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(b * GROUP) as *const _));
        for ((row, sum), acc) in rows.iter().zip(sums).zip(acc.iter_mut()) {
            let scale = _mm256_mul_ps(wd, _mm256_set1_ps(*row.d.get_unchecked(b)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, *acc);
        }
    }
    acc.map(|a| {
        let mut out = [0f32; GROUP];
        _mm256_storeu_ps(out.as_mut_ptr(), a);
        out
    })
}

/// One weight row in the plain layout against one activation row, with the group
/// kernels' operations: each block's integer sum, then one fused multiply-add.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `qs` holds `QK` bytes for each of `d`'s scales, and
/// `y` at least as many blocks as `d` has scales.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_one(d: &[f16], qs: &[i8], y: &Q80Row) -> f32 {
    let mut acc = 0f32;
    for (b, (&wd, &yd)) in d.iter().zip(&y.d).enumerate() {
        let wv = _mm256_loadu_si256(qs.as_ptr().add(b * QK) as *const __m256i);
        let yv = _mm256_loadu_si256(y.qs.as_ptr().add(b * QK) as *const __m256i);
        let lanes = add_products(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), wv, yv);
        let mut parts = [0i32; 8];
        _mm256_storeu_si256(parts.as_mut_ptr() as *mut __m256i, lanes);
        let sumi: i32 = parts.iter().sum();
        acc = (sumi as f32).mul_add(wd.to_f32() * yd, acc);
    }
    acc
}
