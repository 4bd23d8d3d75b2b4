//! Q4_1 weights times f32 activations on the CPU, computed exactly as candle (and ggml)
//! define it, so the tokens do not change: each activation row is quantized to Q8_1 blocks,
//! each output is the sum over blocks, in block order, of the block's integer dot product
//! scaled by the two blocks' scales plus the weight block's minimum times the activation
//! block's sum. candle runs that with scalar code for Q4_1; here the integer dot products
//! use AVX2, eight blocks' sums are reduced together, the weights' f16 scales are widened
//! once at load, and output rows are split across candle's worker threads.

use half::f16;

use crate::error::{EngineError, Result};

/// Values per block, for Q4_1 and Q8_1 alike.
const QK: usize = 32;
/// Bytes of one Q4_1 block: `d` (f16), `m` (f16), 16 bytes of nibbles.
const Q41_BYTES: usize = 20;

/// A `[rows, cols]` Q4_1 matrix: each block's scale and minimum widened to f32 once at load
/// (a few more bytes per block read, no f16 conversion per block and row), and its nibbles.
#[derive(Debug)]
pub struct Q41Matrix {
    rows: usize,
    cols: usize,
    d: Vec<f32>,
    m: Vec<f32>,
    qs: Vec<u8>,
}

/// One weight row: its blocks' scales, minimums and nibbles.
#[derive(Clone, Copy)]
struct WRow<'a> {
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
        for (b, block) in xs.chunks_exact(QK).enumerate() {
            let amax = block.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let d = amax / ((1 << 7) - 1) as f32;
            let id = if d != 0f32 { 1. / d } else { 0. };
            let d16 = f16::from_f32(d);
            let mut sum = 0i32;
            let qs = &mut row.qs[b * QK..(b + 1) * QK];
            for (q, &x) in qs.iter_mut().zip(block) {
                *q = f32::round(x * id) as i8;
                sum += *q as i32;
            }
            row.d.push(d16.to_f32());
            row.s.push((f16::from_f32(sum as f32) * d16).to_f32());
        }
        row
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
        let n = bytes.len() / Q41_BYTES;
        let mut d = Vec::with_capacity(n);
        let mut m = Vec::with_capacity(n);
        let mut qs = Vec::with_capacity(n * QK / 2);
        for blk in bytes.chunks_exact(Q41_BYTES) {
            d.push(f16::from_le_bytes([blk[0], blk[1]]).to_f32());
            m.push(f16::from_le_bytes([blk[2], blk[3]]).to_f32());
            qs.extend_from_slice(&blk[4..]);
        }
        Ok(Self {
            rows,
            cols,
            d,
            m,
            qs,
        })
    }

    /// Bytes of weight data read per product.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 4 * (self.d.len() + self.m.len())
    }

    fn row(&self, r: usize) -> WRow<'_> {
        let nb = self.cols / QK;
        WRow {
            d: &self.d[r * nb..(r + 1) * nb],
            m: &self.m[r * nb..(r + 1) * nb],
            qs: &self.qs[r * nb * QK / 2..(r + 1) * nb * QK / 2],
        }
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let q: Vec<Q81Row> = x.chunks_exact(self.cols).map(Q81Row::quantize).collect();
        // Outputs row-major by weight row, `n` per row, split across candle's own worker
        // threads by weight rows (a second pool would fight candle's for the cores).
        let mut by_row = vec![0f32; self.rows * n];
        let out = SharedOut(by_row.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(self.rows, |range| {
            for r in range {
                // SAFETY: each weight row's `n` outputs are written by the one worker that
                // got that row, and `by_row` outlives the call.
                let o = unsafe { std::slice::from_raw_parts_mut(out.at(r * n), n) };
                dot_row(self.row(r), &q, o);
            }
        });
        let mut out = vec![0f32; n * self.rows];
        for (r, vals) in by_row.chunks_exact(n).enumerate() {
            for (b, &v) in vals.iter().enumerate() {
                out[b * self.rows + r] = v;
            }
        }
        out
    }
}

/// The output buffer, shared by workers that write disjoint parts of it.
struct SharedOut(*mut f32);

// SAFETY: workers write disjoint ranges (see `Q41Matrix::matmul`).
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer.
        unsafe { self.0.add(i) }
    }
}

/// One weight row against every activation row (it stays in L1 across them).
fn dot_row(w: WRow<'_>, rows: &[Q81Row], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present, checked just above.
            unsafe { avx2::dot_row(w, rows, out) };
            return;
        }
    }
    scalar_dot_row(w, rows, out);
}

