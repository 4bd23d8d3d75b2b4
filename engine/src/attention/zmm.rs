//! The weighted values on 512-bit registers, where the CPU has AVX-512 and the head width
//! is a multiple of 16: the query rows of a block (a decode step's query heads sharing a
//! K/V head, or a prompt's rows at consecutive positions) take each value row widened
//! once, where the 256-bit kernel widens it once a row. On a 512-bit Xeon, `vcvtph2ps`
//! (one a cycle) bounded that kernel: three query heads took 24 widenings and 24
//! multiply-adds a key, here 4 and 12. The weighted values went from 12.5% to 9.8% of a
//! batch-16 step of SmolLM2, about half of it now waiting on memory (bench/HISTORY.md,
//! 2026-12-06).

use std::arch::x86_64::*;

use super::format::x86::{load16, scale16};
use super::format::{self, Format};

/// Keys whose cache lines are asked for ahead of their reads, after asking for all of those
/// before them (32 keys: 4 KiB of f16 at SmolLM2's heads of 64), twice the 256-bit
/// kernel's distance: as the scores' asks (`super::kernels`).
const AHEAD: usize = 32;

/// Most accumulators one pass holds: 32 registers less the widened values and the weights.
const ACCUMULATORS: usize = 16;

/// Most rows one pass takes.
const PASS_ROWS: usize = 4;

/// As `super::weighted_values`: up to [`PASS_ROWS`] rows side by side share one pass over
/// the values, in runs of as many vectors of the head (at most eight) as leave each row its
/// accumulators. Rows that see fewer keys than the pass's last row (a prompt's block, one
/// more key each) leave their accumulators as they are past their own keys, by masked
/// multiply-adds: each output value is still the scalar code's one chain of fused
/// multiply-adds, whatever its neighbours see. A prompt's rows, each in a pass of its own,
/// widened every value row once a row: four rows a pass took the weighted values of a
/// 2,048-token prompt of a 1.5B from 17% to 9% of the products' time (bench/HISTORY.md,
/// "2026-12-07, sixth session").
///
/// # Safety
/// AVX-512F and F16C are present; `head_dim` is a multiple of 16; the slices have the
/// lengths `super::weighted_values` asserts.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(super) unsafe fn weighted_values<F: Format>(
    probs: &[f32],
    stride: usize,
    visible: &[usize],
    values: &[u8],
    head_dim: usize,
    out: &mut [f32],
) {
    for r0 in (0..visible.len()).step_by(PASS_ROWS) {
        let rows = PASS_ROWS.min(visible.len() - r0);
        let mut d0 = 0;
        while d0 < head_dim {
            let width = ((head_dim - d0) / 16).min(8);
            let c = [8, 4, 2, 1]
                .into_iter()
                .find(|&c| c <= width && c * rows <= ACCUMULATORS)
                .unwrap_or(1);
            let pass = Pass::<F> {
                probs: &probs[r0 * stride..],
                stride,
                visible: &visible[r0..r0 + rows],
                values,
                head_dim,
                d0,
                format: std::marker::PhantomData,
            };
            let out = &mut out[r0 * head_dim..];
            match (rows, c) {
                (1, 8) => pass.run::<1, 8>(out),
                (2, 8) => pass.run::<2, 8>(out),
                (1, 4) => pass.run::<1, 4>(out),
                (2, 4) => pass.run::<2, 4>(out),
                (3, 4) => pass.run::<3, 4>(out),
                (4, 4) => pass.run::<4, 4>(out),
                (1, 2) => pass.run::<1, 2>(out),
                (2, 2) => pass.run::<2, 2>(out),
                (3, 2) => pass.run::<3, 2>(out),
                (4, 2) => pass.run::<4, 2>(out),
                (1, _) => pass.run::<1, 1>(out),
                (2, _) => pass.run::<2, 1>(out),
                (3, _) => pass.run::<3, 1>(out),
                _ => pass.run::<4, 1>(out),
            }
            d0 += 16 * c;
        }
    }
}

