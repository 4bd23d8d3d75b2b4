//! The K-quant group kernels on AVX2 (and AVX-512 VNNI where the CPU has it): eight weight
//! rows a group, their integer sums in the eight lanes of one register, a group's unpacked
//! chunk serving a tile of four activation rows.
//!
//! Each super-block's sum is exact in integers, as llama.cpp's is: every chunk's products
//! times its sub-block's scale, added over the super-block; then the minimums' (or Q6_K's
//! offset's) integer term against the activations' sums. Only then floats: one fused
//! multiply-add by `d` times the activations' scale, and for Q4_K and Q5_K one by `dmin`
//! times it, per super-block, in super-block order: the scalar twin's operations.

use std::arch::x86_64::*;

use super::format::{KFormat, CHUNK, QK_K};
use super::q8k::Q8KRow;
use crate::split::GROUP;

/// A group's kernel: the group block bytes of all its super-blocks against every
/// activation row; `emit(y, outputs)` gets row `y`'s eight outputs.
pub(super) type GroupKernel = unsafe fn(&[u8], &[Q8KRow<'_>], &mut dyn FnMut(usize, [f32; GROUP]));

/// Activation rows that share one unpacked chunk: four on AVX2, whose sixteen registers
/// hold a chunk's eight weight registers beside four rows' sums; eight with AVX-512 VL's
/// 32 (at 16 and 512 rows, 1.1-1.3x four's GMAC/s for Q4_K and Q6_K in `product-bench`).
const TILE: usize = 4;
const VNNI_TILE: usize = 8;

/// The group kernel for `format`, with VNNI's dot products or without.
pub(super) fn kernel(format: KFormat, vnni: bool) -> GroupKernel {
    match (format, vnni) {
        (KFormat::Q4K, false) => group::<Q4K>,
        (KFormat::Q5K, false) => group::<Q5K>,
        (KFormat::Q6K, false) => group::<Q6K>,
        (KFormat::Q4K, true) => group_vnni::<Q4K>,
        (KFormat::Q5K, true) => group_vnni::<Q5K>,
        (KFormat::Q6K, true) => group_vnni::<Q6K>,
    }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `blocks` is whole group blocks of `K`'s format, one for
/// each super-block of the rows of `q`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<K: Kind>(
    blocks: &[u8],
    q: &[Q8KRow<'_>],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    tiles::<K, false>(blocks, q, emit)
}

/// [`group`] with the integer sums in VNNI's four-way dot products.
///
/// # Safety
/// As for [`group`], and the CPU has AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn group_vnni<K: Kind>(
    blocks: &[u8],
    q: &[Q8KRow<'_>],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    tiles::<K, true>(blocks, q, emit)
}

/// # Safety
/// As for [`group`] (and [`group_vnni`] when `VNNI`).
#[inline(always)]
unsafe fn tiles<K: Kind, const VNNI: bool>(
    blocks: &[u8],
    q: &[Q8KRow<'_>],
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) {
    let mut y = 0;
    if VNNI {
        y = whole_tiles::<K, VNNI_TILE, VNNI>(blocks, q, y, emit);
    }
    y = whole_tiles::<K, TILE, VNNI>(blocks, q, y, emit);
    // Tiles of two for the last rows: a mixture's experts multiply two or three rows
    // each in a batch-16 step, and a tile of one unpacks the group's weights once a row.
    y = whole_tiles::<K, 2, VNNI>(blocks, q, y, emit);
    whole_tiles::<K, 1, VNNI>(blocks, q, y, emit);
}

/// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the row
/// after them.
///
/// # Safety
/// As for [`tiles`].
#[inline(always)]
unsafe fn whole_tiles<K: Kind, const T: usize, const VNNI: bool>(
    blocks: &[u8],
    q: &[Q8KRow<'_>],
    mut y: usize,
    emit: &mut dyn FnMut(usize, [f32; GROUP]),
) -> usize {
    while y + T <= q.len() {
        let rows: &[Q8KRow<'_>; T] = q[y..y + T].try_into().expect("a whole tile");
        for (i, acc) in tile::<K, T, VNNI>(blocks, rows).into_iter().enumerate() {
            emit(y + i, lanes(acc));
        }
        y += T;
    }
    y
}

/// # Safety
/// The CPU has AVX.
#[inline(always)]
unsafe fn lanes(v: __m256) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    _mm256_storeu_ps(out.as_mut_ptr(), v);
    out
}

/// `T` activation rows against a group: for each, lane `i` is weight row `i`'s output.
///
/// # Safety
/// As for [`tiles`].
#[inline(always)]
unsafe fn tile<K: Kind, const T: usize, const VNNI: bool>(
    blocks: &[u8],
    rows: &[Q8KRow<'_>; T],
) -> [__m256; T] {
    let bytes = K::FORMAT.group_bytes();
    let mut acc = [_mm256_setzero_ps(); T];
    for sb in 0..blocks.len() / bytes {
        let blk = blocks.as_ptr().add(sb * bytes);
        let mut sumi = [_mm256_setzero_si256(); T];
        for c in 0..QK_K / CHUNK {
            let mut wv = nibbles(K::FORMAT, blk, c);
            K::add_high_bits(blk, c, &mut wv);
            let scales = K::scales(blk, c);
            for (row, sumi) in rows.iter().zip(sumi.iter_mut()) {
                let ys = row.qs.as_ptr().add(sb * QK_K + c * CHUNK);
                *sumi = _mm256_add_epi32(*sumi, K::dot::<VNNI>(&wv, ys, scales));
            }
        }
        for ((row, sumi), acc) in rows.iter().zip(sumi).zip(acc.iter_mut()) {
            *acc = K::finish(blk, row, sb, sumi, *acc);
        }
    }
    acc
}

/// Chunk `c`'s low nibbles, as eight registers of eight rows' four weights a lane.
///
/// # Safety
/// The CPU has AVX2; `blk` starts a group block of `format`.
#[inline(always)]
unsafe fn nibbles(format: KFormat, blk: *const u8, c: usize) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(0x0F);
    let at = blk.add(format.chunk_at(c));
    let mut wv = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        let v = _mm256_loadu_si256(at.add(32 * k) as *const __m256i);
        wv[k] = _mm256_and_si256(v, mask);
        wv[4 + k] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
    }
    wv
}

/// The four activations register `t` of a chunk multiplies, in every lane.
///
/// # Safety
/// The CPU has AVX2; `ys` starts a chunk of 32 activations.
#[inline(always)]
unsafe fn act(ys: *const i8, t: usize) -> __m256i {
    let off = if t < 4 { 4 * t } else { 16 + 4 * (t - 4) };
    _mm256_set1_epi32((ys.add(off) as *const i32).read_unaligned())
}

/// Bits `from .. from + width` of each byte of `v`, moved to bits `4 .. 4 + width`.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn bits_to_high_nibble(v: __m256i, from: i32, width: u32) -> __m256i {
    // 16-bit shifts move bits across the bytes, but never into bits 4 .. 4 + width of a
    // byte from outside it, which the mask keeps.
    let moved = if from <= 4 {
        _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - from))
    } else {
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - 4))
    };
    _mm256_and_si256(moved, _mm256_set1_epi8((((1u32 << width) - 1) << 4) as i8))
}

