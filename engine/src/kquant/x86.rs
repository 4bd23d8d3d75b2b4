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
//!
//! A prompt's many rows would unpack each chunk again for every tile; from
//! [`UNPACK_FROM_ROWS`] rows the group's super-blocks are unpacked once, into this thread's
//! room ([`crate::room`]), and every tile reads them from there.

mod kinds;

use super::format::{KFormat, CHUNK, QK_K};
use super::q8k::Q8KRow;
use super::wide::{Wide, Ymm, Zmm};
use crate::ahead::Ahead;
use crate::split::Columns;
use kinds::{nibbles, Kind, Q4K, Q5K, Q6K};

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

/// The rows in tiles, the widest first. From [`UNPACK_FROM_ROWS`] rows each super-block is
/// unpacked once, before them, and every tile reads it unpacked ([`Ready`]); below, each
/// tile unpacks each chunk as it goes ([`Packed`]). Whoever reads the group blocks asks for
/// `ahead`, part `sb` with super-block `sb`.
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
    if q.len() < UNPACK_FROM_ROWS {
        return all_tiles::<K, W, VNNI, A>(Packed(at), sbs, q, ahead, out);
    }
    // Any bits are an `Unpacked` (vectors), and the kernels call no other while they read
    // the room: `room`'s terms. It holds `sbs` of them, each written before the tiles.
    let room = crate::room::room::<Unpacked<K, W>>(sbs);
    for sb in 0..sbs {
        ahead.part(sb);
        unpack::<K, W>(at.add(sb * K::FORMAT.group_bytes()), &mut *room.add(sb));
    }
    let unpacked = std::slice::from_raw_parts(room, sbs);
    all_tiles::<K, W, VNNI, 0>(Ready(unpacked), sbs, q, &Ahead::NONE, out)
}

/// Activation rows from which a group's super-blocks are unpacked before the tiles. The
/// unpacked row of super-blocks outgrows the L1 cache at a 1.5B's widths, and costs about
/// a tile to write; measured in `product-bench` against unpacking in every tile, runs
/// alternated in one process: at 512 rows 1.04-1.14x for Q4_K and Q6_K and 1.18-1.22x for
/// Q5_K on 512-bit registers (1.07-1.27x on the 256-bit and AVX2 paths); at 128 rows
/// 0.90-1.18x, about level for Q4_K; at 16 rows 0.64-0.91x.
pub(super) const UNPACK_FROM_ROWS: usize = 128;

