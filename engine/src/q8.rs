//! Q8_0 weights times f32 activations on x86 with AVX2, FMA and F16C. Each activation row
//! is quantized to Q8_0 blocks (as candle does); each output is the sum over blocks, in
//! block order, of the block's exact integer dot product times the product of the two
//! scales, added with one fused multiply-add, as llama.cpp sums Q8_0. candle instead
//! converts and adds each run of four products apart, in eight lanes, then adds the lanes
//! in a tree: its values and these differ in the last bits, and the llama.cpp agreement
//! test (engine/tests) holds the tokens. The group kernels (AVX2, VNNI) and the loose-row
//! kernel give the same bits, and a row's outputs do not depend on the rows beside it.
//!
//! Weight rows are stored in groups of eight, interleaved, so that the same four bytes of
//! eight rows sit in one register: one integer multiply serves eight rows, whose sums
//! build up in the lanes of one register with no horizontal reduction, and a group's
//! weights serve a tile of four activation rows (eight with VNNI). AVX2 multiplies the
//! weights' magnitudes by the activations given the weights' signs, one more operation per
//! row; VNNI multiplies the weights plus 128, one operation per tile, and takes 128 times
//! the activations' block sum off after. candle makes one dot product per output,
//! with two scalar f16 conversions per block; that made its Q8_0 head a fifth of a
//! batch-16 decode step. The model only uses this kernel where candle would take its AVX2
//! path ([`Q80Matrix::supported`]).

use bytes::Bytes;
use half::f16;

use crate::act_quant::{quantize_blocks, QK};
use crate::ahead::BlockRuns;
use crate::error::{EngineError, Result};
use crate::split::{self, GROUP};

/// Bytes of one Q8_0 block: `d` (f16), then 32 signed bytes.
const Q80_BYTES: usize = 34;

/// Bytes of one Q5_0 block: `d` (f16), the 32 values' fifth bits, then their low four bits
/// in 16 bytes (value `j` in the low half of byte `j`, value `j + 16` in its high half).
pub(crate) const Q50_BYTES: usize = 22;

/// Q5_0 blocks as Q8_0 blocks of the same values: a Q5_0 value is `d * (q - 16)` with `q`
/// of five bits, so `q - 16` is the Q8_0 byte and `d` the same scale, exactly. The
/// products are then llama.cpp's own for Q5_0, which also multiplies by Q8_0 activations
/// and sums each block's integers before its scales. A Q5_0 matrix takes 34 bytes a block
/// here against the file's 22: the price of a kernel of its own not yet written, against
/// candle's Q5_0 product, which has no vector code (a 0.5B Qwen2.5 in Q4_K_M, mostly Q5_0,
/// prefilled 14 tokens/s on it).
pub(crate) fn q5_0_as_q8_0(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() / Q50_BYTES * Q80_BYTES);
    for blk in bytes.chunks_exact(Q50_BYTES) {
        let high = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let low = &blk[6..];
        out.extend_from_slice(&blk[..2]);
        let value = |j: usize, nibble: u8| {
            let q = nibble | ((high >> j) as u8 & 1) << 4;
            (q as i8 - 16) as u8
        };
        out.extend((0..16).map(|j| value(j, low[j] & 0x0F)));
        out.extend((0..16).map(|j| value(j + 16, low[j] >> 4)));
    }
    out
}

/// A group of eight weight rows (scales, interleaved bytes) against activation rows:
/// `emit(y, outputs)` gets row `y`'s eight outputs.
type GroupKernel = unsafe fn(&[f16], &[i8], &[Q80Row], &mut dyn FnMut(usize, [f32; GROUP]));

/// Activation rows that share one load of a group's weights: eight where VNNI's
/// registers (AVX-512 VL has 32) hold eight rows' sums beside the weights.
const TILE: usize = 4;
const VNNI_TILE: usize = 8;

