//! The half-precision product on 512-bit registers: four weight rows against a tile of
//! four activation rows (sixteen chain registers, four of widened weights, one of
//! activations: 21 of the 32), each weight widened once a tile.

use std::arch::x86_64::*;

use super::{Half, LANES, TILE};
use crate::split::GROUP;

/// Weight rows one pass holds.
const QUAD: usize = 4;

/// The outputs of weight rows `w` (at most a group) for each activation row of `xs`,
/// handed to `emit` in row order.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; each row of `w` holds `cols` values (`2 * cols`
/// bytes), each of `xs` `cols` values.
pub(super) unsafe fn outputs(
    half: Half,
    w: &[&[u8]],
    xs: &[&[f32]],
    cols: usize,
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    assert!(!w.is_empty() && w.len() <= GROUP, "one row or a group");
    assert!(w.iter().all(|r| r.len() == 2 * cols) && xs.iter().all(|x| x.len() == cols));
    // SAFETY: the caller promises the features; the rows' lengths are checked above.
    unsafe {
        match half {
            Half::F16 => outputs_of::<false>(w, xs, cols, emit),
            Half::Bf16 => outputs_of::<true>(w, xs, cols, emit),
        }
    }
}

/// [`outputs`] for one type: each tile of activation rows against the weight rows four at
/// a time, a last part of fewer than four rows repeating its last one (a matrix's loose
/// rows, at most seven of them, so the repeats cost nothing that counts); activation rows
/// that fill no tile one at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn outputs_of<const BF16: bool>(
    w: &[&[u8]],
    xs: &[&[f32]],
    cols: usize,
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    let quad = |q: usize| -> [*const u16; QUAD] {
        let last = w.len() - 1;
        std::array::from_fn(|i| w[(q * QUAD + i).min(last)].as_ptr().cast())
    };
    let quads = [quad(0), quad(1)];
    let used = w.len().div_ceil(QUAD);
    let mut vals = [[0f32; GROUP]; TILE];
    let mut y = 0;
    while y < xs.len() {
        let tile = if xs.len() - y >= TILE { TILE } else { 1 };
        for (q, ptrs) in quads[..used].iter().enumerate() {
            let at = q * QUAD..(q + 1) * QUAD;
            // SAFETY: every pointer starts a row of `cols` values (checked by `outputs`).
            unsafe {
                if tile == TILE {
                    let x = std::array::from_fn(|j| xs[y + j].as_ptr());
                    let o = pass::<BF16, TILE>(ptrs, x, cols);
                    for (v, o) in vals.iter_mut().zip(o) {
                        v[at.clone()].copy_from_slice(&o);
                    }
                } else {
                    let o = pass::<BF16, 1>(ptrs, [xs[y].as_ptr()], cols);
                    vals[0][at].copy_from_slice(&o[0]);
                }
            }
        }
        for (j, v) in vals[..tile].iter().enumerate() {
            emit(y + j, &v[..w.len()]);
        }
        y += tile;
    }
}

/// Four weight rows against `R` activation rows: `[activation row][weight row]`.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; every pointer starts `cols` values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pass<const BF16: bool, const R: usize>(
    w: &[*const u16; QUAD],
    x: [*const f32; R],
    cols: usize,
) -> [[f32; QUAD]; R] {
    let mut acc = [[_mm512_setzero_ps(); QUAD]; R];
    let whole = cols / LANES * LANES;
    let mut k = 0;
    while k < whole {
        let mut wv = [_mm512_setzero_ps(); QUAD];
        for i in 0..QUAD {
            // SAFETY: `k + LANES <= whole <= cols`: sixteen values of the row.
            wv[i] = widen::<BF16>(unsafe { _mm256_loadu_si256(w[i].add(k).cast()) });
        }
        for j in 0..R {
            // SAFETY: as the weights' loads.
            let xv = unsafe { _mm512_loadu_ps(x[j].add(k)) };
            for i in 0..QUAD {
                acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
            }
        }
        k += LANES;
    }
    if whole < cols {
        let mask = ((1u32 << (cols - whole)) - 1) as __mmask16;
        let mut wv = [_mm512_setzero_ps(); QUAD];
        for i in 0..QUAD {
            // SAFETY: the mask loads only the row's last `cols - whole` values.
            let part = unsafe { _mm256_maskz_loadu_epi16(mask, w[i].add(k).cast()) };
            wv[i] = widen::<BF16>(part);
        }
        for j in 0..R {
            // SAFETY: as the weights' masked loads.
            let xv = unsafe { _mm512_maskz_loadu_ps(mask, x[j].add(k)) };
            for i in 0..QUAD {
                acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
            }
        }
    }
    let mut out = [[0f32; QUAD]; R];
    for j in 0..R {
        for i in 0..QUAD {
            out[j][i] = reduce(acc[j][i]);
        }
    }
    out
}

/// Sixteen bf16 (by their bits) or f16 values, widened exactly.
#[inline]
#[target_feature(enable = "avx512f")]
fn widen<const BF16: bool>(v: __m256i) -> __m512 {
    if BF16 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
    } else {
        _mm512_cvtph_ps(v)
    }
}

/// The sixteen chains added in the tree that defines every output: lane `i` plus lane
/// `i + 8`, those eight halved the same way twice more, then the last two.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce(a: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(a);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    let v8 = _mm256_add_ps(lo, hi);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
}
