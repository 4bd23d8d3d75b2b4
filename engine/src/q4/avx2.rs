//! The Q4_1 kernels on x86: groups of eight rows on AVX2 and VNNI, two groups at once on
//! 512-bit registers, and one row alone.

use std::arch::x86_64::*;

use crate::ahead::BlockRuns;
use crate::split::Columns;

use super::{add_block, block_sumi, NextPair, Q81Row, WGroup, WRow, GROUP, PAIR_TILE, QK, TILE};

/// # Safety
/// The CPU has AVX2 and FMA; every row of `rows` has as many blocks as the group `w`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_group(
    w: WGroup<'_>,
    rows: &[Q81Row],
    emit: impl FnMut(usize, [f32; GROUP]),
) {
    group_tiles::<false>(w, rows, emit)
}

/// [`dot_group`] with the integer sums in VNNI's one-instruction four-way dot products:
/// the same exact integers, in half the instructions.
///
/// # Safety
/// As for [`dot_group`], and the CPU has AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
pub(super) unsafe fn dot_group_vnni(
    w: WGroup<'_>,
    rows: &[Q81Row],
    emit: impl FnMut(usize, [f32; GROUP]),
) {
    group_tiles::<true>(w, rows, emit)
}

/// # Safety
/// As for [`dot_group`] (and [`dot_group_vnni`] when `VNNI`).
#[inline(always)]
unsafe fn group_tiles<const VNNI: bool>(
    w: WGroup<'_>,
    rows: &[Q81Row],
    mut emit: impl FnMut(usize, [f32; GROUP]),
) {
    let mut tiles = rows.chunks_exact(TILE);
    let mut y = 0;
    for tile in tiles.by_ref() {
        let acc = dot_tile::<TILE, VNNI>(w, tile);
        for a in acc {
            emit(y, lanes(a));
            y += 1;
        }
    }
    for row in tiles.remainder() {
        emit(
            y,
            lanes(dot_tile::<1, VNNI>(w, std::slice::from_ref(row))[0]),
        );
        y += 1;
    }
}

/// # Safety
/// The CPU has AVX.
#[inline(always)]
unsafe fn lanes(v: __m256) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    _mm256_storeu_ps(out.as_mut_ptr(), v);
    out
}

/// `T` activation rows against a group: for each row, the eight weight rows' outputs,
/// one lane each, summed over blocks in block order with `add_block`'s operations.
///
/// # Safety
/// As for [`group_tiles`].
#[inline(always)]
unsafe fn dot_tile<const T: usize, const VNNI: bool>(
    w: WGroup<'_>,
    rows: &[Q81Row],
) -> [__m256; T] {
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..w.d.len() / GROUP {
        // Run `k`'s low nibbles are values 4k..4k+4 of each row's block, its high
        // nibbles values 16+4k..16+4k+4.
        let at = w.qs.as_ptr().add(b * GROUP * QK / 2);
        let mut wv = [_mm256_setzero_si256(); 8];
        for k in 0..4 {
            let v = _mm256_loadu_si256(at.add(32 * k) as *const __m256i);
            wv[k] = _mm256_and_si256(v, mask);
            wv[4 + k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        let wd = _mm256_loadu_ps(w.d.as_ptr().add(b * GROUP));
        let wm = _mm256_loadu_ps(w.m.as_ptr().add(b * GROUP));
        for (y, acc) in rows.iter().zip(acc.iter_mut()) {
            let ys = y.qs.as_ptr().add(b * QK);
            // Four activations, the same for every row of the group.
            let act = |j: usize| {
                let off = if j < 4 { 4 * j } else { 16 + 4 * (j - 4) };
                _mm256_set1_epi32((ys.add(off) as *const i32).read_unaligned())
            };
            let s32 = if VNNI {
                // Four u8 x i8 products added into i32 per instruction, in two chains
                // so that one need not wait for the other: exact either way.
                let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for j in (0..8).step_by(2) {
                    a = _mm256_dpbusd_epi32(a, wv[j], act(j));
                    b = _mm256_dpbusd_epi32(b, wv[j + 1], act(j + 1));
                }
                _mm256_add_epi32(a, b)
            } else {
                // u8 x i8 pairs summed to i16: at most 2 * 15 * 127 = 3810 each, eight
                // of them at most 30480, inside i16; then pairs of i16 to i32: exact.
                let mut s16 = _mm256_maddubs_epi16(wv[0], act(0));
                for (j, &wj) in wv.iter().enumerate().skip(1) {
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wj, act(j)));
                }
                _mm256_madd_epi16(s16, ones)
            };
            let sumi = _mm256_cvtepi32_ps(s32);
            let yd = _mm256_set1_ps(*y.d.get_unchecked(b));
            let ysum = _mm256_set1_ps(*y.s.get_unchecked(b));
            *acc = _mm256_fmadd_ps(sumi, _mm256_mul_ps(wd, yd), *acc);
            *acc = _mm256_fmadd_ps(wm, ysum, *acc);
        }
    }
    acc
}

