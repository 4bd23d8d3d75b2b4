//! Q4_1 weights times f32 activations on the CPU. Each activation row is quantized to Q8_1
//! blocks (as candle and ggml do); each output is the sum over blocks, in block order, of
//! the block's integer dot product times the product of the two blocks' scales, plus the
//! weight block's minimum times the activation block's sum, each added with one fused
//! multiply-add. candle adds each block's term with four roundings more; its values and
//! these differ in the last bits, and the llama.cpp agreement test (engine/tests) is what
//! holds the tokens. Every path here (scalar, AVX2, VNNI; a tile of four activation rows or
//! one) gives the same bits, so an output never depends on the CPU, on the batch or on
//! where in it a row sits: PD gives colocated's tokens.
//!
//! The weights' f16 scales are widened once at load and weight rows are stored in groups
//! of eight, interleaved, so that one AVX2 multiply takes four values of each of the eight
//! rows against the same four activations: the eight rows' integer sums build up in the
//! lanes of one register with no horizontal reduction. A group's unpacked block serves a
//! tile of four activation rows. Work is split by groups across candle's worker threads;
//! where the CPU has VNNI on 512-bit registers, by pairs of groups side by side in one
//! register (from four activation rows).

use bytes::Bytes;
use half::f16;

#[cfg(target_arch = "x86_64")]
use crate::act_quant::has_vnni;
use crate::act_quant::{each_run, q81_scales, quantize_blocks, QK, RUN};
use crate::ahead::{self, BlockRuns};
use crate::error::{EngineError, Result};
use crate::split::{self, SharedOut, GROUP};

/// Bytes of one Q4_1 block: `d` (f16), `m` (f16), 16 bytes of nibbles.
const Q41_BYTES: usize = 20;
/// Bytes a block takes in a [`Q41Matrix`]: its scale and minimum as f32, 16 of nibbles.
const BLOCK_BYTES: usize = 4 + 4 + QK / 2;
/// Activation rows that share one unpacked weight block.
const TILE: usize = 4;
/// Activation rows that share a pair of unpacked blocks on 512-bit registers, whose 32
/// registers hold the pair's eight weight registers beside eight rows' sums.
const PAIR_TILE: usize = 8;

/// A `[rows, cols]` Q4_1 matrix: each block's scale and minimum widened to f32 once at load
/// (a few more bytes per block read, no f16 conversion per block and row), and its nibbles.
/// The first `rows / 8 * 8` rows are in groups of eight: for each block, the eight rows'
/// scales (`d[(g * nb + b) * 8 + i]`, likewise `m`), then four runs of 32 bytes, run `k`
/// holding bytes `4k .. 4k + 4` of each row's block in row order. The rows after them are
/// stored one after another. Both parts sit at the offsets the plain layout would give them.
/// Its bytes hold every scale, then every minimum, then the nibbles: its own bytes, or a
/// region of a mapped pack file ([`crate::pack`]).
#[derive(Debug)]
pub struct Q41Matrix {
    rows: usize,
    cols: usize,
    data: Bytes,
}

/// One block of 32 weights, each `d * q + m` for its nibble `q`: nibble `i` of the 32 is
/// the low half of `qs[i]` for `i < 16`, else the high half of `qs[i - 16]` (GGML's Q4_1).
struct Block {
    d: f32,
    m: f32,
    qs: [u8; QK / 2],
}

/// One weight row: its blocks' scales, minimums and nibbles.
#[derive(Clone, Copy)]
struct WRow<'a> {
    d: &'a [f32],
    m: &'a [f32],
    qs: &'a [u8],
}

/// One group of eight interleaved weight rows.
#[derive(Clone, Copy)]
struct WGroup<'a> {
    d: &'a [f32],
    m: &'a [f32],
    qs: &'a [u8],
}

/// Activation rows as Q8_1 blocks, row after row, the scales already widened to f32.
struct Q81Rows {
    cols: usize,
    d: Vec<f32>,
    s: Vec<f32>,
    qs: Vec<i8>,
}

/// One activation row of [`Q81Rows`].
#[derive(Clone, Copy)]
struct Q81Row<'a> {
    d: &'a [f32],
    s: &'a [f32],
    qs: &'a [i8],
}