/// Eight keys' rows from `from` (rows of `F`), widened into `wide`, one after another: as
/// the 256-bit scores kernel widens them, in half the instructions.
///
/// # Safety
/// AVX-512F and F16C are present; `head_dim` is a multiple of 16 (of 32 for Q8_0 rows);
/// eight rows from `from` are readable; `wide` holds `8 * head_dim` values.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(super) unsafe fn widen_keys<F: Format>(from: *const u8, head_dim: usize, wide: &mut [f32]) {
    let row = format::row_bytes::<F>(head_dim);
    for k in 0..8 {
        let key = from.add(k * row);
        let mut s = _mm512_setzero_ps();
        for d in (0..head_dim).step_by(16) {
            if d % 32 == 0 {
                s = scale16::<F>(key, d);
            }
            _mm512_storeu_ps(
                wide.as_mut_ptr().add(k * head_dim + d),
                load16::<F>(key, d, s),
            );
        }
    }
}

/// One pass over the values (rows of `F`): rows from the first of `probs`, each `stride`
/// apart, row `r` seeing `visible[r]` keys, and the head's dimensions from `d0`.
struct Pass<'a, F> {
    probs: &'a [f32],
    stride: usize,
    visible: &'a [usize],
    values: &'a [u8],
    head_dim: usize,
    d0: usize,
    format: std::marker::PhantomData<F>,
}

impl<F: Format> Pass<'_, F> {
    /// Values `d0 .. d0 + 16 * C` of `R` rows' outputs (row `r` at `out[r * head_dim..]`).
    ///
    /// # Safety
    /// As for [`weighted_values`]; `R` rows of `probs` and `out` and `d0 + 16 * C` dims.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    unsafe fn run<const R: usize, const C: usize>(&self, out: &mut [f32]) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let hd = self.head_dim;
        let row = format::row_bytes::<F>(hd);
        let bytes = format::span::<F>(self.d0, 16 * C);
        let vis: [usize; R] = std::array::from_fn(|r| self.visible[r]);
        // Keys every row sees, and those the pass reads.
        let all = vis.iter().copied().min().unwrap_or(0);
        let most = vis.iter().copied().max().unwrap_or(0);
        for j in 0..AHEAD.min(most) {
            crate::ahead::ask_for(self.values.as_ptr().add(j * row + bytes.start), bytes.len());
        }
        for j in 0..most {
            let vj = self.values.as_ptr().add(j * row);
            if j + AHEAD < most {
                let next = vj.add(AHEAD * row + bytes.start) as *const i8;
                for line in (0..bytes.len()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(line));
                }
            }
            let mut wide = [_mm512_setzero_ps(); C];
            let mut s = _mm512_setzero_ps();
            for (c, w) in wide.iter_mut().enumerate() {
                // `d0` is a multiple of 32 where the rows are Q8_0 blocks (heads of a
                // multiple of 32 take only runs of an even number of vectors).
                if c % 2 == 0 {
                    s = scale16::<F>(vj, self.d0 + 16 * c);
                }
                *w = load16::<F>(vj, self.d0 + 16 * c, s);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                // Row `r`'s weight of a key past its own is read (its row of `probs` is
                // `stride` long) and never added.
                let p = _mm512_set1_ps(*self.probs.get_unchecked(r * self.stride + j));
                if j < all {
                    for (a, w) in a.iter_mut().zip(&wide) {
                        *a = _mm512_fmadd_ps(*w, p, *a);
                    }
                } else {
                    let seen: __mmask16 = if j < vis[r] { !0 } else { 0 };
                    for (a, w) in a.iter_mut().zip(&wide) {
                        *a = _mm512_mask3_fmadd_ps(*w, p, *a, seen);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (c, a) in a.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(r * hd + self.d0 + 16 * c), *a);
            }
        }
    }
}