/// A `[rows, cols]` Q8_0 matrix. The first `rows / 8 * 8` rows are in groups of eight: for
/// each block, the eight rows' f16 scales (`d[(g * nb + b) * 8 + i]`), then eight runs of 32
/// bytes, run `k` holding bytes `4k .. 4k + 4` of each row's block in row order. The rows
/// after them are stored one after another. Both parts sit at the offsets the plain layout
/// would give them. All the scales come first in its bytes, then all the values: its own
/// bytes, or a region of a mapped pack file ([`crate::pack`]).
#[derive(Debug)]
pub struct Q80Matrix {
    rows: usize,
    cols: usize,
    data: Bytes,
}

/// One activation row as Q8_0 blocks, the scales widened to f32, with 128 times each
/// block's sum of values (the VNNI kernel's offset: see `tile_outputs`).
struct Q80Row {
    d: Vec<f32>,
    qs: Vec<i8>,
    offsets: Vec<i32>,
}

impl Q80Row {
    /// candle's `BlockQ8_0::from_float` on x86, value for value.
    fn quantize(xs: &[f32]) -> Self {
        let blocks = xs.len() / QK;
        let mut row = Q80Row {
            d: vec![0.0; blocks],
            qs: vec![0; xs.len()],
            offsets: vec![0; blocks],
        };
        quantize_blocks(xs, &mut row.qs, &mut row.d, &mut row.offsets);
        for (d, offset) in row.d.iter_mut().zip(&mut row.offsets) {
            *d = f16::from_f32(*d).to_f32();
            *offset *= 128;
        }
        row
    }
}

impl Q80Matrix {
    /// Whether this CPU runs the kernel, and candle would take its AVX2 path for Q8_0 too
    /// (candle checks AVX2 and FMA; the kernel also widens scales with F16C).
    pub fn supported() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Takes GGML Q8_0 data of a `[rows, cols]` tensor.
    pub fn from_ggml(bytes: &[u8], rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(QK) || bytes.len() != rows * cols / QK * Q80_BYTES {
            return Err(EngineError::InvalidInput(format!(
                "Q8_0 data of {} bytes does not make a [{rows}, {cols}] matrix",
                bytes.len()
            )));
        }
        let nb = cols / QK;
        let grouped = rows / GROUP * GROUP;
        // Scales, then values: `rows * cols` values, a multiple of 32, take a whole number
        // of f16s.
        let mut buf = vec![f16::ZERO; rows * nb + rows * cols / 2];
        let (d, qs) = buf.split_at_mut(rows * nb);
        let qs: &mut [u8] = bytemuck::cast_slice_mut(qs);
        for (i, blk) in bytes.chunks_exact(Q80_BYTES).enumerate() {
            let r = i / nb;
            let at = if r < grouped {
                let (g, lane, b) = (r / GROUP, r % GROUP, i % nb);
                (g * nb + b) * GROUP + lane
            } else {
                i
            };
            d[at] = f16::from_le_bytes([blk[0], blk[1]]);
            let vals = &blk[2..];
            if r < grouped {
                let lane = at % GROUP;
                let base = at / GROUP * GROUP * QK;
                for (j, &v) in vals.iter().enumerate() {
                    qs[base + j / 4 * 4 * GROUP + lane * 4 + j % 4] = v;
                }
            } else {
                qs[i * QK..(i + 1) * QK].copy_from_slice(vals);
            }
        }
        Ok(Self {
            rows,
            cols,
            data: crate::pack::aligned_bytes(buf),
        })
    }

    /// A `[rows, cols]` matrix whose bytes are `data`, as [`Q80Matrix::data`] gave them:
    /// refused unless `data` is exactly that many bytes, its scales aligned.
    pub(crate) fn from_packed(rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        let m = Self { rows, cols, data };
        let whole = cols > 0 && cols.is_multiple_of(QK);
        let len = rows.checked_mul(cols / QK * (QK + 2));
        if !whole
            || len != Some(m.data.len())
            || bytemuck::try_cast_slice::<u8, f16>(m.scale_bytes()).is_err()
        {
            return Err(EngineError::InvalidInput(format!(
                "a packed Q8_0 matrix of {} bytes for [{rows}, {cols}]",
                m.data.len()
            )));
        }
        Ok(m)
    }

    /// Its bytes, as [`Q80Matrix::from_packed`] takes them.
    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    fn scale_bytes(&self) -> &[u8] {
        &self.data[..2 * self.rows * (self.cols / QK)]
    }

