//! The K-quant group kernels on x86: eight weight rows a group, their integer sums in the
//! eight lanes of a 256-bit register, a group's unpacked chunk serving a tile of activation
//! rows; with AVX-512 VNNI, the sums by its four-way dot products; and where that runs on
//! 512-bit registers, two groups at once, side by side in one ([`wide`] has both widths).
//!
//! Each super-block's sum is exact in integers, as llama.cpp's is: every chunk's products
//! times its sub-block's scale, added over the super-block; then the minimums' (or Q6_K's
//! offset's) integer term against the activations' sums. Only then floats: one fused
//! multiply-add by `d` times the activations' scale, and for Q4_K and Q5_K one by `dmin`
//! times it, per super-block, in super-block order: the scalar twin's operations.

use super::format::{KFormat, CHUNK, QK_K};
use super::q8k::Q8KRow;
use super::wide::{Wide, Ymm, Zmm};
use crate::ahead::Ahead;
use crate::split::Columns;

/// A group's kernel: the group block bytes of all its super-blocks against every
/// activation row, each row's eight outputs stored into its columns of `out`.
pub(super) type GroupKernel = unsafe fn(&[u8], &[Q8KRow<'_>], &Columns<'_>);

/// Two groups' kernel, on 512-bit registers: each activation row's sixteen outputs, the
/// first group's eight and then the second's, stored into its columns of `out`. Part `sb`
/// of the `Ahead` is asked for with super-block `sb`.
pub(super) type PairKernel = unsafe fn([&[u8]; 2], &[Q8KRow<'_>], &Ahead<2>, &Columns<'_>);

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

/// The pair kernel for `format`.
pub(super) fn pair_kernel(format: KFormat) -> PairKernel {
    match format {
        KFormat::Q4K => pair_512::<Q4K>,
        KFormat::Q5K => pair_512::<Q5K>,
        KFormat::Q6K => pair_512::<Q6K>,
    }
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `blocks` is whole group blocks of `K`'s format, one for
/// each super-block of the rows of `q`; no other worker writes `out`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<K: Kind>(blocks: &[u8], q: &[Q8KRow<'_>], out: &Columns<'_>) {
    let at = Ymm(blocks.as_ptr());
    tiles::<K, Ymm, false, 1>(at, super_blocks::<K>(blocks), q, &Ahead::NONE, out)
}

/// [`group`] with the integer sums in VNNI's four-way dot products.
///
/// # Safety
/// As for [`group`], and the CPU has AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn group_vnni<K: Kind>(blocks: &[u8], q: &[Q8KRow<'_>], out: &Columns<'_>) {
    let at = Ymm(blocks.as_ptr());
    tiles::<K, Ymm, true, 1>(at, super_blocks::<K>(blocks), q, &Ahead::NONE, out)
}

/// [`group_vnni`] for two groups at once, on 512-bit registers: their integers and then
/// float operations lane for lane, so the same bits.
///
/// # Safety
/// As for [`group_vnni`] for each group of `blocks`, which are as long as each other, and
/// the CPU has AVX-512 F and BW.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pair_512<K: Kind>(
    blocks: [&[u8]; 2],
    q: &[Q8KRow<'_>],
    ahead: &Ahead<2>,
    out: &Columns<'_>,
) {
    assert_eq!(blocks[0].len(), blocks[1].len(), "two groups of one matrix");
    let at = Zmm(blocks.map(<[u8]>::as_ptr));
    tiles::<K, Zmm, true, 2>(at, super_blocks::<K>(blocks[0]), q, ahead, out)
}

/// How many super-blocks `blocks` holds.
fn super_blocks<K: Kind>(blocks: &[u8]) -> usize {
    blocks.len() / K::FORMAT.group_bytes()
}

/// The first tile asks for `ahead`, part `sb` with super-block `sb`.
///
/// # Safety
/// As for [`group`] (and [`group_vnni`] when `VNNI`, [`pair_512`] for [`Zmm`]), with `sbs`
/// super-blocks at `at`.
#[inline(always)]
unsafe fn tiles<K: Kind, W: Wide, const VNNI: bool, const A: usize>(
    at: W,
    sbs: usize,
    q: &[Q8KRow<'_>],
    ahead: &Ahead<A>,
    out: &Columns<'_>,
) {
    let mut y = 0;
    if VNNI {
        y = whole_tiles::<K, W, VNNI_TILE, VNNI, A>(at, sbs, q, y, ahead, out);
    }
    y = whole_tiles::<K, W, TILE, VNNI, A>(at, sbs, q, y, ahead, out);
    // Tiles of two for the last rows: a mixture's experts multiply two or three rows
    // each in a batch-16 step, and a tile of one unpacks the group's weights once a row.
    y = whole_tiles::<K, W, 2, VNNI, A>(at, sbs, q, y, ahead, out);
    whole_tiles::<K, W, 1, VNNI, A>(at, sbs, q, y, ahead, out);
}

/// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the row
/// after them. The first tile of all asks for `ahead`.
///
/// # Safety
/// As for [`tiles`].
#[inline(always)]
unsafe fn whole_tiles<K: Kind, W: Wide, const T: usize, const VNNI: bool, const A: usize>(
    at: W,
    sbs: usize,
    q: &[Q8KRow<'_>],
    mut y: usize,
    ahead: &Ahead<A>,
    out: &Columns<'_>,
) -> usize {
    while y + T <= q.len() {
        let rows: &[Q8KRow<'_>; T] = q[y..y + T].try_into().expect("a whole tile");
        let ahead = ahead.for_tile_from(y);
        for (i, acc) in tile::<K, W, T, VNNI, A>(at, sbs, rows, ahead)
            .into_iter()
            .enumerate()
        {
            put::<W>(out, y + i, acc);
        }
        y += T;
    }
    y
}

/// Row `y`'s outputs `acc` into its columns of `out` ([`Columns::store_row`]).
///
/// # Safety
/// As for [`Wide`].
#[inline(always)]
unsafe fn put<W: Wide>(out: &Columns<'_>, y: usize, acc: W::F) {
    // SAFETY: `store_row` hands over `W::LANES` floats, what `W::store` writes.
    out.store_row(y, W::LANES, |to| unsafe { W::store(acc, to) });
}

/// `T` activation rows against a group (or two): for each, lane `i` is weight row `i`'s
/// output. Asks for part `sb` of `ahead` with super-block `sb`.
///
/// # Safety
/// As for [`tiles`].
#[inline(always)]
unsafe fn tile<K: Kind, W: Wide, const T: usize, const VNNI: bool, const A: usize>(
    at: W,
    sbs: usize,
    rows: &[Q8KRow<'_>; T],
    ahead: &Ahead<A>,
) -> [W::F; T] {
    let mut acc = [W::zero_f(); T];
    let long = T >= VNNI_TILE;
    for sb in 0..sbs {
        ahead.part(sb);
        let blk = at.add(sb * K::FORMAT.group_bytes());
        let mut sumi = [W::zero(); T];
        for c in 0..QK_K / CHUNK {
            let mut wv = nibbles::<W>(K::FORMAT, blk, c);
            K::add_high_bits(blk, c, &mut wv);
            let scales = K::scales(blk, c);
            for (row, sumi) in rows.iter().zip(sumi.iter_mut()) {
                let ys = row.qs.as_ptr().add(sb * QK_K + c * CHUNK);
                *sumi = W::add32(*sumi, K::dot::<W, VNNI>(&wv, ys, scales, long));
            }
        }
        // The weights' side of the super-block's terms, read once for the tile's rows.
        let side = K::side(blk);
        for ((row, sumi), acc) in rows.iter().zip(sumi).zip(acc.iter_mut()) {
            *acc = K::finish(&side, row, sb, sumi, *acc);
        }
    }
    acc
}

/// Chunk `c`'s low nibbles, as eight registers of eight rows' four weights a lane.
///
/// # Safety
/// As for [`Wide`]; `blk` starts a group block of `format`.
#[inline(always)]
unsafe fn nibbles<W: Wide>(format: KFormat, blk: W, c: usize) -> [W::I; 8] {
    let mask = W::splat8(0x0F);
    let at = format.chunk_at(c);
    let mut wv = [W::zero(); 8];
    for k in 0..4 {
        let v = blk.load(at + 32 * k);
        wv[k] = W::and(v, mask);
        wv[4 + k] = W::and(W::shr16(v, 4), mask);
    }
    wv
}

/// The four activations register `t` of a chunk multiplies, in every lane.
///
/// # Safety
/// As for [`Wide`]; `ys` starts a chunk of 32 activations.
#[inline(always)]
unsafe fn act<W: Wide>(ys: *const i8, t: usize) -> W::I {
    let off = if t < 4 { 4 * t } else { 16 + 4 * (t - 4) };
    W::splat32((ys.add(off) as *const i32).read_unaligned())
}

/// Bits `from .. from + width` of each byte of `v`, moved to bits `4 .. 4 + width`.
///
/// # Safety
/// As for [`Wide`].
#[inline(always)]
unsafe fn bits_to_high_nibble<W: Wide>(v: W::I, from: i32, width: u32) -> W::I {
    // 16-bit shifts move bits across the bytes, but never into bits 4 .. 4 + width of a
    // byte from outside it, which the mask keeps.
    let moved = if from <= 4 {
        W::shl16(v, 4 - from)
    } else {
        W::shr16(v, from - 4)
    };
    W::and(moved, W::splat8((((1u32 << width) - 1) << 4) as i8))
}

/// From [`Wide::pairs`], each lane's first (`SECOND` false) or second value in both its
/// halves.
///
/// # Safety
/// As for [`Wide`].
#[inline(always)]
unsafe fn spread<W: Wide, const SECOND: bool>(p: W::I) -> W::I {
    const FIRST: [i8; 16] = [0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13];
    const OTHER: [i8; 16] = [2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15];
    W::shuffle(p, if SECOND { &OTHER } else { &FIRST })
}

/// A sub-block's scale, from [`spread`], as the i16 pair it is (for `vpmaddwd`) and as
/// the i32 it is (for VNNI's sums).
struct Scale<W: Wide> {
    pair: W::I,
    wide: W::I,
}

impl<W: Wide> Clone for Scale<W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<W: Wide> Copy for Scale<W> {}

impl<W: Wide> Scale<W> {
    /// # Safety
    /// As for [`Wide`].
    #[inline(always)]
    unsafe fn of(spread: W::I) -> Self {
        Self {
            pair: spread,
            wide: W::madd16(spread, W::splat32(1)),
        }
    }

    /// The scale times the i16 sums of `s16`, both halves of each lane added: i32 lanes.
    ///
    /// # Safety
    /// As for [`Wide`].
    #[inline(always)]
    unsafe fn times16(self, s16: W::I) -> W::I {
        W::madd16(s16, self.pair)
    }

    /// The scale times i32 lanes.
    ///
    /// # Safety
    /// As for [`Wide`].
    #[inline(always)]
    unsafe fn times32(self, s32: W::I) -> W::I {
        W::mullo32(s32, self.wide)
    }
}

/// The sum of registers `ts`' products with their activations, in i16 pairs: each at most
/// `2 * ts.len() * (2^bits - 1) * 127` in size, which callers keep inside i16.
///
/// # Safety
/// As for [`Wide`]; `ys` starts a chunk.
#[inline(always)]
unsafe fn sum16<W: Wide>(wv: &[W::I; 8], ys: *const i8, ts: std::ops::Range<usize>) -> W::I {
    let mut s = W::zero();
    for t in ts {
        s = W::add16(s, W::maddubs(wv[t], act::<W>(ys, t)));
    }
    s
}

/// The same sum in i32 lanes by VNNI: exact either way. In two chains (`two`) so that one
/// need not wait for the other; else in one, where enough other rows' chains run beside it
/// to cover the instruction's latency.
///
/// # Safety
/// As for [`Wide::dpbusd`]; `ys` starts a chunk.
#[inline(always)]
unsafe fn sum32<W: Wide>(
    wv: &[W::I; 8],
    ys: *const i8,
    ts: std::ops::Range<usize>,
    two: bool,
) -> W::I {
    let (mut a, mut b) = (W::zero(), W::zero());
    let mut t = ts.start;
    while t + 1 < ts.end {
        a = W::dpbusd(a, wv[t], act::<W>(ys, t));
        if two {
            b = W::dpbusd(b, wv[t + 1], act::<W>(ys, t + 1));
        } else {
            a = W::dpbusd(a, wv[t + 1], act::<W>(ys, t + 1));
        }
        t += 2;
    }
    if two {
        W::add32(a, b)
    } else {
        a
    }
}

/// What sets the three formats apart.
trait Kind {
    const FORMAT: KFormat;
    /// A chunk's scales.
    type Scales<W: Wide>: Copy;
    /// What a super-block's last terms take from its group block, the same for every
    /// activation row.
    type Side<W: Wide>;

    /// # Safety
    /// As for [`Wide`]; `blk` starts a group block of this format.
    unsafe fn add_high_bits<W: Wide>(blk: W, c: usize, wv: &mut [W::I; 8]);

    /// # Safety
    /// As for [`Kind::add_high_bits`].
    unsafe fn scales<W: Wide>(blk: W, c: usize) -> Self::Scales<W>;

    /// A chunk's products with one activation row's, times their scales, in i32 lanes;
    /// `long` where the tile has [`VNNI_TILE`] rows, whose chains run side by side.
    ///
    /// # Safety
    /// As for [`Wide`] (and [`Wide::dpbusd`] when `VNNI`); `ys` starts a chunk.
    unsafe fn dot<W: Wide, const VNNI: bool>(
        wv: &[W::I; 8],
        ys: *const i8,
        s: Self::Scales<W>,
        long: bool,
    ) -> W::I;

    /// # Safety
    /// As for [`Kind::add_high_bits`].
    unsafe fn side<W: Wide>(blk: W) -> Self::Side<W>;

    /// `acc` with super-block `sb`'s terms added, its integer sum being `sumi` and `side`
    /// read from its group block.
    ///
    /// # Safety
    /// As for [`Wide`].
    unsafe fn finish<W: Wide>(
        side: &Self::Side<W>,
        row: &Q8KRow<'_>,
        sb: usize,
        sumi: W::I,
        acc: W::F,
    ) -> W::F;
}

/// Q4_K (`FIVE` false) and Q5_K, whose sub-blocks are chunks with a minimum each.
struct WithMins<const FIVE: bool>;
type Q4K = WithMins<false>;
type Q5K = WithMins<true>;
struct Q6K;

impl<const FIVE: bool> Kind for WithMins<FIVE> {
    const FORMAT: KFormat = if FIVE { KFormat::Q5K } else { KFormat::Q4K };
    type Scales<W: Wide> = Scale<W>;
    /// The eight sub-blocks' minimums as i16 pairs, `d` and `dmin`.
    type Side<W: Wide> = ([W::I; 4], W::F, W::F);

    #[inline(always)]
    unsafe fn add_high_bits<W: Wide>(blk: W, c: usize, wv: &mut [W::I; 8]) {
        if !FIVE {
            return;
        }
        let h = blk.load(Self::FORMAT.high_at(c));
        for (t, w) in wv.iter_mut().enumerate() {
            *w = W::or(*w, bits_to_high_nibble::<W>(h, t as i32, 1));
        }
    }

    #[inline(always)]
    unsafe fn scales<W: Wide>(blk: W, c: usize) -> Scale<W> {
        let p = blk.pairs(Self::FORMAT.scales_at() + c / 2 * 16);
        Scale::of(if c.is_multiple_of(2) {
            spread::<W, false>(p)
        } else {
            spread::<W, true>(p)
        })
    }

    #[inline(always)]
    unsafe fn dot<W: Wide, const VNNI: bool>(
        wv: &[W::I; 8],
        ys: *const i8,
        s: Scale<W>,
        _long: bool,
    ) -> W::I {
        if VNNI {
            // Two chains even in a long tile: one of eight ran Q4_K's 512-row product at
            // 0.88-0.91x in `product-bench`, eight rows' chains too few for the latency.
            s.times32(sum32::<W>(wv, ys, 0..8, true))
        } else if FIVE {
            // Four registers of products of at most 2 * 31 * 127: 31496, inside i16.
            let a = s.times16(sum16::<W>(wv, ys, 0..4));
            W::add32(a, s.times16(sum16::<W>(wv, ys, 4..8)))
        } else {
            // Eight registers of products of at most 2 * 15 * 127: 30480, inside i16.
            s.times16(sum16::<W>(wv, ys, 0..8))
        }
    }

    #[inline(always)]
    unsafe fn side<W: Wide>(blk: W) -> Self::Side<W> {
        let format = Self::FORMAT;
        let mins = std::array::from_fn(|p| blk.pairs(format.mins_at() + 16 * p));
        (
            mins,
            blk.halves(format.d_at()),
            blk.halves(format.dmin_at()),
        )
    }

    /// `d * dy * sumi - dmin * dy * Σ min · sums32`.
    #[inline(always)]
    unsafe fn finish<W: Wide>(
        (mins, d, dmin): &Self::Side<W>,
        row: &Q8KRow<'_>,
        sb: usize,
        sumi: W::I,
        acc: W::F,
    ) -> W::F {
        let sums = row.sums32.as_ptr().add(sb * 8) as *const i32;
        let mut summ = W::zero();
        for (p, &mins) in mins.iter().enumerate() {
            let ys = W::splat32(sums.add(p).read_unaligned());
            summ = W::add32(summ, W::madd16(mins, ys));
        }
        let (d, dmin) = (*d, *dmin);
        let dy = W::splat_f(*row.d.get_unchecked(sb));
        let acc = W::fmadd(W::to_f(sumi), W::mul(d, dy), acc);
        W::fnmadd(W::to_f(summ), W::mul(dmin, dy), acc)
    }
}

impl Kind for Q6K {
    const FORMAT: KFormat = KFormat::Q6K;
    /// The chunk's two sub-blocks' scales: registers 0-3, then 4-7.
    type Scales<W: Wide> = [Scale<W>; 2];
    /// The sixteen sub-blocks' scales as i16 pairs, and `d`.
    type Side<W: Wide> = ([W::I; 8], W::F);

    #[inline(always)]
    unsafe fn add_high_bits<W: Wide>(blk: W, c: usize, wv: &mut [W::I; 8]) {
        let at = Self::FORMAT.high_at(c);
        for (half, wv) in wv.chunks_exact_mut(4).enumerate() {
            let h = blk.load(at + 32 * half);
            for (t, w) in wv.iter_mut().enumerate() {
                *w = W::or(*w, bits_to_high_nibble::<W>(h, 2 * t as i32, 2));
            }
        }
    }

    #[inline(always)]
    unsafe fn scales<W: Wide>(blk: W, c: usize) -> [Scale<W>; 2] {
        let p = blk.pairs(Self::FORMAT.scales_at() + 16 * c);
        [
            Scale::of(spread::<W, false>(p)),
            Scale::of(spread::<W, true>(p)),
        ]
    }

    #[inline(always)]
    unsafe fn dot<W: Wide, const VNNI: bool>(
        wv: &[W::I; 8],
        ys: *const i8,
        s: [Scale<W>; 2],
        long: bool,
    ) -> W::I {
        if VNNI {
            // A long tile's rows run two chains each, one a sub-block: sixteen in all.
            let a = s[0].times32(sum32::<W>(wv, ys, 0..4, !long));
            W::add32(a, s[1].times32(sum32::<W>(wv, ys, 4..8, !long)))
        } else {
            // Two registers of products of at most 2 * 63 * 127: 32004, inside i16.
            let mut s32 = W::zero();
            for t in (0..8).step_by(2) {
                let part = s[t / 4].times16(sum16::<W>(wv, ys, t..t + 2));
                s32 = W::add32(s32, part);
            }
            s32
        }
    }

    #[inline(always)]
    unsafe fn side<W: Wide>(blk: W) -> Self::Side<W> {
        let at = Self::FORMAT.scales_at();
        let scales = std::array::from_fn(|p| blk.pairs(at + 16 * p));
        (scales, blk.halves(Self::FORMAT.d_at()))
    }

    /// `d * dy * (sumi - 32 Σ scale · sums16)`: the offset of 32 every weight carries.
    #[inline(always)]
    unsafe fn finish<W: Wide>(
        (scales, d): &Self::Side<W>,
        row: &Q8KRow<'_>,
        sb: usize,
        sumi: W::I,
        acc: W::F,
    ) -> W::F {
        let sums = row.sums16.as_ptr().add(sb * 16) as *const i32;
        let mut offset = W::zero();
        for (p, &scales) in scales.iter().enumerate() {
            let ys = W::splat32(sums.add(p).read_unaligned());
            offset = W::add32(offset, W::madd16(scales, ys));
        }
        let sumi = W::sub32(sumi, W::shl32(offset, 5));
        let dy = W::splat_f(*row.d.get_unchecked(sb));
        W::fmadd(W::to_f(sumi), W::mul(*d, dy), acc)
    }
}
