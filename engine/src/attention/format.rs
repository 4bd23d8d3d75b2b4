//! How the kernels read the cache's rows: as bytes, each format's values widened to f32
//! exactly. An f16 widens exactly; a Q8_0 value `d * q` does too, its f16 scale's 11
//! significant bits times a byte's 8 fitting in f32's 24. So a row's products are the same
//! chains of fused multiply-adds whatever the cache holds, and every kernel gives the
//! scalar code's bits for either.

use std::ops::Range;

use half::f16;

use crate::kv_cache::{KvDtype, Q8_0_BYTES, Q8_0_VALUES};

/// A cache format, as a type: the kernels are compiled once for each, every branch on
/// [`Format::DTYPE`] decided then.
pub(super) trait Format: Send + Sync + 'static {
    const DTYPE: KvDtype;
}

/// Rows of little-endian f16 values.
pub(super) struct F16;
/// Rows of Q8_0 blocks.
pub(super) struct Q8;

impl Format for F16 {
    const DTYPE: KvDtype = KvDtype::F16;
}

impl Format for Q8 {
    const DTYPE: KvDtype = KvDtype::Q8_0;
}

/// Where in a Q8_0 row the block that holds value `d` starts.
const fn block_at(d: usize) -> usize {
    d / Q8_0_VALUES * Q8_0_BYTES
}

/// Bytes of one row of `head_dim` values.
pub(super) fn row_bytes<F: Format>(head_dim: usize) -> usize {
    F::DTYPE.row_bytes(head_dim)
}

/// The bytes of a row that hold its values `d0 .. d0 + n`.
pub(super) fn span<F: Format>(d0: usize, n: usize) -> Range<usize> {
    match F::DTYPE {
        KvDtype::F16 => 2 * d0..2 * (d0 + n),
        KvDtype::Q8_0 => block_at(d0)..(d0 + n).div_ceil(Q8_0_VALUES) * Q8_0_BYTES,
    }
}

/// Value `d` of `row`, widened exactly.
#[inline]
pub(super) fn value<F: Format>(row: &[u8], d: usize) -> f32 {
    let f16_at = |at: usize| f16::from_le_bytes([row[at], row[at + 1]]).to_f32();
    match F::DTYPE {
        KvDtype::F16 => f16_at(2 * d),
        KvDtype::Q8_0 => {
            let block = block_at(d);
            f16_at(block) * f32::from(row[block + 2 + d % Q8_0_VALUES] as i8)
        }
    }
}

/// The first `out.len()` values of `row`, widened exactly.
pub(super) fn widen<F: Format>(row: &[u8], out: &mut [f32]) {
    for (d, o) in out.iter_mut().enumerate() {
        *o = value::<F>(row, d);
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::*;

    /// A Q8_0 block's scale, widened, in every lane.
    ///
    /// # Safety
    /// The CPU has F16C; two bytes from `block` are readable.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn scale(block: *const u8) -> __m128 {
        let bits = block.cast::<u16>().read_unaligned();
        _mm_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// What [`load8`] multiplies values `d ..` of `row` by: their block's scale for Q8_0
    /// (`d` a multiple of 32, so that the eight values of each of the block's four loads
    /// share it), nothing for f16. One a block, not one a load: the scale's read and
    /// widening cost as much as the values'.
    ///
    /// # Safety
    /// AVX2 and F16C are present; `row` holds a row whose values reach `d + 8`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::attention) unsafe fn scale8<F: Format>(row: *const u8, d: usize) -> __m256 {
        match F::DTYPE {
            KvDtype::F16 => _mm256_setzero_ps(),
            KvDtype::Q8_0 => {
                let s = scale(row.add(block_at(d)));
                _mm256_set_m128(s, s)
            }
        }
    }

    /// Eight values of a row from value `d` (a multiple of 8), widened; `s` is
    /// [`scale8`] of the block that holds them.
    ///
    /// # Safety
    /// AVX2 and F16C are present; `row` holds a row whose values reach `d + 8`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::attention) unsafe fn load8<F: Format>(
        row: *const u8,
        d: usize,
        s: __m256,
    ) -> __m256 {
        match F::DTYPE {
            KvDtype::F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * d).cast())),
            KvDtype::Q8_0 => {
                let block = row.add(block_at(d));
                let q = _mm_loadl_epi64(block.add(2 + d % Q8_0_VALUES).cast());
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s)
            }
        }
    }

    /// [`scale8`] for [`load16`]: `d` a multiple of 32, the scale of both of the block's
    /// loads.
    ///
    /// # Safety
    /// AVX-512F and F16C are present; `row` holds a row whose values reach `d + 16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(in crate::attention) unsafe fn scale16<F: Format>(row: *const u8, d: usize) -> __m512 {
        match F::DTYPE {
            KvDtype::F16 => _mm512_setzero_ps(),
            KvDtype::Q8_0 => _mm512_broadcastss_ps(scale(row.add(block_at(d)))),
        }
    }

    /// Sixteen values of a row from value `d` (a multiple of 16), widened; `s` is
    /// [`scale16`] of the block that holds them.
    ///
    /// # Safety
    /// AVX-512F and F16C are present; `row` holds a row whose values reach `d + 16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(in crate::attention) unsafe fn load16<F: Format>(
        row: *const u8,
        d: usize,
        s: __m512,
    ) -> __m512 {
        match F::DTYPE {
            KvDtype::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * d).cast())),
            KvDtype::Q8_0 => {
                let block = row.add(block_at(d));
                let q = _mm_loadu_si128(block.add(2 + d % Q8_0_VALUES).cast());
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_the_blocks_that_hold_the_values() {
        assert_eq!(span::<F16>(8, 16), 16..48);
        assert_eq!(span::<Q8>(0, 32), 0..34);
        assert_eq!(span::<Q8>(32, 8), 34..68);
        assert_eq!(span::<Q8>(56, 16), 34..102);
        assert_eq!(row_bytes::<Q8>(64), 68);
    }

    #[test]
    fn a_q8_value_is_its_scale_times_its_byte() {
        let mut row = vec![0u8; 68];
        row[34..36].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        row[36 + 3] = (-7i8) as u8;
        assert_eq!(value::<Q8>(&row, 35), -3.5);
        assert_eq!(value::<Q8>(&row, 3), 0.0);
    }
}