impl Q81Rows {
    /// `x`, rows of `cols` values (a multiple of 32), as candle's `BlockQ8_1::from_float`
    /// quantizes them, value for value; a batch's rows across candle's pool, as the
    /// K-quants' activations are (a decode step of 16 rows quantized them on one thread
    /// while the other waited, 3% of the step).
    fn quantize(x: &[f32], cols: usize) -> Self {
        assert!(cols.is_multiple_of(QK) && x.len().is_multiple_of(cols));
        let (n, blocks) = (x.len() / cols, x.len() / QK);
        // Not zeroed first: the calling thread's zeros took each line from the core that
        // had read it last, only for a worker to take it back (the o product at 16 rows
        // 1.002-1.020x without them, bench/HISTORY.md "2026-12-07, fourth session").
        let mut rows = Self {
            cols,
            d: Vec::with_capacity(blocks),
            s: Vec::with_capacity(blocks),
            qs: Vec::with_capacity(x.len()),
        };
        let (d, s, qs) = (
            SharedOut::spare(&mut rows.d, blocks),
            SharedOut::spare(&mut rows.s, blocks),
            SharedOut::spare(&mut rows.qs, x.len()),
        );
        each_run(n, cols / QK, |run| {
            for start in run.clone().step_by(RUN) {
                let len = RUN.min(run.end - start);
                let mut sums = [0; RUN];
                // SAFETY: each run's blocks are written by the one worker that got it.
                let (d, s, qs) = unsafe {
                    (
                        d.slice(start, len),
                        s.slice(start, len),
                        qs.slice(QK * start, QK * len),
                    )
                };
                quantize_blocks(&x[QK * start..][..QK * len], qs, d, &mut sums[..len]);
                q81_scales(d, &sums[..len], s);
            }
        });
        // SAFETY: `each_run` ran every block, each writing its scale, its sum and its 32
        // values.
        unsafe {
            rows.d.set_len(blocks);
            rows.s.set_len(blocks);
            rows.qs.set_len(x.len());
        }
        rows
    }

    /// Each row's view.
    fn rows(&self) -> Vec<Q81Row<'_>> {
        let nb = self.cols / QK;
        (0..self.qs.len() / self.cols)
            .map(|y| Q81Row {
                d: &self.d[y * nb..][..nb],
                s: &self.s[y * nb..][..nb],
                qs: &self.qs[y * self.cols..][..self.cols],
            })
            .collect()
    }
}

/// A weight row copied out of its group, in the plain layout.
struct OwnedRow {
    d: Vec<f32>,
    m: Vec<f32>,
    qs: Vec<u8>,
}

impl OwnedRow {
    fn view(&self) -> WRow<'_> {
        WRow {
            d: &self.d,
            m: &self.m,
            qs: &self.qs,
        }
    }
}

impl Q41Matrix {
    /// Takes GGML Q4_1 data of a `[rows, cols]` tensor.
    pub fn from_ggml(bytes: Vec<u8>, rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(QK) || bytes.len() != rows * cols / QK * Q41_BYTES {
            return Err(EngineError::InvalidInput(format!(
                "Q4_1 data of {} bytes does not make a [{rows}, {cols}] matrix",
                bytes.len()
            )));
        }
        let blocks = bytes.chunks_exact(Q41_BYTES).map(|blk| Block {
            d: f16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            m: f16::from_le_bytes([blk[2], blk[3]]).to_f32(),
            qs: blk[4..].try_into().expect("16 bytes of nibbles"),
        });
        Ok(Self::from_blocks(rows, cols, blocks))
    }

    /// The matrix of `rows * cols / 32` blocks, row by row. The caller checks the count.
    fn from_blocks(rows: usize, cols: usize, blocks: impl Iterator<Item = Block>) -> Self {
        let nb = cols / QK;
        let grouped = rows / GROUP * GROUP;
        let n = rows * nb;
        // Scales, minimums, then 16 bytes of nibbles a block: four words.
        let mut words = vec![0f32; 6 * n];
        let (d, rest) = words.split_at_mut(n);
        let (m, qs) = rest.split_at_mut(n);
        let qs: &mut [u8] = bytemuck::cast_slice_mut(qs);
        for (i, blk) in blocks.enumerate() {
            let (r, b) = (i / nb, i % nb);
            let at = if r < grouped {
                let (g, lane) = (r / GROUP, r % GROUP);
                let at = (g * nb + b) * GROUP + lane;
                for k in 0..4 {
                    let to = at / GROUP * GROUP * QK / 2 + k * 4 * GROUP + lane * 4;
                    qs[to..to + 4].copy_from_slice(&blk.qs[4 * k..4 * k + 4]);
                }
                at
            } else {
                qs[i * QK / 2..(i + 1) * QK / 2].copy_from_slice(&blk.qs);
                i
            };
            d[at] = blk.d;
            m[at] = blk.m;
        }
        Self {
            rows,
            cols,
            data: crate::pack::aligned_bytes(words),
        }
    }

