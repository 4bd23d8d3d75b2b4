//! Eight keys at a time on 256-bit registers, their bytes summed by `vpmaddubsw`, for
//! CPUs without VNNI.

use std::arch::x86_64::*;

use super::Run;
use crate::kv_cache::Q8_0_BYTES;

/// Keys scored at once: one in each 32-bit lane.
pub(super) const RUN: usize = 8;

/// As `super::vnni::score`, for eight keys.
///
/// `vpmaddubsw` multiplies unsigned bytes by signed ones and adds each pair into 16 bits,
/// saturating: the keys' magnitudes (at most 128) take the unsigned side and the query's
/// bytes, each given its key byte's sign (at most 127), the signed side, so that no pair's
/// sum (at most 32,512) saturates and each product is the signed one.
///
/// # Safety
/// AVX2 and F16C are present; eight rows of `at.row` bytes from `keys` are readable;
/// `j0 + here <= at.len` and `out` holds `at.rows` rows of `at.len`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn score(at: &Run, keys: *const u8, j0: usize, here: usize, out: &mut [f32]) {
    assert!(j0 + here <= at.len && out.len() >= at.rows * at.len);
    assert!(at.query.len() >= at.rows * at.row);
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(here as i32), lanes);
    let offsets = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(at.row as i32));
    let pairs = _mm256_set1_epi16(1);
    let blocks = at.row / Q8_0_BYTES;
    for b in 0..blocks {
        let block = keys.add(b * Q8_0_BYTES);
        let z: [__m256i; 8] =
            std::array::from_fn(|j| _mm256_loadu_si256(block.add(j * at.row + 2).cast()));
        let signs = transpose(z);
        let sizes = signs.map(|s| _mm256_abs_epi8(s));
        // The eight keys' scales, each read with the two bytes after it, packed to the
        // low 128 bits.
        let d = _mm256_i32gather_epi32::<1>(block.cast(), offsets);
        let d = _mm256_and_si256(d, _mm256_set1_epi32(0xffff));
        let d = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(d, d));
        let dk = _mm256_cvtph_ps(_mm256_castsi256_si128(d));
        for r in 0..at.rows {
            let qb = at.query.as_ptr().add(r * at.row + b * Q8_0_BYTES);
            let word =
                |g: usize| _mm256_set1_epi32(qb.add(2 + 4 * g).cast::<i32>().read_unaligned());
            let mut even = _mm256_setzero_si256();
            let mut odd = _mm256_setzero_si256();
            for g in (0..8).step_by(2) {
                let p = _mm256_maddubs_epi16(sizes[g], _mm256_sign_epi8(word(g), signs[g]));
                even = _mm256_add_epi32(even, _mm256_madd_epi16(p, pairs));
                let p =
                    _mm256_maddubs_epi16(sizes[g + 1], _mm256_sign_epi8(word(g + 1), signs[g + 1]));
                odd = _mm256_add_epi32(odd, _mm256_madd_epi16(p, pairs));
            }
            let sums = _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
            let dq = f32::from(half::f16::from_le_bytes([*qb, *qb.add(1)]));
            let o = out.as_mut_ptr().add(r * at.len + j0);
            let before = if b == 0 {
                _mm256_setzero_ps()
            } else {
                _mm256_maskload_ps(o, mask)
            };
            let mut s = _mm256_fmadd_ps(sums, _mm256_mul_ps(dk, _mm256_set1_ps(dq)), before);
            if b + 1 == blocks {
                s = _mm256_mul_ps(s, _mm256_set1_ps(at.scale));
            }
            _mm256_maskstore_ps(o, mask, s);
        }
    }
}

/// Eight keys' blocks (key `j` in `z[j]`) turned so that lane `l` of `out[g]` is key `l`'s
/// bytes `4g .. 4g + 4`: an 8x8 transpose of 32-bit words.
///
/// # Safety
/// AVX2 is present.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose(z: [__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (z[i / 2 * 2], z[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let base = i / 4 * 4 + i % 4 / 2;
        let (a, b) = (t[base], t[base + 2]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|g| {
        let (a, b) = (u[g % 4], u[g % 4 + 4]);
        if g < 4 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        }
    })
}