    /// Every block's scale, in the layout's order.
    fn d(&self) -> &[f16] {
        bytemuck::cast_slice(self.scale_bytes())
    }

    /// Every block's values, in the layout's order.
    fn qs(&self) -> &[i8] {
        bytemuck::cast_slice(&self.data[2 * self.rows * (self.cols / QK)..])
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

    /// Group `g`'s scales and values.
    fn group(&self, g: usize) -> (&[f16], &[i8]) {
        let nb = self.cols / QK;
        let span = g * nb * GROUP..(g + 1) * nb * GROUP;
        (
            &self.d()[span.clone()],
            &self.qs()[span.start * QK..span.end * QK],
        )
    }

    /// Groups `g` and `g + 1` to be asked for a block at a time while the pair before them
    /// computes; `g` twice where it is the last group, none past the last.
    fn next_pair(&self, g: usize) -> Option<NextPair<'_>> {
        let groups = self.rows / GROUP;
        (g < groups).then(|| NextPair([self.group(g), self.group((g + 1).min(groups - 1))]))
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert!(
            Self::supported(),
            "Q80Matrix built on a CPU it cannot run on"
        );
        let q: Vec<Q80Row> = x.chunks_exact(self.cols).map(Q80Row::quantize).collect();
        let q = q.as_slice();
        let nb = self.cols / QK;
        let (d, qs) = (self.d(), self.qs());
        let group = avx2::group_kernel();
        let pair = avx2::pair_kernel().filter(|_| n >= split::PAIRED_FROM_ROWS);
        let pair = pair.map(|pair| {
            move |g: usize, out: &split::Columns<'_>| {
                let ((d0, q0), (d1, q1)) = (self.group(g), self.group(g + 1));
                let next = self.next_pair(g + 2);
                // SAFETY: `pair_kernel` found AVX-512 F, BW, VL and VNNI beside AVX2, FMA and
                // F16C; both groups have a block for each of the rows' blocks.
                unsafe { pair([d0, d1], [q0, q1], q, next, out) };
            }
        });
        split::by_groups(
            self.rows,
            n,
            pair,
            |g, out| {
                let (d, qs) = self.group(g);
                // SAFETY: `group_kernel` picked a kernel this CPU runs (AVX2, FMA and F16C
                // asserted above); the group has a block for each of the rows' blocks.
                unsafe { group(d, qs, q, &mut |y, vals| out.put_lanes(y, &vals)) };
            },
            |r, out| {
                let (d, qs) = (
                    &d[r * nb..(r + 1) * nb],
                    &qs[r * self.cols..(r + 1) * self.cols],
                );
                for (y, row) in q.iter().enumerate() {
                    // SAFETY: as above.
                    out.put(y, &[unsafe { avx2::dot_one(d, qs, row) }]);
                }
            },
        )
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Never called: `supported` is false off x86-64.
#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    use half::f16;

    use super::{GroupKernel, Q80Row};

    pub(super) fn group_kernel() -> GroupKernel {
        unreachable!("the Q8_0 kernel needs x86-64")
    }

    /// # Safety
    /// Never called; it panics.
    pub(super) unsafe fn dot_one(_: &[f16], _: &[i8], _: &Q80Row) -> f32 {
        unreachable!("the Q8_0 kernel needs x86-64")
    }
}

/// The pair of groups after a pair kernel's, whose scales and values it asks the memory
/// for a block at a time while it computes, as Q4_1's pair kernel does (`crate::q4`).
#[derive(Clone, Copy)]
struct NextPair<'a>([(&'a [f16], &'a [i8]); 2]);

impl BlockRuns for NextPair<'_> {
    /// Each group's block `b`: its scales and values.
    #[inline(always)]
    fn each_run(&self, b: usize, mut f: impl FnMut(*const u8, usize)) {
        for (d, qs) in &self.0 {
            f(d.as_ptr().wrapping_add(b * GROUP).cast(), 2 * GROUP);
            f(qs.as_ptr().wrapping_add(b * GROUP * QK).cast(), GROUP * QK);
        }
    }
}

#[cfg(test)]
mod tests;