    /// A `[rows, cols]` matrix whose bytes are `data`, as [`Q41Matrix::data`] gave them:
    /// refused unless `data` is exactly that many bytes, its scales and minimums aligned.
    pub(crate) fn from_packed(rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        let m = Self { rows, cols, data };
        let whole = cols > 0 && cols.is_multiple_of(QK);
        let len = rows.checked_mul(cols / QK * BLOCK_BYTES);
        if !whole
            || len != Some(m.data.len())
            || bytemuck::try_cast_slice::<u8, f32>(m.word_bytes()).is_err()
        {
            return Err(EngineError::InvalidInput(format!(
                "a packed Q4_1 matrix of {} bytes for [{rows}, {cols}]",
                m.data.len()
            )));
        }
        Ok(m)
    }

    /// Its bytes, as [`Q41Matrix::from_packed`] takes them.
    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    /// Rows of the matrix.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Values in a row of activations.
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight data read per product.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The scales' and minimums' bytes.
    fn word_bytes(&self) -> &[u8] {
        &self.data[..8 * self.rows * self.blocks()]
    }

    /// Every block's scale, then every block's minimum, in the layout's order.
    fn d_m(&self) -> (&[f32], &[f32]) {
        let words: &[f32] = bytemuck::cast_slice(self.word_bytes());
        words.split_at(words.len() / 2)
    }

    /// Every block's nibbles, in the layout's order.
    fn qs(&self) -> &[u8] {
        &self.data[8 * self.rows * self.blocks()..]
    }

    fn blocks(&self) -> usize {
        self.cols / QK
    }

    fn group(&self, g: usize) -> WGroup<'_> {
        let n = self.blocks() * GROUP;
        let (d, m) = self.d_m();
        WGroup {
            d: &d[g * n..(g + 1) * n],
            m: &m[g * n..(g + 1) * n],
            qs: &self.qs()[g * n * QK / 2..(g + 1) * n * QK / 2],
        }
    }

    /// Groups `g` and `g + 1` to be asked for a block at a time while the pair before them
    /// computes; `g` twice where it is the last group, none past the last.
    fn next_pair(&self, g: usize) -> Option<NextPair<'_>> {
        let groups = self.rows / GROUP;
        (g < groups).then(|| NextPair([self.group(g), self.group((g + 1).min(groups - 1))]))
    }

    /// Asks the memory for all of group `g`, if the matrix has it, before the group before
    /// it computes: from one to three activation rows a group's work is too short to hide
    /// the wait for its first lines of each 4 KiB page (bench/HISTORY.md, "2026-12-07,
    /// second session": batch-1 decode of SmolLM2 1.1x).
    fn ask_group(&self, g: usize) {
        if g < self.rows / GROUP {
            let w = self.group(g);
            for run in [bytemuck::cast_slice(w.d), bytemuck::cast_slice(w.m), w.qs] {
                ahead::ask_for(run.as_ptr(), run.len());
            }
        }
    }

    /// A row after the groups.
    fn loose_row(&self, r: usize) -> WRow<'_> {
        let nb = self.blocks();
        let (d, m) = self.d_m();
        WRow {
            d: &d[r * nb..(r + 1) * nb],
            m: &m[r * nb..(r + 1) * nb],
            qs: &self.qs()[r * nb * QK / 2..(r + 1) * nb * QK / 2],
        }
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let q = Q81Rows::quantize(x, self.cols);
        let q = q.rows();
        let q = q.as_slice();
        let pair = pair_kernel().filter(|_| n >= split::PAIRED_FROM_ROWS);
        let pair = pair.map(|pair| {
            move |g: usize, out: &split::Columns<'_>| {
                let groups = [self.group(g), self.group(g + 1)];
                let next = self.next_pair(g + 2);
                // SAFETY: `pair_kernel` found AVX2, FMA and 512-bit VNNI; both groups have as
                // many blocks as the rows.
                unsafe { pair(groups, q, next, out) };
            }
        });
        split::by_groups(
            self.rows,
            n,
            pair,
            |g, out| {
                self.ask_group(g + 1);
                dot_group(self.group(g), q, |y, vals| out.put_lanes(y, &vals))
            },
            |r, out| {
                let w = self.loose_row(r);
                for (y, row) in q.iter().enumerate() {
                    out.put(y, &[dot_one(w, row)]);
                }
            },
        )
    }
}

/// Two groups against activation rows: each row's sixteen outputs, the first group's eight
/// and then the second's, stored into its columns of `out`. Block `b` of the next pair is
/// asked for with block `b`.
type PairKernel = unsafe fn([WGroup<'_>; 2], &[Q81Row], Option<NextPair<'_>>, &split::Columns<'_>);

/// The pair of groups after a pair kernel's, whose bytes it asks the memory for while it
/// computes (`crate::ahead`): a decode step reads each layer's weights from memory, and the
/// cores' prefetchers stop at every 4 KiB page, so each pair began by waiting.
#[derive(Clone, Copy)]
struct NextPair<'a>([WGroup<'a>; 2]);

