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

use half::f16;

#[cfg(target_arch = "x86_64")]
use crate::act_quant::has_vnni;
use crate::act_quant::{quantize_block, QK};
use crate::error::{EngineError, Result};
use crate::split::{self, GROUP};

/// Bytes of one Q4_1 block: `d` (f16), `m` (f16), 16 bytes of nibbles.
const Q41_BYTES: usize = 20;
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
#[derive(Debug)]
pub struct Q41Matrix {
    rows: usize,
    cols: usize,
    d: Vec<f32>,
    m: Vec<f32>,
    qs: Vec<u8>,
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

/// One activation row as Q8_1 blocks, with the scales already widened to f32.
struct Q81Row {
    d: Vec<f32>,
    s: Vec<f32>,
    qs: Vec<i8>,
}

impl Q81Row {
    /// candle's `BlockQ8_1::from_float`, value for value.
    fn quantize(xs: &[f32]) -> Self {
        let n = xs.len() / QK;
        let mut row = Q81Row {
            d: Vec::with_capacity(n),
            s: Vec::with_capacity(n),
            qs: vec![0; xs.len()],
        };
        for (block, qs) in xs.chunks_exact(QK).zip(row.qs.chunks_exact_mut(QK)) {
            let (d, sum) = quantize_block(block, qs);
            let d16 = f16::from_f32(d);
            row.d.push(d16.to_f32());
            row.s.push((f16::from_f32(sum as f32) * d16).to_f32());
        }
        row
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
        let mut d = vec![0f32; n];
        let mut m = vec![0f32; n];
        let mut qs = vec![0u8; n * QK / 2];
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
            d,
            m,
            qs,
        }
    }

    /// Bytes of weight data read per product.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 4 * (self.d.len() + self.m.len())
    }

    fn blocks(&self) -> usize {
        self.cols / QK
    }

    fn group(&self, g: usize) -> WGroup<'_> {
        let n = self.blocks() * GROUP;
        WGroup {
            d: &self.d[g * n..(g + 1) * n],
            m: &self.m[g * n..(g + 1) * n],
            qs: &self.qs[g * n * QK / 2..(g + 1) * n * QK / 2],
        }
    }

    /// A row after the groups.
    fn loose_row(&self, r: usize) -> WRow<'_> {
        let nb = self.blocks();
        WRow {
            d: &self.d[r * nb..(r + 1) * nb],
            m: &self.m[r * nb..(r + 1) * nb],
            qs: &self.qs[r * nb * QK / 2..(r + 1) * nb * QK / 2],
        }
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let q: Vec<Q81Row> = x.chunks_exact(self.cols).map(Q81Row::quantize).collect();
        // From a tile's rows up: one row reads the weights at the memory's speed, where
        // 512-bit registers bought nothing for Q8_0.
        let pair = pair_kernel().filter(|_| n >= TILE);
        split::by_runs_of_groups(
            self.rows,
            n,
            if pair.is_some() { 2 } else { 1 },
            |g, out| match pair {
                Some(pair) if out.width() == 2 * GROUP => {
                    let groups = [self.group(g), self.group(g + 1)];
                    // SAFETY: `pair_kernel` found AVX2, FMA and 512-bit VNNI; both groups
                    // have as many blocks as the rows.
                    unsafe { pair(groups, &q, &mut |y, vals| out.put(y, &vals)) };
                }
                _ => dot_group(self.group(g), &q, |y, vals| out.put(y, &vals)),
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

/// Two groups against activation rows: `emit(y, outputs)` gets row `y`'s sixteen outputs,
/// the first group's eight and then the second's.
type PairKernel = unsafe fn([WGroup<'_>; 2], &[Q81Row], &mut dyn FnMut(usize, [f32; 2 * GROUP]));

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
mod avx2 {
    use std::arch::x86_64::*;

    use super::{add_block, block_sumi, Q81Row, WGroup, WRow, GROUP, PAIR_TILE, QK, TILE};

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
    /// operations lane for lane, so the same bits.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; both groups have as many
    /// blocks as every row of `rows`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot_pair_512(
        w: [WGroup<'_>; 2],
        rows: &[Q81Row],
        emit: &mut dyn FnMut(usize, [f32; 2 * GROUP]),
    ) {
        let mut y = pair_tiles::<PAIR_TILE>(w, rows, 0, emit);
        y = pair_tiles::<TILE>(w, rows, y, emit);
        pair_tiles::<1>(w, rows, y, emit);
    }

    /// The rows from `y` in tiles of `T`, as many as there are whole tiles: returns the
    /// row after them.
    ///
    /// # Safety
    /// As for [`dot_pair_512`].
    #[inline(always)]
    unsafe fn pair_tiles<const T: usize>(
        w: [WGroup<'_>; 2],
        rows: &[Q81Row],
        mut y: usize,
        emit: &mut dyn FnMut(usize, [f32; 2 * GROUP]),
    ) -> usize {
        while y + T <= rows.len() {
            for (i, acc) in pair_tile::<T>(w, &rows[y..y + T]).into_iter().enumerate() {
                let mut out = [0f32; 2 * GROUP];
                _mm512_storeu_ps(out.as_mut_ptr(), acc);
                emit(y + i, out);
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

    /// [`dot_tile`] with VNNI, sixteen lanes wide.
    ///
    /// # Safety
    /// As for [`dot_pair_512`]; `rows` has `T` rows.
    #[inline(always)]
    unsafe fn pair_tile<const T: usize>(w: [WGroup<'_>; 2], rows: &[Q81Row]) -> [__m512; T] {
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..w[0].d.len() / GROUP {
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
            let wd = floats(&|g| w[g].d.as_ptr().add(b * GROUP));
            let wm = floats(&|g| w[g].m.as_ptr().add(b * GROUP));
            for (y, acc) in rows.iter().zip(acc.iter_mut()) {
                let ys = y.qs.as_ptr().add(b * QK);
                let act = |j: usize| {
                    let off = if j < 4 { 4 * j } else { 16 + 4 * (j - 4) };
                    _mm512_set1_epi32((ys.add(off) as *const i32).read_unaligned())
                };
                // As `dot_tile`'s two chains: exact either way.
                let (mut a, mut c) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for j in (0..8).step_by(2) {
                    a = _mm512_dpbusd_epi32(a, wv[j], act(j));
                    c = _mm512_dpbusd_epi32(c, wv[j + 1], act(j + 1));
                }
                let sumi = _mm512_cvtepi32_ps(_mm512_add_epi32(a, c));
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
}

#[cfg(test)]
mod tests;