/// One block's term, in candle's order of operations (no fused multiply-add).
#[inline(always)]
fn block_term(sumi: i32, w: WRow<'_>, y: &Q81Row, b: usize) -> f32 {
    sumi as f32 * w.d[b] * y.d[b] + w.m[b] * y.s[b]
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

fn scalar_dot_row(w: WRow<'_>, rows: &[Q81Row], out: &mut [f32]) {
    for (y, o) in rows.iter().zip(out.iter_mut()) {
        let mut sumf = 0f32;
        for b in 0..w.d.len() {
            sumf += block_term(block_sumi(w, y, b), w, y, b);
        }
        *o = sumf;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{block_sumi, block_term, Q81Row, WRow, QK};

    /// The i32 products of weight block `b` and activation block `b`, in eight lanes.
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
    #[inline(always)]
    unsafe fn sum4(p: [__m256i; 4]) -> __m128i {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot_row(w: WRow<'_>, rows: &[Q81Row], out: &mut [f32]) {
        let nb = w.d.len();
        for (y, o) in rows.iter().zip(out.iter_mut()) {
            let mut sumf = 0f32;
            let mut b = 0;
            // Eight blocks at a time: their integer sums in one vector, their terms computed
            // lane by lane with the scalar code's operations, then added to the running sum
            // one by one in block order, so the result is the scalar one.
            while b + 8 <= nb {
                let lo = sum4([
                    products(w, y, b),
                    products(w, y, b + 1),
                    products(w, y, b + 2),
                    products(w, y, b + 3),
                ]);
                let hi = sum4([
                    products(w, y, b + 4),
                    products(w, y, b + 5),
                    products(w, y, b + 6),
                    products(w, y, b + 7),
                ]);
                let sumi = _mm256_cvtepi32_ps(_mm256_set_m128i(hi, lo));
                let wd = _mm256_loadu_ps(w.d.as_ptr().add(b));
                let yd = _mm256_loadu_ps(y.d.as_ptr().add(b));
                let wm = _mm256_loadu_ps(w.m.as_ptr().add(b));
                let ys = _mm256_loadu_ps(y.s.as_ptr().add(b));
                let terms = _mm256_add_ps(
                    _mm256_mul_ps(_mm256_mul_ps(sumi, wd), yd),
                    _mm256_mul_ps(wm, ys),
                );
                let mut t = [0f32; 8];
                _mm256_storeu_ps(t.as_mut_ptr(), terms);
                for x in t {
                    sumf += x;
                }
                b += 8;
            }
            while b < nb {
                sumf += block_term(block_sumi(w, y, b), w, y, b);
                b += 1;
            }
            *o = sumf;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Module, Tensor};

    /// Weights and activations with a spread of magnitudes and signs.
    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32;
                (x - 1000.0) / 700.0 * if i % 7 == 0 { 3.0 } else { 1.0 }
            })
            .collect()
    }

    #[test]
    fn equals_candles_q4_1_matmul_bit_for_bit() {
        // 11 blocks a row: one group of eight and three single blocks.
        let (rows, cols) = (40, 352);
        let w = Tensor::from_vec(data(rows * cols, 1), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let ours = Q41Matrix::from_ggml(q.data().unwrap().to_vec(), rows, cols).unwrap();
        let reference = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
        for n in [1, 3, 4, 9] {
            let x = data(n * cols, 7 + n as u32);
            let xt = Tensor::from_vec(x.clone(), (n, cols), &Device::Cpu).unwrap();
            let want: Vec<f32> = reference
                .forward(&xt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got = ours.matmul(&x, n);
            assert_eq!(got, want, "{n} rows");
            let q: Vec<Q81Row> = x.chunks_exact(cols).map(Q81Row::quantize).collect();
            let mut scalar = vec![0f32; n];
            scalar_dot_row(ours.row(0), &q, &mut scalar);
            let first_col: Vec<f32> = (0..n).map(|b| got[b * rows]).collect();
            assert_eq!(scalar, first_col, "the scalar path agrees");
        }
    }

    #[test]
    fn refuses_data_of_the_wrong_size() {
        assert!(Q41Matrix::from_ggml(vec![0; 19], 1, 32).is_err());
        assert!(Q41Matrix::from_ggml(vec![0; 20], 1, 31).is_err());
    }
}