/// Two groups against activation rows on 512-bit registers: both groups' runs side by
/// side in one register, with [`dot_group_vnni`]'s integers and then its float
/// operations lane for lane, so the same bits. From [`UNPACK_FROM_ROWS`] rows (a prompt)
/// the pair's blocks are unpacked once, into this thread's room ([`crate::room`]), and
/// every tile reads them there; below, each tile unpacks each block as it goes.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; both groups have as many
/// blocks as every row of `rows`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_pair_512(
    w: [WGroup<'_>; 2],
    rows: &[Q81Row],
    next: Option<NextPair<'_>>,
    out: &Columns<'_>,
) {
    let blocks = w[0].d.len() / GROUP;
    if rows.len() < UNPACK_FROM_ROWS {
        return pair_tiles(Packed(w), rows, next, out);
    }
    // Any bits are an `Unpacked` (vectors), and this kernel calls no other while it reads
    // the room: `room`'s terms. It holds `blocks` of them, each written before the tiles.
    let room = crate::room::room::<Unpacked>(blocks);
    for b in 0..blocks {
        if let Some(next) = next {
            next.ask(b);
        }
        room.add(b).write(Packed(w).block(b));
    }
    let unpacked = std::slice::from_raw_parts(room, blocks);
    pair_tiles(Ready(unpacked), rows, None, out);
}

/// Activation rows from which a pair's blocks are unpacked before the tiles: measured in
/// `product-bench` against unpacking in every tile, runs alternated in one process, at
/// SmolLM2's shapes 1.02-1.17x at 512 rows, level at 128 and 16.
pub(super) const UNPACK_FROM_ROWS: usize = 128;

/// The rows in tiles of [`PAIR_TILE`], [`TILE`] and one; the first tile of all asks for
/// `next`, the others nothing.
///
/// # Safety
/// As for [`dot_pair_512`], with the pair's blocks at `from`.
#[inline(always)]
unsafe fn pair_tiles(
    from: impl Blocks,
    rows: &[Q81Row],
    next: Option<NextPair<'_>>,
    out: &Columns<'_>,
) {
    let mut y = whole_pair_tiles::<PAIR_TILE>(from, rows, 0, next, out);
    y = whole_pair_tiles::<TILE>(from, rows, y, next, out);
    whole_pair_tiles::<1>(from, rows, y, next, out);
}

/// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the
/// row after them. The first tile of all asks for `next`, the others nothing.
///
/// # Safety
/// As for [`pair_tiles`].
#[inline(always)]
unsafe fn whole_pair_tiles<const T: usize>(
    from: impl Blocks,
    rows: &[Q81Row],
    mut y: usize,
    next: Option<NextPair<'_>>,
    out: &Columns<'_>,
) -> usize {
    while y + T <= rows.len() {
        let next = next.filter(|_| y == 0);
        for (i, acc) in pair_tile::<T>(from, &rows[y..y + T], next)
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

/// Both groups' halves side by side: `at(g)` gives group `g`'s 256 bits.
///
/// # Safety
/// The CPU has AVX-512 F.
#[inline(always)]
unsafe fn joined(at: impl Fn(usize) -> __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(at(0)), at(1))
}

/// A pair's block unpacked: its eight weight registers, then both groups' scales and
/// minimums side by side (640 bytes; a pair of SmolLM2's 1,536-wide rows takes 30 KiB).
#[derive(Clone, Copy)]
struct Unpacked {
    wv: [__m512i; 8],
    wd: __m512,
    wm: __m512,
}

/// Where a tile's blocks come from.
///
/// # Safety
/// [`Blocks::block`] needs the pair kernel's features and block `b` at the source.
trait Blocks: Copy {
    unsafe fn block(self, b: usize) -> Unpacked;
    fn count(self) -> usize;
}

/// The pair's groups themselves, unpacked as they are read.
#[derive(Clone, Copy)]
struct Packed<'a>([WGroup<'a>; 2]);

impl Blocks for Packed<'_> {
    #[inline(always)]
    unsafe fn block(self, b: usize) -> Unpacked {
        let w = self.0;
        let mask = _mm512_set1_epi8(0x0F);
        let mut wv = [_mm512_setzero_si512(); 8];
        for k in 0..4 {
            let v = joined(|g| {
                let at = w[g].qs.as_ptr().add(b * GROUP * QK / 2 + 32 * k);
                _mm256_loadu_si256(at as *const __m256i)
            });
            wv[k] = _mm512_and_si512(v, mask);
            wv[4 + k] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
        }
        let floats = |v: &dyn Fn(usize) -> *const f32| {
            let lanes = joined(|g| _mm256_castps_si256(_mm256_loadu_ps(v(g))));
            _mm512_castsi512_ps(lanes)
        };
        Unpacked {
            wv,
            wd: floats(&|g| w[g].d.as_ptr().add(b * GROUP)),
            wm: floats(&|g| w[g].m.as_ptr().add(b * GROUP)),
        }
    }

    fn count(self) -> usize {
        self.0[0].d.len() / GROUP
    }
}

