//! What sets Q4_K, Q5_K and Q6_K apart in the x86 kernels ([`Kind`]), and the register
//! work they share: unpacking a chunk's nibbles, spreading its scales across the lanes,
//! and summing a chunk's products in i16 pairs or, with VNNI, in i32 lanes.

use crate::kquant::format::KFormat;
use crate::kquant::q8k::Q8KRow;
use crate::kquant::wide::Wide;

/// Chunk `c`'s low nibbles, as eight registers of eight rows' four weights a lane.
///
/// # Safety
/// As for [`Wide`]; `blk` starts a group block of `format`.
#[inline(always)]
pub(super) unsafe fn nibbles<W: Wide>(format: KFormat, blk: W, c: usize) -> [W::I; 8] {
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
pub(super) struct Scale<W: Wide> {
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

/// A super-block's weight-side i16 pairs against the activations' sums from `sums`: each
/// register `p`'s pairs times sums `2p` and `2p + 1` in every lane, added in i32 (exact).
///
/// # Safety
/// As for [`Wide`]; `sums` starts `2 * N` readable sums.
#[inline(always)]
unsafe fn pairs_times_sums<W: Wide, const N: usize>(pairs: &[W::I; N], sums: *const i16) -> W::I {
    let sums = sums as *const i32;
    let mut total = W::zero();
    for (p, &pair) in pairs.iter().enumerate() {
        let ys = W::splat32(sums.add(p).read_unaligned());
        total = W::add32(total, W::madd16(pair, ys));
    }
    total
}

/// What sets the three formats apart.
pub(super) trait Kind {
    const FORMAT: KFormat;
    /// A chunk's scales.
    type Scales<W: Wide>: Copy;
    /// What a super-block's last terms take from its group block, the same for every
    /// activation row.
    type Side<W: Wide>: Copy;

    /// # Safety
    /// As for [`Wide`]; `blk` starts a group block of this format.
    unsafe fn add_high_bits<W: Wide>(blk: W, c: usize, wv: &mut [W::I; 8]);

    /// # Safety
    /// As for [`Kind::add_high_bits`].
    unsafe fn scales<W: Wide>(blk: W, c: usize) -> Self::Scales<W>;

    /// A chunk's products with one activation row's, times their scales, in i32 lanes;
    /// `long` where the tile has [`super::VNNI_TILE`] rows, whose chains run side by side.
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
pub(super) struct WithMins<const FIVE: bool>;
pub(super) type Q4K = WithMins<false>;
pub(super) type Q5K = WithMins<true>;
pub(super) struct Q6K;

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
        let summ = pairs_times_sums::<W, 4>(mins, row.sums32.as_ptr().add(sb * 8));
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
        let offset = pairs_times_sums::<W, 8>(scales, row.sums16.as_ptr().add(sb * 16));
        let sumi = W::sub32(sumi, W::shl32(offset, 5));
        let dy = W::splat_f(*row.d.get_unchecked(sb));
        W::fmadd(W::to_f(sumi), W::mul(*d, dy), acc)
    }
}