impl BlockRuns for NextPair<'_> {
    /// Each group's block `b`: its scales, minimums and nibbles.
    #[inline(always)]
    fn each_run(&self, b: usize, mut f: impl FnMut(*const u8, usize)) {
        for w in &self.0 {
            let words = |v: &[f32]| v.as_ptr().wrapping_add(b * GROUP).cast::<u8>();
            f(words(w.d), 4 * GROUP);
            f(words(w.m), 4 * GROUP);
            f(
                w.qs.as_ptr().wrapping_add(b * GROUP * QK / 2),
                GROUP * QK / 2,
            );
        }
    }
}

/// The pair kernel on 512-bit registers, where the CPU has them with VNNI.
fn pair_kernel() -> Option<PairKernel> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if avx2 && crate::act_quant::has_vnni_512() {
            return Some(avx2::dot_pair_512);
        }
    }
    None
}

/// A group of eight weight rows against every activation row: `emit(y, outputs)` gets
/// activation row `y`'s eight outputs.
fn dot_group(w: WGroup<'_>, rows: &[Q81Row], emit: impl FnMut(usize, [f32; GROUP])) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            if has_vnni() {
                // SAFETY: AVX2, FMA and AVX-512 VNNI/VL are present, checked just above.
                unsafe { avx2::dot_group_vnni(w, rows, emit) };
            } else {
                // SAFETY: AVX2 and FMA are present, checked just above.
                unsafe { avx2::dot_group(w, rows, emit) };
            }
            return;
        }
    }
    scalar_dot_group(w, rows, emit);
}

fn scalar_dot_group(w: WGroup<'_>, rows: &[Q81Row], mut emit: impl FnMut(usize, [f32; GROUP])) {
    let mut vals = vec![[0f32; GROUP]; rows.len()];
    for lane in 0..GROUP {
        let row = group_row(w, lane);
        for (y, v) in rows.iter().zip(vals.iter_mut()) {
            v[lane] = scalar_dot_one(row.view(), y);
        }
    }
    for (y, v) in vals.into_iter().enumerate() {
        emit(y, v);
    }
}

/// Row `lane` of a group, copied into the plain layout.
fn group_row(w: WGroup<'_>, lane: usize) -> OwnedRow {
    let nb = w.d.len() / GROUP;
    let mut qs = Vec::with_capacity(nb * QK / 2);
    for b in 0..nb {
        for k in 0..4 {
            let at = b * GROUP * QK / 2 + k * 4 * GROUP + lane * 4;
            qs.extend_from_slice(&w.qs[at..at + 4]);
        }
    }
    OwnedRow {
        d: (0..nb).map(|b| w.d[b * GROUP + lane]).collect(),
        m: (0..nb).map(|b| w.m[b * GROUP + lane]).collect(),
        qs,
    }
}

/// One weight row against one activation row.
fn dot_one(w: WRow<'_>, y: &Q81Row) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present, checked just above.
            return unsafe { avx2::dot_one(w, y) };
        }
    }
    scalar_dot_one(w, y)
}

/// `acc` with block `b`'s two terms added, as every path adds them: the integer sum times
/// the scales' product, then the minimum times the activations' sum, each one fused
/// multiply-add.
#[inline(always)]
fn add_block(acc: f32, sumi: i32, w: WRow<'_>, y: &Q81Row, b: usize) -> f32 {
    let acc = (sumi as f32).mul_add(w.d[b] * y.d[b], acc);
    w.m[b].mul_add(y.s[b], acc)
}

/// The integer dot product of weight block `b` and activation block `b`.
fn block_sumi(w: WRow<'_>, y: &Q81Row, b: usize) -> i32 {
    let qs = &w.qs[b * QK / 2..(b + 1) * QK / 2];
    let ys = &y.qs[b * QK..(b + 1) * QK];
    (0..QK / 2)
        .map(|j| {
            let v0 = (qs[j] & 0x0F) as i32;
            let v1 = (qs[j] >> 4) as i32;
            v0 * ys[j] as i32 + v1 * ys[j + QK / 2] as i32
        })
        .sum()
}

fn scalar_dot_one(w: WRow<'_>, y: &Q81Row) -> f32 {
    (0..w.d.len()).fold(0f32, |acc, b| add_block(acc, block_sumi(w, y, b), w, y, b))
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(test)]
mod tests;