/// The pair's blocks unpacked before the tiles.
#[derive(Clone, Copy)]
struct Ready<'a>(&'a [Unpacked]);

impl Blocks for Ready<'_> {
    #[inline(always)]
    unsafe fn block(self, b: usize) -> Unpacked {
        *self.0.get_unchecked(b)
    }

    fn count(self) -> usize {
        self.0.len()
    }
}

/// [`dot_tile`] with VNNI, sixteen lanes wide, asking for block `b` of `next` with block
/// `b`.
///
/// # Safety
/// As for [`pair_tiles`]; `rows` has `T` rows.
#[inline(always)]
unsafe fn pair_tile<const T: usize>(
    from: impl Blocks,
    rows: &[Q81Row],
    next: Option<NextPair<'_>>,
) -> [__m512; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..from.count() {
        if let Some(next) = next {
            next.ask(b);
        }
        let Unpacked { wv, wd, wm } = from.block(b);
        for (y, acc) in rows.iter().zip(acc.iter_mut()) {
            let ys = y.qs.as_ptr().add(b * QK);
            let act = |j: usize| {
                let off = if j < 4 { 4 * j } else { 16 + 4 * (j - 4) };
                _mm512_set1_epi32((ys.add(off) as *const i32).read_unaligned())
            };
            // Exact either way. A tile of `PAIR_TILE` rows runs that many independent
            // chains, enough to cover the instruction's latency, so one a row saves
            // joining two; smaller tiles keep `dot_tile`'s two a row.
            let s32 = if T >= PAIR_TILE {
                let mut a = _mm512_setzero_si512();
                for (j, &wj) in wv.iter().enumerate() {
                    a = _mm512_dpbusd_epi32(a, wj, act(j));
                }
                a
            } else {
                let (mut a, mut c) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for j in (0..8).step_by(2) {
                    a = _mm512_dpbusd_epi32(a, wv[j], act(j));
                    c = _mm512_dpbusd_epi32(c, wv[j + 1], act(j + 1));
                }
                _mm512_add_epi32(a, c)
            };
            let sumi = _mm512_cvtepi32_ps(s32);
            let yd = _mm512_set1_ps(*y.d.get_unchecked(b));
            let ysum = _mm512_set1_ps(*y.s.get_unchecked(b));
            *acc = _mm512_fmadd_ps(sumi, _mm512_mul_ps(wd, yd), *acc);
            *acc = _mm512_fmadd_ps(wm, ysum, *acc);
        }
    }
    acc
}

/// The i32 products of weight block `b` and activation block `b`, in eight lanes.
///
/// # Safety
/// The CPU has AVX2; `w` and `y` both have a block `b`.
#[inline(always)]
unsafe fn products(w: WRow<'_>, y: &Q81Row, b: usize) -> __m256i {
    let q = _mm_loadu_si128(w.qs.as_ptr().add(b * QK / 2) as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    // Low nibbles are values 0..16 of the block, high nibbles 16..32, as in Q8_1.
    let lo = _mm_and_si128(q, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    let wv = _mm256_set_m128i(hi, lo);
    let yv = _mm256_loadu_si256(y.qs.as_ptr().add(b * QK) as *const __m256i);
    // u8 x i8 pairs summed to i16 (at most 2 * 15 * 128: no saturation), then pairs of
    // i16 to i32: exact.
    _mm256_madd_epi16(_mm256_maddubs_epi16(wv, yv), _mm256_set1_epi16(1))
}

/// The sums of four blocks' products: [s0, s1, s2, s3].
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn sum4(p: [__m256i; 4]) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
}

/// One weight row in the plain layout against one activation row: the integer sums of
/// eight blocks in one vector, then added block by block as [`add_block`] adds them.
///
/// # Safety
/// The CPU has AVX2 and FMA; `y` has at least as many blocks as `w`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_one(w: WRow<'_>, y: &Q81Row) -> f32 {
    let nb = w.d.len();
    let mut acc = 0f32;
    let mut b = 0;
    while b + 8 <= nb {
        let p = |i| products(w, y, b + i);
        let lo = sum4([p(0), p(1), p(2), p(3)]);
        let hi = sum4([p(4), p(5), p(6), p(7)]);
        let mut sums = [0i32; 8];
        _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, _mm256_set_m128i(hi, lo));
        for (i, sumi) in sums.into_iter().enumerate() {
            acc = add_block(acc, sumi, w, y, b + i);
        }
        b += 8;
    }
    while b < nb {
        acc = add_block(acc, block_sumi(w, y, b), w, y, b);
        b += 1;
    }
    acc
}
