//! The two products of a block of query rows: scores against the keys, and the weighted sum
//! of the values, both read from the cache's rows and widened to f32 exactly (`super::format`,
//! which makes them the same chains for f16 and Q8_0 caches). Vector kernels
//! where the CPU has them and the head width is a whole number of their vectors (AVX2,
//! FMA and F16C: eight values; AVX-512 for the weighted values: sixteen); elsewhere
//! scalar code computing the same chains of fused multiply-adds, so every CPU gives the
//! same bits.

use super::format::{self, Format};
use crate::kv_cache::KvDtype;

/// Which code computes a block's products. All give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    Scalar,
    /// AVX2, FMA and F16C; heads of a multiple of 8.
    Avx2,
    /// AVX-512 F besides those, heads of a multiple of 16: the weighted values on 512-bit
    /// registers (`super::zmm`), the scores as `Avx2`'s but over a Q8_0 cache on a CPU with
    /// AVX-512 VNNI (`super::q8_scores`).
    Avx512,
}

impl Kernel {
    /// The widest kernel this CPU runs for heads of `head_dim`.
    pub(super) fn best(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = head_dim.is_multiple_of(8)
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2 && head_dim.is_multiple_of(16) && is_x86_feature_detected!("avx512f") {
                return Kernel::Avx512;
            }
            if avx2 {
                return Kernel::Avx2;
            }
        }
        let _ = head_dim;
        Kernel::Scalar
    }

    /// Every kernel this CPU runs for heads of `head_dim`, the scalar code first.
    #[cfg(test)]
    pub(super) fn available(head_dim: usize) -> Vec<Self> {
        let all = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512];
        let best = Self::best(head_dim);
        all.into_iter()
            .take_while(|&k| k != best)
            .chain([best])
            .collect()
    }
}

/// The scores kernels' working memory, reused from call to call.
#[derive(Default)]
pub(super) struct Working {
    /// Eight keys widened to f32.
    wide: Vec<f32>,
    /// The integer scores'.
    q8: super::q8_scores::Working,
}

/// `out[r * len + j] = (q_r · k_j) * scale` for each query row `r` of `q` and each of the
/// first `len` keys (rows of `F`), by `kernel` (one that [`Kernel::best`] allows for
/// `head_dim`): over an f16 cache the dot product summed as [`dot`] sums it, over a Q8_0
/// cache as integers (`super::q8_scores`).
#[allow(clippy::too_many_arguments)] // the product's operands, then its working memory
pub(super) fn scores<F: Format>(
    kernel: Kernel,
    q: &[f32],
    keys: &[u8],
    len: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
    work: &mut Working,
) {
    let row = format::row_bytes::<F>(head_dim);
    assert!(keys.len() >= len * row && out.len() >= q.len() / head_dim * len);
    assert!(
        kernel as u8 <= Kernel::best(head_dim) as u8,
        "{kernel:?} for {head_dim}"
    );
    if F::DTYPE == KvDtype::Q8_0 {
        let q8 = &mut work.q8;
        return super::q8_scores::scores(kernel, q, keys, len, head_dim, scale, out, q8);
    }
    let wide = &mut work.wide;
    if kernel != Kernel::Scalar {
        // SAFETY: `Kernel::best` found AVX2, FMA and F16C and a head width of whole vectors;
        // the slices have the lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            fma::scores::<F>(
                q,
                keys,
                len,
                head_dim,
                scale,
                out,
                grown(wide, 8 * head_dim),
                kernel == Kernel::Avx512,
            )
        };
        return;
    }
    let wide = grown(wide, head_dim);
    for (j, key) in keys.chunks_exact(row).take(len).enumerate() {
        format::widen::<F>(key, wide);
        for (r, qr) in q.chunks_exact(head_dim).enumerate() {
            out[r * len + j] = dot(qr, wide) * scale;
        }
    }
}

/// `out[r] = sum over j < visible[r] of probs[r * stride + j] * values_j` (rows of `F`),
/// each output value one fused multiply-add chain over the keys, in order, from zero.
/// `kernel` as for [`scores`].
pub(super) fn weighted_values<F: Format>(
    kernel: Kernel,
    probs: &[f32],
    stride: usize,
    visible: &[usize],
    values: &[u8],
    head_dim: usize,
    out: &mut [f32],
) {
    let seen = visible.iter().copied().max().unwrap_or(0);
    let row = format::row_bytes::<F>(head_dim);
    assert!(seen <= stride && values.len() >= seen * row);
    assert!(probs.len() >= visible.len() * stride && out.len() >= visible.len() * head_dim);
    assert!(
        kernel as u8 <= Kernel::best(head_dim) as u8,
        "{kernel:?} for {head_dim}"
    );
    #[cfg(target_arch = "x86_64")]
    match kernel {
        Kernel::Scalar => {}
        Kernel::Avx2 => {
            // SAFETY: as in `scores`; the slices have the lengths asserted above.
            unsafe { fma::weighted_values::<F>(probs, stride, visible, values, head_dim, out) };
            return;
        }
        Kernel::Avx512 => {
            // SAFETY: `Kernel::best` found AVX-512 and F16C and a head width of whole 512-bit
            // vectors; the slices have the lengths asserted above.
            unsafe {
                super::zmm::weighted_values::<F>(probs, stride, visible, values, head_dim, out)
            };
            return;
        }
    }
    let rows = probs.chunks_exact(stride).zip(visible);
    for ((p, &vis), o) in rows.zip(out.chunks_exact_mut(head_dim)) {
        for (d, o) in o.iter_mut().enumerate() {
            *o = (0..vis).fold(0f32, |acc, j| {
                format::value::<F>(&values[j * row..], d).mul_add(p[j], acc)
            });
        }
    }
}

