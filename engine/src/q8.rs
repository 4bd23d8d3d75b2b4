//! Q8_0 weights times f32 activations on x86 with AVX2, FMA and F16C, giving exactly the
//! values candle's AVX2 path gives, so the tokens do not change. candle quantizes each
//! activation row to Q8_0 blocks; for each (weight row, activation row) it keeps eight f32
//! lanes, lane `k` adding, block by block with one fused multiply-add, the two blocks'
//! scales times the integer sum of bytes `4k .. 4k + 4`; then it adds the eight lanes in a
//! fixed tree. Here weight rows are stored in groups of eight, interleaved, so that the
//! same lane `k` of eight rows sits in one register: one multiply-add serves eight rows,
//! and the tree is eight vector adds per group instead of a horizontal sum per output.
//! candle makes one dot product per output, with two scalar f16 conversions per block;
//! that made its Q8_0 head a fifth of a batch-16 decode step. The model only uses this
//! kernel where candle would take its AVX2 path ([`Q80Matrix::supported`]).

use half::f16;

use crate::act_quant::{quantize_block, QK};
use crate::error::{EngineError, Result};
use crate::split::{self, GROUP};

/// Bytes of one Q8_0 block: `d` (f16), then 32 signed bytes.
const Q80_BYTES: usize = 34;

/// A group of eight weight rows (scales, interleaved bytes) against one activation row.
type GroupKernel = unsafe fn(&[f16], &[i8], &Q80Row) -> [f32; GROUP];

/// A `[rows, cols]` Q8_0 matrix. The first `rows / 8 * 8` rows are in groups of eight: for
/// each block, the eight rows' f16 scales (`d[(g * nb + b) * 8 + i]`), then eight runs of 32
/// bytes, run `k` holding bytes `4k .. 4k + 4` of each row's block in row order. The rows
/// after them are stored one after another. Both parts sit at the offsets the plain layout
/// would give them.
#[derive(Debug)]
pub struct Q80Matrix {
    rows: usize,
    cols: usize,
    d: Vec<f16>,
    qs: Vec<i8>,
}

/// One activation row as Q8_0 blocks, the scales widened to f32.
struct Q80Row {
    d: Vec<f32>,
    qs: Vec<i8>,
}

impl Q80Row {
    /// candle's `BlockQ8_0::from_float` on x86, value for value.
    fn quantize(xs: &[f32]) -> Self {
        let mut row = Q80Row {
            d: Vec::with_capacity(xs.len() / QK),
            qs: vec![0; xs.len()],
        };
        for (block, qs) in xs.chunks_exact(QK).zip(row.qs.chunks_exact_mut(QK)) {
            let (d, _) = quantize_block(block, qs);
            row.d.push(f16::from_f32(d).to_f32());
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
        let mut d = vec![f16::ZERO; rows * nb];
        let mut qs = vec![0i8; rows * cols];
        for (i, blk) in bytes.chunks_exact(Q80_BYTES).enumerate() {
            let r = i / nb;
            let at = if r < grouped {
                let (g, lane, b) = (r / GROUP, r % GROUP, i % nb);
                (g * nb + b) * GROUP + lane
            } else {
                i
            };
            d[at] = f16::from_le_bytes([blk[0], blk[1]]);
            let vals = blk[2..].iter().map(|&v| v as i8);
            if r < grouped {
                let lane = at % GROUP;
                let base = at / GROUP * GROUP * QK;
                for (j, v) in vals.enumerate() {
                    qs[base + j / 4 * 4 * GROUP + lane * 4 + j % 4] = v;
                }
            } else {
                for (q, v) in qs[i * QK..(i + 1) * QK].iter_mut().zip(vals) {
                    *q = v;
                }
            }
        }
        Ok(Self { rows, cols, d, qs })
    }

    /// Bytes of weight data read per product.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * self.d.len()
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert!(
            Self::supported(),
            "Q80Matrix built on a CPU it cannot run on"
        );
        let q: Vec<Q80Row> = x.chunks_exact(self.cols).map(Q80Row::quantize).collect();
        let nb = self.cols / QK;
        let group = avx2::group_kernel();
        split::by_groups(
            self.rows,
            n,
            |g, out| {
                let span = g * nb * GROUP..(g + 1) * nb * GROUP;
                let (d, qs) = (
                    &self.d[span.clone()],
                    &self.qs[span.start * QK..span.end * QK],
                );
                for (y, row) in q.iter().enumerate() {
                    // SAFETY: `group_kernel` picked a kernel this CPU runs (AVX2, FMA and
                    // F16C asserted above).
                    out.put(y, &unsafe { group(d, qs, row) });
                }
            },
            |r, out| {
                let d = &self.d[r * nb..(r + 1) * nb];
                let qs = &self.qs[r * self.cols..(r + 1) * self.cols];
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

    use super::{GroupKernel, Q80Row, GROUP, QK};
    use crate::act_quant::has_vnni;

    /// The integer sums of bytes `4k .. 4k + 4` of `w` times `y`, as candle's
    /// `mul_sum_i8_pairs_float` computes them: |w| times y with w's sign. With VNNI the four
    /// products go into i32 in one instruction; the integers are exact both ways (at most
    /// 2 * 128 * 127 in a pair), so the sums are the same.
    ///
    /// # Safety
    /// The CPU has AVX2 (and AVX-512 VNNI with VL when `VNNI`).
    #[inline(always)]
    unsafe fn lane_sums<const VNNI: bool>(w: __m256i, y: __m256i) -> __m256 {
        let (abs, signed) = (_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
        let sums = if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), abs, signed)
        } else {
            _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(abs, signed))
        };
        _mm256_cvtepi32_ps(sums)
    }