/// Sub-block pair `p`'s scales (or minimums) at `at`: lane `r` holds row `r`'s two as i16.
///
/// # Safety
/// The CPU has AVX2; `at` starts a pair's 16 bytes.
#[inline(always)]
unsafe fn pairs(at: *const u8) -> __m256i {
    _mm256_cvtepi8_epi16(_mm_loadu_si128(at as *const __m128i))
}

/// From [`pairs`], each lane's first (`SECOND` false) or second value in both its halves.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn spread<const SECOND: bool>(p: __m256i) -> __m256i {
    let m = if SECOND {
        _mm256_setr_epi8(
            2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11,
            10, 11, 14, 15, 14, 15,
        )
    } else {
        _mm256_setr_epi8(
            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9,
            12, 13, 12, 13,
        )
    };
    _mm256_shuffle_epi8(p, m)
}

/// A sub-block's scale, from [`spread`], as the i16 pair it is (for `vpmaddwd`) and as
/// the i32 it is (for VNNI's sums).
#[derive(Clone, Copy)]
struct Scale {
    pair: __m256i,
    wide: __m256i,
}

impl Scale {
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn of(spread: __m256i) -> Self {
        Self {
            pair: spread,
            wide: _mm256_madd_epi16(spread, _mm256_set1_epi32(1)),
        }
    }