/// The first `n` values of `buf`, grown to hold them: working memory reused from call to
/// call, whose old values the caller overwrites.
pub(super) fn grown(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// The dot product in eight lanes: lane `l` one chain of fused multiply-adds over the
/// dimensions `l` modulo 8, in order, from zero; then the lanes added in pairs, as the
/// vector kernel's tree adds them.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    for (d, (&x, &y)) in a.iter().zip(b).enumerate() {
        l[d % 8] = x.mul_add(y, l[d % 8]);
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use crate::attention::format::x86::{load8, scale8};
    use crate::attention::format::{self, Format};

    /// Runs of eight keys whose cache lines are asked for ahead of their reads (2 KiB at
    /// SmolLM2's heads of 64). A decode step reads each head's keys and values once, from
    /// memory, in runs of a few dozen KiB; the cores' own prefetchers stop at each 4 KiB
    /// page and start again. On a 512-bit Xeon attention went from 32-33% to 28-29% of a
    /// batch-16 step (bench/HISTORY.md, 2026-12-05); 4 KiB ahead did no better.
    const AHEAD: usize = 2;

    /// [`AHEAD`] for the scores, which first ask for all the runs before it (4 KiB at
    /// heads of 64). Twice the distance and the first runs asked for up front made
    /// batch-16 steps on a Zen 5 1-5% faster; the distance alone, half of that
    /// (bench/HISTORY.md, "2026-12-07, third session").
    const SCORES_AHEAD: usize = 4;

    /// As `super::scores`. Eight keys at a time are widened once into `wide`; each query
    /// row then runs one accumulator per key (lane `l` summing the dimensions `l` modulo
    /// 8), and a tree of horizontal adds gives the eight keys' scores in one vector. Against
    /// chains over the dimension in order (an 8x8 transpose of the keys and a broadcast
    /// per query value), scores took half the instructions.
    ///
    /// With `zmm` the keys are widened on 512-bit registers (`super::super::zmm`), in half
    /// the instructions: the same values.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present; `head_dim` is a multiple of 8; `keys` holds `len` rows,
    /// `out` `q.len() / head_dim` rows of `len` and `wide` `8 * head_dim` values; with `zmm`,
    /// AVX-512F is present and `head_dim` a multiple of 16.
    #[allow(clippy::too_many_arguments)] // `super::scores`', and how to widen
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores<F: Format>(
        q: &[f32],
        keys: &[u8],
        len: usize,
        head_dim: usize,
        scale: f32,
        out: &mut [f32],
        wide: &mut [f32],
        zmm: bool,
    ) {
        assert!(wide.len() >= 8 * head_dim, "too little working memory");
        let rows = q.len() / head_dim;
        let row = format::row_bytes::<F>(head_dim);
        let full = len / 8 * 8;
        let scale_v = _mm256_set1_ps(scale);
        crate::ahead::ask_first(keys, (8 * SCORES_AHEAD).min(full) * row);
        for j0 in (0..len).step_by(8) {
            let from = keys.as_ptr().add(j0 * row);
            if j0 + 8 * SCORES_AHEAD < full {
                // Keys `j0 + 8 * SCORES_AHEAD` onwards, a whole run of eight before `full`.
                let next = from.add(8 * SCORES_AHEAD * row) as *const i8;
                for line in (0..8 * row).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(line));
                }
            }
            // The last run's missing keys are zeros: their scores are computed and never
            // stored, and each key's score is its own lanes', whatever keys run beside it.
            let here = 8.min(len - j0);
            if zmm && here == 8 {
                super::super::zmm::widen_keys::<F>(from, head_dim, wide);
            } else {
                widen_keys::<F>(from, here, head_dim, wide);
            }
            for r in 0..rows {
                let qr = q.as_ptr().add(r * head_dim);
                let mut acc = [_mm256_setzero_ps(); 8];
                for d0 in (0..head_dim).step_by(8) {
                    let qv = _mm256_loadu_ps(qr.add(d0));
                    for (j, a) in acc.iter_mut().enumerate() {
                        let k = _mm256_loadu_ps(wide.as_ptr().add(j * head_dim + d0));
                        *a = _mm256_fmadd_ps(qv, k, *a);
                    }
                }
                let s = _mm256_mul_ps(sum_lanes(acc), scale_v);
                if here == 8 {
                    _mm256_storeu_ps(out.as_mut_ptr().add(r * len + j0), s);
                } else {
                    let mut last = [0f32; 8];
                    _mm256_storeu_ps(last.as_mut_ptr(), s);
                    out[r * len + j0..][..here].copy_from_slice(&last[..here]);
                }
            }
        }
    }

    /// The first `here` (at most eight) keys' rows from `from` (rows of `F`) widened into
    /// `wide`, one after another, and zeros for the rest of eight.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present; `head_dim` is a multiple of 8 (of 32 for Q8_0 rows);
    /// `here` rows from `from` are readable; `wide` holds `8 * head_dim` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_keys<F: Format>(
        from: *const u8,
        here: usize,
        head_dim: usize,
        wide: &mut [f32],
    ) {
        let row = format::row_bytes::<F>(head_dim);
        for k in 0..8 {
            let key = from.add(k * row);
            let mut s = _mm256_setzero_ps();
            for d in (0..head_dim).step_by(8) {
                let w = if k < here {
                    if d % 32 == 0 {
                        s = scale8::<F>(key, d);
                    }
                    load8::<F>(key, d, s)
                } else {
                    _mm256_setzero_ps()
                };
                _mm256_storeu_ps(wide.as_mut_ptr().add(k * head_dim + d), w);
            }
        }
    }

    /// Lane `j` of the result is `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))` over
    /// the lanes `a` of `acc[j]`: `super::dot`'s last step, for eight keys at once.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sum_lanes(acc: [__m256; 8]) -> __m256 {
        let h01 = _mm256_hadd_ps(acc[0], acc[1]);
        let h23 = _mm256_hadd_ps(acc[2], acc[3]);
        let h45 = _mm256_hadd_ps(acc[4], acc[5]);
        let h67 = _mm256_hadd_ps(acc[6], acc[7]);
        // Lanes 0-3: keys 0-3 (or 4-7) over lanes 0-3 of each; lanes 4-7: over lanes 4-7.
        let low = _mm256_hadd_ps(h01, h23);
        let high = _mm256_hadd_ps(h45, h67);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(low, high),
            _mm256_permute2f128_ps::<0x31>(low, high),
        )
    }

    /// As `super::weighted_values`. Each row runs alone, over the head dimension in runs
    /// of eight vectors (64 values): a row of values is then read in one pass, front to
    /// back, as the prefetcher streams it. Rows taken two or three at a time over
    /// narrower runs read each row of values once instead, but in strides of a quarter
    /// row, and were slower where the values come from memory (a batch-16 step at 256 keys).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present; `head_dim` is a multiple of 8; the slices have the lengths
    /// `super::weighted_values` asserts.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_values<F: Format>(
        probs: &[f32],
        stride: usize,
        visible: &[usize],
        values: &[u8],
        head_dim: usize,
        out: &mut [f32],
    ) {
        for (r, &vis) in visible.iter().enumerate() {
            let p = &probs[r * stride..][..vis];
            let o = &mut out[r * head_dim..][..head_dim];
            let mut d0 = 0;
            while d0 + 64 <= head_dim {
                columns::<8, F>(p, values, head_dim, d0, o);
                d0 += 64;
            }
            match (head_dim - d0) / 8 {
                1 => columns::<1, F>(p, values, head_dim, d0, o),
                2 => columns::<2, F>(p, values, head_dim, d0, o),
                3 => columns::<3, F>(p, values, head_dim, d0, o),
                4 => columns::<4, F>(p, values, head_dim, d0, o),
                5 => columns::<5, F>(p, values, head_dim, d0, o),
                6 => columns::<6, F>(p, values, head_dim, d0, o),
                7 => columns::<7, F>(p, values, head_dim, d0, o),
                _ => {}
            }
        }
    }

    /// Values `d0 .. d0 + 8 * V` of one row's output: `V` chains over the keys `probs`
    /// weighs.
    ///
    /// # Safety
    /// As for [`weighted_values`]; `d0 + 8 * V <= head_dim`; `values` holds `probs.len()`
    /// rows; `out` holds `head_dim` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn columns<const V: usize, F: Format>(
        probs: &[f32],
        values: &[u8],
        head_dim: usize,
        d0: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); V];
        let row = format::row_bytes::<F>(head_dim);
        let bytes = format::span::<F>(d0, 8 * V);
        for (j, &pj) in probs.iter().enumerate() {
            let pj = _mm256_set1_ps(pj);
            let vj = values.as_ptr().add(j * row);
            if j + 8 * AHEAD < probs.len() {
                // This call's values of a row that `probs` reaches.
                let next = vj.add(8 * AHEAD * row + bytes.start) as *const i8;
                for line in (0..bytes.len()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(line));
                }
            }
            let mut s = _mm256_setzero_ps();
            for (i, a) in acc.iter_mut().enumerate() {
                // `d0` is a multiple of 64: a block starts every four loads.
                if i % 4 == 0 {
                    s = scale8::<F>(vj, d0 + 8 * i);
                }
                *a = _mm256_fmadd_ps(load8::<F>(vj, d0 + 8 * i, s), pj, *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(d0 + 8 * i), *a);
        }
    }
}
