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

use crate::act_quant::{quantize_block, QK};
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

/// A matrix's bytes built at load, held as f16 so that its scales are aligned.
struct Scales16(Vec<f16>);

impl AsRef<[u8]> for Scales16 {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
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
        let mut row = Q80Row {
            d: Vec::with_capacity(xs.len() / QK),
            qs: vec![0; xs.len()],
            offsets: Vec::with_capacity(xs.len() / QK),
        };
        for (block, qs) in xs.chunks_exact(QK).zip(row.qs.chunks_exact_mut(QK)) {
            let (d, sum) = quantize_block(block, qs);
            row.d.push(f16::from_f32(d).to_f32());
            row.offsets.push(128 * sum);
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
            data: Bytes::from_owner(Scales16(buf)),
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

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert!(
            Self::supported(),
            "Q80Matrix built on a CPU it cannot run on"
        );
        let q: Vec<Q80Row> = x.chunks_exact(self.cols).map(Q80Row::quantize).collect();
        let nb = self.cols / QK;
        let (d, qs) = (self.d(), self.qs());
        let group_at = |g: usize| {
            let span = g * nb * GROUP..(g + 1) * nb * GROUP;
            (&d[span.clone()], &qs[span.start * QK..span.end * QK])
        };
        let group = avx2::group_kernel();
        // One row reads the weights once, at the memory's speed, and went 10-15% slower
        // on 512-bit registers (the 0.5B's batch-1 decode, and `product-bench`).
        let pair = avx2::pair_kernel().filter(|_| n >= TILE);
        split::by_runs_of_groups(
            self.rows,
            n,
            if pair.is_some() { 2 } else { 1 },
            |g, out| match pair {
                Some(pair) if out.width() == 2 * GROUP => {
                    let ((d0, q0), (d1, q1)) = (group_at(g), group_at(g + 1));
                    // SAFETY: `pair_kernel` found AVX-512 F, BW, VL and VNNI beside AVX2,
                    // FMA and F16C; both groups have a block for each of the rows' blocks.
                    unsafe { pair([d0, d1], [q0, q1], &q, &mut |y, vals| out.put(y, &vals)) };
                }
                _ => {
                    let (d, qs) = group_at(g);
                    // SAFETY: `group_kernel` picked a kernel this CPU runs (AVX2, FMA and
                    // F16C asserted above); the group has a block for each of the rows'
                    // blocks.
                    unsafe { group(d, qs, &q, &mut |y, vals| out.put(y, &vals)) };
                }
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
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{GroupKernel, Q80Row, GROUP, QK, TILE, VNNI_TILE};
    use crate::act_quant::has_vnni;

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

    /// Two groups against activation rows, on 512-bit registers: `emit(y, outputs)` gets
    /// row `y`'s sixteen outputs, the first group's eight and then the second's.
    pub(super) type PairKernel =
        unsafe fn([&[f16]; 2], [&[i8]; 2], &[Q80Row], &mut dyn FnMut(usize, [f32; 2 * GROUP]));

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
        emit: &mut dyn FnMut(usize, [f32; 2 * GROUP]),
    ) {
        let mut y = pair_tiles::<VNNI_TILE>(d, qs, rows, 0, emit);
        y = pair_tiles::<TILE>(d, qs, rows, y, emit);
        pair_tiles::<1>(d, qs, rows, y, emit);
    }

    /// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the
    /// row after them.
    ///
    /// # Safety
    /// As for [`dot_pair_512`].
    #[inline(always)]
    unsafe fn pair_tiles<const T: usize>(
        d: [&[f16]; 2],
        qs: [&[i8]; 2],
        rows: &[Q80Row],
        mut y: usize,
        emit: &mut dyn FnMut(usize, [f32; 2 * GROUP]),
    ) -> usize {
        while y + T <= rows.len() {
            for (i, out) in pair_outputs::<T>(d, qs, &rows[y..y + T])
                .into_iter()
                .enumerate()
            {
                emit(y + i, out);
            }
            y += T;
        }
        y
    }

    /// `T` activation rows against two groups: [`tile_outputs`] with VNNI, sixteen lanes
    /// wide.
    ///
    /// # Safety
    /// As for [`dot_pair_512`]; `rows` has `T` rows.
    #[inline(always)]
    unsafe fn pair_outputs<const T: usize>(
        d: [&[f16]; 2],
        qs: [&[i8]; 2],
        rows: &[Q80Row],
    ) -> [[f32; 2 * GROUP]; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        let lift = _mm512_set1_epi8(i8::MIN);
        for b in 0..rows[0].d.len() {
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
        acc.map(|a| {
            let mut out = [0f32; 2 * GROUP];
            _mm512_storeu_ps(out.as_mut_ptr(), a);
            out
        })
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
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act_quant::testing::{candle_product, data};
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Tensor};

    #[test]
    fn within_rounding_of_candle_and_the_same_bits_on_every_path_and_batch() {
        if !Q80Matrix::supported() {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C, so the kernel is never used");
            return;
        }
        // 11 blocks a row; five groups of eight rows (where 512-bit registers take two
        // groups at once, two pairs and one alone) and three loose rows.
        let (rows, cols) = (43, 352);
        let nb = cols / QK;
        let w = Tensor::from_vec(data(rows * cols, 1), (rows, cols), &Device::Cpu).unwrap();
        let mut bytes = QTensor::quantize(&w, GgmlDType::Q8_0)
            .unwrap()
            .data()
            .unwrap()
            .to_vec();
        // GGML never writes -128, but a file may hold it: |−128| wraps in candle's sign
        // trick, and the kernel must wrap the same way. Row 0 (grouped) and row 33 (loose).
        for blk in [0, 33 * cols / QK] {
            bytes[blk * Q80_BYTES + 2] = 0x80;
            bytes[blk * Q80_BYTES + 9] = 0x80;
        }
        let ours = Q80Matrix::from_ggml(&bytes, rows, cols).unwrap();
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
            GgmlDType::Q8_0,
            &bytes,
            vec![rows, cols],
            &Device::Cpu,
        )
        .unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        // Each weight row alone: a matrix of one row, which takes the loose-row kernel.
        let row_bytes = nb * Q80_BYTES;
        let alone: Vec<Q80Matrix> = bytes
            .chunks_exact(row_bytes)
            .map(|b| Q80Matrix::from_ggml(b, 1, cols).unwrap())
            .collect();
        let mut kernels: Vec<(&str, GroupKernel)> = vec![("AVX2", avx2::dot_group)];
        if crate::act_quant::has_vnni() {
            kernels.push(("VNNI", avx2::dot_group_vnni));
        }
        for n in [1, 2, 3, 4, 5, 8, 16, 17, 33] {
            let x = data(n * cols, 7 + n as u32);
            let want = candle_product(&reference, &x, n, cols);
            let got = ours.matmul(&x, n);
            let q: Vec<Q80Row> = x.chunks_exact(cols).map(Q80Row::quantize).collect();
            let mut differ = 0;
            for (y, (xs, row)) in x.chunks_exact(cols).zip(&q).enumerate() {
                // A row's outputs do not depend on the rows beside it.
                assert_eq!(
                    ours.matmul(xs, 1)[..],
                    got[y * rows..][..rows],
                    "row {y} of {n}"
                );
                for (r, w) in alone.iter().enumerate() {
                    let g = got[y * rows + r];
                    assert_eq!(w.matmul(xs, 1), [g], "weight row {r} alone");
                    // The terms' size: the largest error a few roundings per block make.
                    let size: f32 = (0..nb)
                        .map(|b| {
                            let dot: i32 = (0..QK)
                                .map(|j| {
                                    (w.qs()[b * QK + j] as i32 * row.qs[b * QK + j] as i32).abs()
                                })
                                .sum();
                            dot as f32 * (w.d()[b].to_f32() * row.d[b]).abs()
                        })
                        .sum();
                    let c = want[y * rows + r];
                    assert!(
                        (g - c).abs() <= size * 1e-5,
                        "row {y}, output {r}: {g} against candle's {c}"
                    );
                    differ += usize::from(g != c);
                }
            }
            assert!(
                differ > 0,
                "no value differs from candle's: is this the new sum?"
            );
            // Every group kernel this CPU runs, not only the one `matmul` picks.
            for (name, kernel) in &kernels {
                for g in 0..rows / GROUP {
                    let span = g * nb * GROUP..(g + 1) * nb * GROUP;
                    let (d, qs) = (
                        &ours.d()[span.clone()],
                        &ours.qs()[span.start * QK..span.end * QK],
                    );
                    let mut check = |y: usize, vals: [f32; GROUP]| {
                        assert_eq!(
                            vals[..],
                            got[y * rows + g * GROUP..][..GROUP],
                            "{name}, {n} rows"
                        );
                    };
                    // SAFETY: `supported` (checked above) and `has_vnni` for VNNI.
                    unsafe { kernel(d, qs, &q, &mut check) };
                }
            }
        }
    }

    /// Every Q5_0 value, converted, is the value candle dequantizes from the file's block.
    #[test]
    fn q5_0_blocks_become_q8_0_blocks_of_the_same_values() {
        let (rows, cols) = (9, 96);
        let w = Tensor::from_vec(data(rows * cols, 3), (rows, cols), &Device::Cpu).unwrap();
        let q5 = QTensor::quantize(&w, GgmlDType::Q5_0).unwrap();
        let mut bytes = q5.data().unwrap().to_vec();
        // Both extremes of five bits, in each half of a block.
        for (j, nibble) in [(6, 0x0F), (7, 0xF0), (8, 0x00)] {
            bytes[j] = nibble;
        }
        bytes[2..6].copy_from_slice(&[0xFF, 0x00, 0x01, 0x80]);
        let as_q8 = q5_0_as_q8_0(&bytes);
        let load = |dtype, b: &[u8]| {
            candle_core::quantized::ggml_file::qtensor_from_ggml(
                dtype,
                b,
                vec![rows, cols],
                &Device::Cpu,
            )
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
        };
        assert_eq!(load(GgmlDType::Q8_0, &as_q8), load(GgmlDType::Q5_0, &bytes));
    }

    #[test]
    fn refuses_data_of_the_wrong_size() {
        assert!(Q80Matrix::from_ggml(&[0; 33], 1, 32).is_err());
        assert!(Q80Matrix::from_ggml(&[0; 34], 1, 31).is_err());
    }

    #[test]
    fn a_packed_matrix_is_taken_only_for_its_own_bytes_with_its_scales_aligned() {
        let (rows, cols) = (11, 64);
        let w = Tensor::from_vec(data(rows * cols, 9), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let m = Q80Matrix::from_ggml(&q.data().unwrap(), rows, cols).unwrap();
        let x = data(3 * cols, 4);
        let again = Q80Matrix::from_packed(rows, cols, m.data.clone()).unwrap();
        assert_eq!(again.matmul(&x, 3), m.matmul(&x, 3));
        assert!(Q80Matrix::from_packed(rows + 1, cols, m.data.clone()).is_err());
        assert!(Q80Matrix::from_packed(rows, cols - 32, m.data.clone()).is_err());
        assert!(Q80Matrix::from_packed(0, 0, Bytes::new()).is_err());
        // The same bytes one byte into an aligned buffer: scales that cannot be read as
        // f16 in place.
        let len = m.data().len();
        let mut buf = vec![f16::ZERO; len / 2 + 1];
        bytemuck::cast_slice_mut::<f16, u8>(&mut buf)[1..=len].copy_from_slice(m.data());
        let shifted = Bytes::from_owner(Scales16(buf)).slice(1..=len);
        assert!(Q80Matrix::from_packed(rows, cols, shifted).is_err());
    }
}
