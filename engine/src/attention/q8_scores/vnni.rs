//! Sixteen keys at a time on 512-bit registers, their bytes summed by `vpdpbusd`.

use std::arch::x86_64::*;

use super::Run;
use crate::kv_cache::Q8_0_BYTES;

/// Keys scored at once: one in each 32-bit lane.
pub(super) const RUN: usize = 16;

/// Every query row's scores against sixteen keys' rows from `keys`, the first `here` of
/// them stored at `out[r * len + j0..]`.
///
/// `vpdpbusd` multiplies unsigned bytes by signed ones: the keys take the unsigned side,
/// each byte plus 128, so that each sum gains 128 times the query block's bytes' sum,
/// which the accumulator's start (`Run::bias`) takes back.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI and F16C are present; sixteen rows of `at.row` bytes from
/// `keys` are readable; `j0 + here <= at.len` and `out` holds `at.rows` rows of `at.len`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")]
pub(super) unsafe fn score(at: &Run, keys: *const u8, j0: usize, here: usize, out: &mut [f32]) {
    assert!(j0 + here <= at.len && out.len() >= at.rows * at.len);
    let blocks = at.row / Q8_0_BYTES;
    assert!(at.query.len() >= at.rows * at.row && at.bias.len() >= at.rows * blocks);
    let mask: __mmask16 = if here == RUN { !0 } else { (1 << here) - 1 };
    let flip = _mm512_set1_epi8(i8::MIN);
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(at.row as i32));
    for b in 0..blocks {
        let block = keys.add(b * Q8_0_BYTES);
        // Keys `j` and `j + 8` in the two halves of register `j`, each byte plus 128.
        let z: [__m512i; 8] = std::array::from_fn(|j| {
            let lo = _mm256_loadu_si256(block.add(j * at.row + 2).cast());
            let hi = _mm256_loadu_si256(block.add((j + 8) * at.row + 2).cast());
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            _mm512_xor_si512(both, flip)
        });
        let t = transpose(z);
        // The sixteen keys' scales, each read with the two bytes after it.
        let d = _mm512_i32gather_epi32::<1>(offsets, block.cast());
        let dk = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
        for r in 0..at.rows {
            let qb = at.query.as_ptr().add(r * at.row + b * Q8_0_BYTES);
            let word =
                |g: usize| _mm512_set1_epi32(qb.add(2 + 4 * g).cast::<i32>().read_unaligned());
            let mut even = _mm512_set1_epi32(at.bias[r * blocks + b]);
            let mut odd = _mm512_setzero_si512();
            for g in (0..8).step_by(2) {
                even = _mm512_dpbusd_epi32(even, t[g], word(g));
                odd = _mm512_dpbusd_epi32(odd, t[g + 1], word(g + 1));
            }
            let sums = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
            let dq = f32::from(half::f16::from_le_bytes([*qb, *qb.add(1)]));
            let o = out.as_mut_ptr().add(r * at.len + j0);
            let before = if b == 0 {
                _mm512_setzero_ps()
            } else {
                _mm512_maskz_loadu_ps(mask, o)
            };
            let mut s = _mm512_fmadd_ps(sums, _mm512_mul_ps(dk, _mm512_set1_ps(dq)), before);
            if b + 1 == blocks {
                s = _mm512_mul_ps(s, _mm512_set1_ps(at.scale));
            }
            _mm512_mask_storeu_ps(o, mask, s);
        }
    }
}

/// Eight registers of two keys' blocks each (key `j` in the low half of `z[j]`, key
/// `j + 8` in the high) turned so that lane `l` of `out[g]` is key `l`'s bytes
/// `4g .. 4g + 4`: an 8x8 transpose of 32-bit words in each half.
///
/// # Safety
/// AVX-512F is present.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose(z: [__m512i; 8]) -> [__m512i; 8] {
    // Per 128-bit lane: words 0 and 1 (`lo`) or 2 and 3 (`hi`) of two keys, interleaved.
    let t: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (z[i / 2 * 2], z[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // Per 128-bit lane: one word of four keys (`u[0]`: word 0 of keys 0-3 in the first
    // lane, word 4 in the second).
    let u: [__m512i; 8] = std::array::from_fn(|i| {
        let base = i / 4 * 4 + i % 4 / 2;
        let (a, b) = (t[base], t[base + 2]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    std::array::from_fn(|g| {
        let (a, b) = (u[g % 4], u[g % 4 + 4]);
        let which = if g < 4 { first } else { second };
        _mm512_permutex2var_epi64(a, which, b)
    })
}