/// The rows in tiles of [`VNNI_TILE`] (with VNNI), then [`TILE`], two and one; the first
/// tile of all asks for `ahead`.
///
/// # Safety
/// As for [`tiles`], with `sbs` super-blocks in `from`.
#[inline(always)]
unsafe fn all_tiles<K: Kind, W: Wide, const VNNI: bool, const A: usize>(
    from: impl Source<K, W>,
    sbs: usize,
    q: &[Q8KRow<'_>],
    ahead: &Ahead<A>,
    out: &Columns<'_>,
) {
    let mut y = 0;
    if VNNI {
        y = whole_tiles::<K, W, VNNI_TILE, VNNI, A>(from, sbs, q, y, ahead, out);
    }
    y = whole_tiles::<K, W, TILE, VNNI, A>(from, sbs, q, y, ahead, out);
    // Tiles of two for the last rows: a mixture's experts multiply two or three rows
    // each in a batch-16 step, and a tile of one unpacks the group's weights once a row.
    y = whole_tiles::<K, W, 2, VNNI, A>(from, sbs, q, y, ahead, out);
    whole_tiles::<K, W, 1, VNNI, A>(from, sbs, q, y, ahead, out);
}

/// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the row
/// after them. The first tile of all asks for `ahead`.
///
/// # Safety
/// As for [`all_tiles`].
#[inline(always)]
unsafe fn whole_tiles<K: Kind, W: Wide, const T: usize, const VNNI: bool, const A: usize>(
    from: impl Source<K, W>,
    sbs: usize,
    q: &[Q8KRow<'_>],
    mut y: usize,
    ahead: &Ahead<A>,
    out: &Columns<'_>,
) -> usize {
    while y + T <= q.len() {
        let rows: &[Q8KRow<'_>; T] = q[y..y + T].try_into().expect("a whole tile");
        let ahead = ahead.for_tile_from(y);
        for (i, acc) in tile::<K, W, T, VNNI, A>(from, sbs, rows, ahead)
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
/// As for [`all_tiles`].
#[inline(always)]
unsafe fn tile<K: Kind, W: Wide, const T: usize, const VNNI: bool, const A: usize>(
    from: impl Source<K, W>,
    sbs: usize,
    rows: &[Q8KRow<'_>; T],
    ahead: &Ahead<A>,
) -> [W::F; T] {
    let mut acc = [W::zero_f(); T];
    let long = T >= VNNI_TILE;
    for sb in 0..sbs {
        ahead.part(sb);
        let mut sumi = [W::zero(); T];
        for c in 0..CHUNKS {
            let (wv, scales) = from.chunk(sb, c);
            for (row, sumi) in rows.iter().zip(sumi.iter_mut()) {
                let ys = row.qs.as_ptr().add(sb * QK_K + c * CHUNK);
                *sumi = W::add32(*sumi, K::dot::<W, VNNI>(&wv, ys, scales, long));
            }
        }
        // The weights' side of the super-block's terms, read once for the tile's rows.
        let side = from.side(sb);
        for ((row, sumi), acc) in rows.iter().zip(sumi).zip(acc.iter_mut()) {
            *acc = K::finish(&side, row, sb, sumi, *acc);
        }
    }
    acc
}

/// Chunks of a super-block.
const CHUNKS: usize = QK_K / CHUNK;

/// Where a tile's weights come from: each chunk's eight weight registers (high bits in)
/// and scales, each super-block's side.
///
/// # Safety
/// Every method needs what [`Wide`]'s do, and super-block `sb` at the source.
trait Source<K: Kind, W: Wide>: Copy {
    unsafe fn chunk(self, sb: usize, c: usize) -> ([W::I; 8], K::Scales<W>);
    unsafe fn side(self, sb: usize) -> K::Side<W>;
}

/// The group blocks themselves, unpacked as they are read.
#[derive(Clone, Copy)]
struct Packed<W>(W);

impl<K: Kind, W: Wide> Source<K, W> for Packed<W> {
    #[inline(always)]
    unsafe fn chunk(self, sb: usize, c: usize) -> ([W::I; 8], K::Scales<W>) {
        let blk = self.0.add(sb * K::FORMAT.group_bytes());
        let mut wv = nibbles::<W>(K::FORMAT, blk, c);
        K::add_high_bits(blk, c, &mut wv);
        (wv, K::scales(blk, c))
    }

    #[inline(always)]
    unsafe fn side(self, sb: usize) -> K::Side<W> {
        K::side(self.0.add(sb * K::FORMAT.group_bytes()))
    }
}

/// A super-block as [`Packed`] gives it, every part at once: 5.4 KiB of Q4_K and 6.6 KiB of
/// Q6_K on 512-bit registers, so a thread's room for a 1.5B's down projection (8,960 wide)
/// is 230 KiB.
struct Unpacked<K: Kind, W: Wide> {
    chunks: [[W::I; 8]; CHUNKS],
    scales: [K::Scales<W>; CHUNKS],
    side: K::Side<W>,
}

/// Super-blocks unpacked before the tiles.
struct Ready<'a, K: Kind, W: Wide>(&'a [Unpacked<K, W>]);

impl<K: Kind, W: Wide> Clone for Ready<'_, K, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K: Kind, W: Wide> Copy for Ready<'_, K, W> {}

impl<K: Kind, W: Wide> Source<K, W> for Ready<'_, K, W> {
    #[inline(always)]
    unsafe fn chunk(self, sb: usize, c: usize) -> ([W::I; 8], K::Scales<W>) {
        let u = self.0.get_unchecked(sb);
        (u.chunks[c], u.scales[c])
    }

    #[inline(always)]
    unsafe fn side(self, sb: usize) -> K::Side<W> {
        self.0.get_unchecked(sb).side
    }
}

/// Writes the super-block at `blk` unpacked into `to`.
///
/// # Safety
/// As for [`Wide`]; `blk` starts a group block of `K`'s format.
#[inline(always)]
unsafe fn unpack<K: Kind, W: Wide>(blk: W, to: &mut Unpacked<K, W>) {
    let from = Packed(blk);
    for c in 0..CHUNKS {
        (to.chunks[c], to.scales[c]) = Source::<K, W>::chunk(from, 0, c);
    }
    to.side = Source::<K, W>::side(from, 0);
}