    /// The scale times the i16 sums of `s16`, both halves of each lane added: i32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn times16(self, s16: __m256i) -> __m256i {
        _mm256_madd_epi16(s16, self.pair)
    }

    /// The scale times i32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn times32(self, s32: __m256i) -> __m256i {
        _mm256_mullo_epi32(s32, self.wide)
    }
}

/// The sum of registers `ts`' products with their activations, in i16 pairs: each at most
/// `2 * ts.len() * (2^bits - 1) * 127` in size, which callers keep inside i16.
///
/// # Safety
/// The CPU has AVX2; `ys` starts a chunk.
#[inline(always)]
unsafe fn sum16(wv: &[__m256i; 8], ys: *const i8, ts: std::ops::Range<usize>) -> __m256i {
    let mut s = _mm256_setzero_si256();
    for t in ts {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wv[t], act(ys, t)));
    }
    s
}

/// The same sum in i32 lanes by VNNI, in two chains so that one need not wait for the
/// other: exact either way.
///
/// # Safety
/// The CPU has AVX2, AVX-512 VNNI and VL; `ys` starts a chunk.
#[inline(always)]
unsafe fn sum32(wv: &[__m256i; 8], ys: *const i8, ts: std::ops::Range<usize>) -> __m256i {
    let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    let mut t = ts.start;
    while t + 1 < ts.end {
        a = _mm256_dpbusd_epi32(a, wv[t], act(ys, t));
        b = _mm256_dpbusd_epi32(b, wv[t + 1], act(ys, t + 1));
        t += 2;
    }
    _mm256_add_epi32(a, b)
}

/// What sets the three formats apart.
trait Kind {
    const FORMAT: KFormat;
    /// A chunk's scales.
    type Scales: Copy;

    /// # Safety
    /// The CPU has AVX2; `blk` starts a group block of this format.
    unsafe fn add_high_bits(blk: *const u8, c: usize, wv: &mut [__m256i; 8]);

    /// # Safety
    /// As for [`Kind::add_high_bits`].
    unsafe fn scales(blk: *const u8, c: usize) -> Self::Scales;

    /// A chunk's products with one activation row's, times their scales, in i32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 (and AVX-512 VNNI and VL when `VNNI`); `ys` starts a chunk.
    unsafe fn dot<const VNNI: bool>(wv: &[__m256i; 8], ys: *const i8, s: Self::Scales) -> __m256i;

    /// `acc` with super-block `sb`'s terms added, its integer sum being `sumi`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `blk` starts super-block `sb`'s group block.
    unsafe fn finish(
        blk: *const u8,
        row: &Q8KRow<'_>,
        sb: usize,
        sumi: __m256i,
        acc: __m256,
    ) -> __m256;
}

/// Q4_K (`FIVE` false) and Q5_K, whose sub-blocks are chunks with a minimum each.
struct WithMins<const FIVE: bool>;
type Q4K = WithMins<false>;
type Q5K = WithMins<true>;
struct Q6K;

impl<const FIVE: bool> Kind for WithMins<FIVE> {
    const FORMAT: KFormat = if FIVE { KFormat::Q5K } else { KFormat::Q4K };
    type Scales = Scale;

    #[inline(always)]
    unsafe fn add_high_bits(blk: *const u8, c: usize, wv: &mut [__m256i; 8]) {
        if !FIVE {
            return;
        }
        let h = _mm256_loadu_si256(blk.add(Self::FORMAT.high_at(c)) as *const __m256i);
        for (t, w) in wv.iter_mut().enumerate() {
            *w = _mm256_or_si256(*w, bits_to_high_nibble(h, t as i32, 1));
        }
    }