    /// The fastest group kernel this CPU runs, given AVX2, FMA and F16C.
    pub(super) fn group_kernel() -> GroupKernel {
        if has_vnni() {
            dot_group_vnni
        } else {
            dot_group
        }
    }

    /// One group of eight interleaved weight rows against one activation row.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `d` holds `GROUP` scales and `qs` `GROUP * QK` bytes
    /// for each of `y`'s blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_group(d: &[f16], qs: &[i8], y: &Q80Row) -> [f32; GROUP] {
        group::<false>(d, qs, y)
    }

    /// [`dot_group`] with VNNI's four-way dot products.
    ///
    /// # Safety
    /// As for [`dot_group`], and the CPU has AVX-512 VNNI and VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub(super) unsafe fn dot_group_vnni(d: &[f16], qs: &[i8], y: &Q80Row) -> [f32; GROUP] {
        group::<true>(d, qs, y)
    }

    /// # Safety
    /// As for [`dot_group`] (and [`dot_group_vnni`] when `VNNI`).
    #[inline(always)]
    unsafe fn group<const VNNI: bool>(d: &[f16], qs: &[i8], y: &Q80Row) -> [f32; GROUP] {
        let mut acc = [_mm256_setzero_ps(); GROUP];
        for (b, &yd) in y.d.iter().enumerate() {
            let wd = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(b * GROUP) as *const _));
            let scale = _mm256_mul_ps(wd, _mm256_set1_ps(yd));
            let w = qs.as_ptr().add(b * GROUP * QK);
            let ys = y.qs.as_ptr().add(b * QK);
            for (k, acc) in acc.iter_mut().enumerate() {
                let wv = _mm256_loadu_si256(w.add(32 * k) as *const __m256i);
                let yv = _mm256_set1_epi32((ys.add(4 * k) as *const i32).read_unaligned());
                *acc = _mm256_fmadd_ps(scale, lane_sums::<VNNI>(wv, yv), *acc);
            }
        }
        // candle's `hsum_float_8`, for eight rows at once: (l0 + l4) + (l2 + l6), plus
        // (l1 + l5) + (l3 + l7).
        let r: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(acc[i + 4], acc[i]));
        let total = _mm256_add_ps(_mm256_add_ps(r[0], r[2]), _mm256_add_ps(r[1], r[3]));
        let mut out = [0f32; GROUP];
        _mm256_storeu_ps(out.as_mut_ptr(), total);
        out
    }

    /// One weight row in the plain layout against one activation row: candle's
    /// `vec_dot_q8_0_q8_0`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `qs` holds `QK` bytes for each of `d`'s scales, and
    /// `y` at least as many blocks as `d` has scales.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_one(d: &[f16], qs: &[i8], y: &Q80Row) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, (&wd, &yd)) in d.iter().zip(&y.d).enumerate() {
            let scale = _mm256_set1_ps(wd.to_f32() * yd);
            let wv = _mm256_loadu_si256(qs.as_ptr().add(b * QK) as *const __m256i);
            let yv = _mm256_loadu_si256(y.qs.as_ptr().add(b * QK) as *const __m256i);
            acc = _mm256_fmadd_ps(scale, lane_sums::<false>(wv, yv), acc);
        }
        let res = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
        let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
        _mm_cvtss_f32(_mm_add_ss(res, _mm_movehdup_ps(res)))
    }
}

/// Never called: `supported` is false off x86-64.
#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    use half::f16;

    use super::GroupKernel;

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
    fn equals_candles_q8_0_matmul_bit_for_bit() {
        if !Q80Matrix::supported() {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C, so the kernel is never used");
            return;
        }
        // 11 blocks a row; four groups of eight rows and three loose rows.
        let (rows, cols) = (35, 352);
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
        let nb = cols / QK;
        let mut kernels: Vec<(&str, GroupKernel)> = vec![("AVX2", avx2::dot_group)];
        if crate::act_quant::has_vnni() {
            kernels.push(("VNNI", avx2::dot_group_vnni));
        }
        for n in [1, 2, 3, 4, 5, 8, 16, 17, 33] {
            let x = data(n * cols, 7 + n as u32);
            let want = candle_product(&reference, &x, n, cols);
            assert_eq!(ours.matmul(&x, n), want, "{n} rows");
            // Every group kernel this CPU runs, not only the one `matmul` picks.
            for (name, kernel) in &kernels {
                for (y, row) in x.chunks_exact(cols).map(Q80Row::quantize).enumerate() {
                    for g in 0..rows / GROUP {
                        let span = g * nb * GROUP..(g + 1) * nb * GROUP;
                        let (d, qs) = (
                            &ours.d[span.clone()],
                            &ours.qs[span.start * QK..span.end * QK],
                        );
                        // SAFETY: `supported` (checked above) and `has_vnni` for VNNI.
                        let got = unsafe { kernel(d, qs, &row) };
                        assert_eq!(
                            got[..],
                            want[y * rows + g * GROUP..][..GROUP],
                            "{name}, {n} rows"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_data_of_the_wrong_size() {
        assert!(Q80Matrix::from_ggml(&[0; 33], 1, 32).is_err());
        assert!(Q80Matrix::from_ggml(&[0; 34], 1, 31).is_err());
    }
}
