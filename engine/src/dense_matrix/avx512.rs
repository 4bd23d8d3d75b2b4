//! The dense product on 512-bit registers: four weight rows against a tile of up to six
//! activation rows (24 chain registers, four of widened weights, one of activations: 29 of
//! the 32), each weight widened once a tile.

use std::arch::x86_64::*;

use super::avx2::reduce8;
use super::{BF16, F32, LANES, MAX_ROWS};

/// Weight rows one pass holds.
const QUAD: usize = 4;

/// Activation rows that share one load of a pass's weights.
const TILE: usize = 6;

/// The outputs of weight rows `w` of `KIND` values (at most [`MAX_ROWS`]) for each
/// activation row of `xs`, handed to `emit` in row order: each tile of activation rows
/// against the weight rows four at a time, a last part of fewer than four rows repeating
/// its last one (a matrix's loose rows, at most seven, so the repeats cost nothing that
/// counts); a last tile of fewer rows by a pass of its own size.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; each row of `w` holds `cols` values of `KIND`, each
/// of `xs` `cols` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn outputs<const KIND: u8>(
    w: &[&[u8]],
    xs: &[&[f32]],
    cols: usize,
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    let starts = starts(w.iter().map(|r| r.as_ptr()));
    let w = &starts[..w.len()];
    let last = w.len() - 1;
    let quads = w.len().div_ceil(QUAD);
    let quad =
        |q: usize| -> [*const u8; QUAD] { std::array::from_fn(|i| w[(q * QUAD + i).min(last)]) };
    let mut vals = [[0f32; MAX_ROWS]; TILE];
    let mut y = 0;
    while y < xs.len() {
        let tile = (xs.len() - y).min(TILE);
        let x: [*const f32; TILE] = std::array::from_fn(|j| xs[(y + j).min(xs.len() - 1)].as_ptr());
        for q in 0..quads {
            let ptrs = quad(q);
            // SAFETY: every pointer starts a row of `cols` values (the caller's promise).
            unsafe {
                match tile {
                    TILE => put(&mut vals, q, pass::<KIND, TILE>(&ptrs, x, cols)),
                    5 => put(&mut vals, q, pass::<KIND, 5>(&ptrs, first(x), cols)),
                    4 => put(&mut vals, q, pass::<KIND, 4>(&ptrs, first(x), cols)),
                    3 => put(&mut vals, q, pass::<KIND, 3>(&ptrs, first(x), cols)),
                    2 => put(&mut vals, q, pass::<KIND, 2>(&ptrs, first(x), cols)),
                    _ => put(&mut vals, q, pass::<KIND, 1>(&ptrs, first(x), cols)),
                }
            }
        }
        for (j, v) in vals[..tile].iter().enumerate() {
            emit(y + j, &v[..w.len()]);
        }
        y += tile;
    }
}

/// A tile's first `R` activation rows.
fn first<const R: usize>(x: [*const f32; TILE]) -> [*const f32; R] {
    std::array::from_fn(|j| x[j])
}

/// Quad `q`'s outputs for a tile's rows, into their places among `vals`.
fn put<const R: usize>(vals: &mut [[f32; MAX_ROWS]; TILE], q: usize, o: [[f32; QUAD]; R]) {
    for (v, o) in vals.iter_mut().zip(o) {
        v[q * QUAD..(q + 1) * QUAD].copy_from_slice(&o);
    }
}

/// Up to [`MAX_ROWS`] rows' first bytes, in an array (no allocation per group).
fn starts(rows: impl Iterator<Item = *const u8>) -> [*const u8; MAX_ROWS] {
    let mut ptrs = [std::ptr::null(); MAX_ROWS];
    for (p, r) in ptrs.iter_mut().zip(rows) {
        *p = r;
    }
    ptrs
}

/// Four weight rows against `R` activation rows: `[activation row][weight row]`.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; every pointer starts `cols` values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pass<const KIND: u8, const R: usize>(
    w: &[*const u8; QUAD],
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
            wv[i] = unsafe { load::<KIND>(w[i], k) };
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
        let mask = tail_mask(cols - whole);
        let mut wv = [_mm512_setzero_ps(); QUAD];
        for i in 0..QUAD {
            // SAFETY: the mask loads only the row's last `cols - whole` values.
            wv[i] = unsafe { load_part::<KIND>(w[i], k, mask) };
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

/// The lanes of a last part of `left` (1 to 15) values.
fn tail_mask(left: usize) -> __mmask16 {
    ((1u32 << left) - 1) as __mmask16
}

/// Values `k .. k + 16` of a row of `KIND` values, widened exactly.
///
/// # Safety
/// The CPU has AVX-512 F; the row holds those values.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load<const KIND: u8>(row: *const u8, k: usize) -> __m512 {
    // SAFETY: the caller promises the values; both loads take any alignment.
    unsafe {
        if KIND == F32 {
            _mm512_loadu_ps(row.cast::<f32>().add(k))
        } else {
            widen::<KIND>(_mm256_loadu_si256(row.cast::<u16>().add(k).cast()))
        }
    }
}

/// [`load`] of the values `mask` names, zeros in the other lanes.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; the row holds the masked values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load_part<const KIND: u8>(row: *const u8, k: usize, mask: __mmask16) -> __m512 {
    // SAFETY: the caller promises the values; masked lanes are not read.
    unsafe {
        if KIND == F32 {
            _mm512_maskz_loadu_ps(mask, row.cast::<f32>().add(k))
        } else {
            widen::<KIND>(_mm256_maskz_loadu_epi16(
                mask,
                row.cast::<u16>().add(k).cast(),
            ))
        }
    }
}

/// Sixteen bf16 (by their bits) or f16 values, widened exactly.
#[inline]
#[target_feature(enable = "avx512f")]
fn widen<const KIND: u8>(v: __m256i) -> __m512 {
    if KIND == BF16 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
    } else {
        _mm512_cvtph_ps(v)
    }
}

/// The sixteen chains added in the tree that defines every output: lane `i` plus lane
/// `i + 8`, then [`reduce8`]'s steps.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce(a: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(a);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    reduce8(_mm256_add_ps(lo, hi))
}