    #[inline(always)]
    unsafe fn scales(blk: *const u8, c: usize) -> Scale {
        let p = pairs(blk.add(Self::FORMAT.scales_at() + c / 2 * 16));
        Scale::of(if c.is_multiple_of(2) {
            spread::<false>(p)
        } else {
            spread::<true>(p)
        })
    }

    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(wv: &[__m256i; 8], ys: *const i8, s: Scale) -> __m256i {
        if VNNI {
            s.times32(sum32(wv, ys, 0..8))
        } else if FIVE {
            // Four registers of products of at most 2 * 31 * 127: 31496, inside i16.
            let a = s.times16(sum16(wv, ys, 0..4));
            _mm256_add_epi32(a, s.times16(sum16(wv, ys, 4..8)))
        } else {
            // Eight registers of products of at most 2 * 15 * 127: 30480, inside i16.
            s.times16(sum16(wv, ys, 0..8))
        }
    }

    /// `d * dy * sumi - dmin * dy * Σ min · sums32`.
    #[inline(always)]
    unsafe fn finish(
        blk: *const u8,
        row: &Q8KRow<'_>,
        sb: usize,
        sumi: __m256i,
        acc: __m256,
    ) -> __m256 {
        let format = Self::FORMAT;
        let sums = row.sums32.as_ptr().add(sb * 8) as *const i32;
        let mut summ = _mm256_setzero_si256();
        for p in 0..4 {
            let mins = pairs(blk.add(format.mins_at() + 16 * p));
            let ys = _mm256_set1_epi32(sums.add(p).read_unaligned());
            summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mins, ys));
        }
        let dy = _mm256_set1_ps(*row.d.get_unchecked(sb));
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(format.d_at()) as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(format.dmin_at()) as *const __m128i));
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dy), acc);
        _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, dy), acc)
    }
}

impl Kind for Q6K {
    const FORMAT: KFormat = KFormat::Q6K;
    /// The chunk's two sub-blocks' scales: registers 0-3, then 4-7.
    type Scales = [Scale; 2];

    #[inline(always)]
    unsafe fn add_high_bits(blk: *const u8, c: usize, wv: &mut [__m256i; 8]) {
        let at = blk.add(Self::FORMAT.high_at(c));
        for (half, wv) in wv.chunks_exact_mut(4).enumerate() {
            let h = _mm256_loadu_si256(at.add(32 * half) as *const __m256i);
            for (t, w) in wv.iter_mut().enumerate() {
                *w = _mm256_or_si256(*w, bits_to_high_nibble(h, 2 * t as i32, 2));
            }
        }
    }

    #[inline(always)]
    unsafe fn scales(blk: *const u8, c: usize) -> [Scale; 2] {
        let p = pairs(blk.add(Self::FORMAT.scales_at() + 16 * c));
        [Scale::of(spread::<false>(p)), Scale::of(spread::<true>(p))]
    }

    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(wv: &[__m256i; 8], ys: *const i8, s: [Scale; 2]) -> __m256i {
        if VNNI {
            let a = s[0].times32(sum32(wv, ys, 0..4));
            _mm256_add_epi32(a, s[1].times32(sum32(wv, ys, 4..8)))
        } else {
            // Two registers of products of at most 2 * 63 * 127: 32004, inside i16.
            let mut s32 = _mm256_setzero_si256();
            for t in (0..8).step_by(2) {
                let part = s[t / 4].times16(sum16(wv, ys, t..t + 2));
                s32 = _mm256_add_epi32(s32, part);
            }
            s32
        }
    }

    /// `d * dy * (sumi - 32 Σ scale · sums16)`: the offset of 32 every weight carries.
    #[inline(always)]
    unsafe fn finish(
        blk: *const u8,
        row: &Q8KRow<'_>,
        sb: usize,
        sumi: __m256i,
        acc: __m256,
    ) -> __m256 {
        let sums = row.sums16.as_ptr().add(sb * 16) as *const i32;
        let mut offset = _mm256_setzero_si256();
        for p in 0..8 {
            let scales = pairs(blk.add(Self::FORMAT.scales_at() + 16 * p));
            let ys = _mm256_set1_epi32(sums.add(p).read_unaligned());
            offset = _mm256_add_epi32(offset, _mm256_madd_epi16(scales, ys));
        }
        let sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32::<5>(offset));
        let dy = _mm256_set1_ps(*row.d.get_unchecked(sb));
        let d = _mm256_cvtph_ps(_mm_loadu_si128(
            blk.add(Self::FORMAT.d_at()) as *const __m128i
        ));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dy), acc)
    }
}
