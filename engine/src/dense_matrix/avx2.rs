//! The dense product on 256-bit registers, for CPUs without AVX-512: each of
//! the sixteen chains of the defining order is a lane of one of two registers (chains 0-7
//! and 8-15), so every output has the 512-bit kernel's bits and nodes of both kinds give
//! the same tokens. Two weight rows against a tile of three activation rows (twelve chain
//! registers; then, for each half of sixteen columns, two of widened weights and one of
//! activations: 15 of the 16).

use std::arch::x86_64::*;

use super::{size, BF16, F32, LANES, MAX_ROWS};

/// Weight rows one pass holds.
const PAIR: usize = 2;

/// Activation rows that share one load of a pass's weights: three give twelve chain
/// registers, more independent fused multiply-adds in flight than the eight of tiles of
/// two, which ran 1.05-1.23x slower at 16 to 512 rows (`product-bench --only 256-bit`,
/// medians of three alternated runs, 2-core Zen 5).
const TILE: usize = 3;

/// Lanes of one register: half a chain register of the defining order.
const HALF: usize = LANES / 2;

/// The outputs of weight rows `w` of `KIND` values (at most [`MAX_ROWS`]) for each
/// activation row of `xs`, handed to `emit` in row order: each tile of activation rows
/// against the weight rows two at a time, an odd last row repeated.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; each row of `w` holds `cols` values of `KIND`, each of
/// `xs` `cols` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn outputs<const KIND: u8>(
    w: &[&[u8]],
    xs: &[&[f32]],
    cols: usize,
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    let last = w.len() - 1;
    let mut vals = [[0f32; MAX_ROWS]; TILE];
    let mut y = 0;
    while y < xs.len() {
        let tile = (xs.len() - y).min(TILE);
        for p in 0..w.len().div_ceil(PAIR) {
            let ptrs = std::array::from_fn(|i| w[(p * PAIR + i).min(last)].as_ptr());
            let at = p * PAIR..(p + 1) * PAIR;
            let x = |j: usize| xs[y + j].as_ptr();
            // SAFETY: every pointer starts a row of `cols` values (the caller's promise).
            unsafe {
                match tile {
                    TILE => put(
                        &mut vals,
                        at,
                        pass::<KIND, TILE>(ptrs, [x(0), x(1), x(2)], cols),
                    ),
                    2 => put(&mut vals, at, pass::<KIND, 2>(ptrs, [x(0), x(1)], cols)),
                    _ => put(&mut vals, at, pass::<KIND, 1>(ptrs, [x(0)], cols)),
                }
            }
        }
        for (j, v) in vals[..tile].iter().enumerate() {
            emit(y + j, &v[..w.len()]);
        }
        y += tile;
    }
}

/// A pair's outputs for a tile's rows, into their places `at` among `vals`.
fn put<const R: usize>(
    vals: &mut [[f32; MAX_ROWS]; TILE],
    at: std::ops::Range<usize>,
    o: [[f32; PAIR]; R],
) {
    for (v, o) in vals.iter_mut().zip(o) {
        v[at.clone()].copy_from_slice(&o);
    }
}

/// Chain registers: `[activation row][weight row][chains 0-7, chains 8-15]`.
type Chains<const R: usize> = [[[__m256; 2]; PAIR]; R];

/// Two weight rows against `R` activation rows: `[activation row][weight row]`. A last
/// part of fewer than sixteen columns is copied beside zeros first, the values the
/// 512-bit kernel's masked loads give.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; every pointer starts `cols` values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass<const KIND: u8, const R: usize>(
    w: [*const u8; PAIR],
    x: [*const f32; R],
    cols: usize,
) -> [[f32; PAIR]; R] {
    let bytes = size(KIND);
    let mut acc: Chains<R> = [[[_mm256_setzero_ps(); 2]; PAIR]; R];
    let whole = cols / LANES * LANES;
    let mut k = 0;
    while k < whole {
        // SAFETY: `k + LANES <= whole <= cols`: sixteen values of each row.
        unsafe {
            step::<KIND, R>(
                w.map(|p| p.wrapping_add(bytes * k)),
                x.map(|p| p.add(k)),
                &mut acc,
            )
        };
        k += LANES;
    }
    if whole < cols {
        let left = cols - whole;
        let mut wpad = [[0u8; 4 * LANES]; PAIR];
        let mut xpad = [[0f32; LANES]; R];
        for (pad, &p) in wpad.iter_mut().zip(&w) {
            // SAFETY: the row's last `left` values start at value `whole`.
            let part = unsafe { std::slice::from_raw_parts(p.add(bytes * whole), bytes * left) };
            pad[..bytes * left].copy_from_slice(part);
        }
        for (pad, &p) in xpad.iter_mut().zip(&x) {
            // SAFETY: as the weights'.
            pad[..left].copy_from_slice(unsafe { std::slice::from_raw_parts(p.add(whole), left) });
        }
        let wp = std::array::from_fn(|i| wpad[i].as_ptr());
        let xp = std::array::from_fn(|j| xpad[j].as_ptr());
        // SAFETY: the pads hold sixteen values each.
        unsafe { step::<KIND, R>(wp, xp, &mut acc) };
    }
    let mut out = [[0f32; PAIR]; R];
    for j in 0..R {
        for i in 0..PAIR {
            out[j][i] = reduce8(_mm256_add_ps(acc[j][i][0], acc[j][i][1]));
        }
    }
    out
}

/// Sixteen columns from `w` and `x` into the chains, eight at a time: a half's two
/// widened weight registers beside the tile's chains.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; every pointer starts sixteen values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn step<const KIND: u8, const R: usize>(
    w: [*const u8; PAIR],
    x: [*const f32; R],
    acc: &mut Chains<R>,
) {
    for (h, first) in [0, HALF].into_iter().enumerate() {
        let mut wv = [_mm256_setzero_ps(); PAIR];
        for (wv, &row) in wv.iter_mut().zip(&w) {
            // SAFETY: the caller promises sixteen values.
            *wv = unsafe { load::<KIND>(row.add(size(KIND) * first)) };
        }
        for j in 0..R {
            // SAFETY: as the weights'.
            let xv = unsafe { _mm256_loadu_ps(x[j].add(first)) };
            for i in 0..PAIR {
                acc[j][i][h] = _mm256_fmadd_ps(wv[i], xv, acc[j][i][h]);
            }
        }
    }
}

/// Eight values of `KIND` at `p`, widened exactly.
///
/// # Safety
/// The CPU has AVX2 and F16C; `p` starts eight values.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load<const KIND: u8>(p: *const u8) -> __m256 {
    if KIND == F32 {
        // SAFETY: the caller promises the values; the load takes any alignment.
        return unsafe { _mm256_loadu_ps(p.cast()) };
    }
    // SAFETY: the caller promises the values.
    let v = unsafe { _mm_loadu_si128(p.cast()) };
    if KIND == BF16 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
    } else {
        _mm256_cvtph_ps(v)
    }
}

/// The defining tree's last steps, from the eight sums of chain `i` and chain `i + 8`:
/// those eight halved twice (lane `i` plus lane `i + 4`, then `i + 2`), then the last two.
#[inline]
#[target_feature(enable = "avx")]
pub(super) fn reduce8(v8: __m256) -> f32 {
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
}
