//! The two products of a block of query rows: scores against the keys, and the weighted sum
//! of the values, both read from the f16 cache and widened to f32 exactly. AVX2 kernels
//! where the CPU has AVX2, FMA and F16C and the head width is a multiple of 8; elsewhere
//! scalar code computing the same chains of fused multiply-adds, so every CPU gives the
//! same bits.

use half::f16;

/// `out[r * len + j] = (q_r · k_j) * scale` for each query row `r` of `q` and each of the
/// first `len` keys, the dot product one fused multiply-add chain over the head dimension,
/// in order, from zero. `vector`: take the AVX2 kernel where [`vector`] allows it (the
/// tests turn it off to hold the kernel against the scalar code).
pub(super) fn scores(
    vector: bool,
    q: &[f32],
    keys: &[f16],
    len: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(keys.len() >= len * head_dim && out.len() >= q.len() / head_dim * len);
    if vector && self::vector(head_dim) {
        // SAFETY: `vector` found AVX2, FMA and F16C and a head width of whole vectors; the
        // slices have the lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            fma::scores(q, keys, len, head_dim, scale, out)
        };
        return;
    }
    for (qr, o) in q.chunks_exact(head_dim).zip(out.chunks_exact_mut(len)) {
        for (k, s) in keys.chunks_exact(head_dim).zip(o.iter_mut()) {
            *s = dot(qr, k) * scale;
        }
    }
}

/// `out[r] = sum over j < visible[r] of probs[r * stride + j] * values_j`, each output
/// value one fused multiply-add chain over the keys, in order, from zero. `vector` as for
/// [`scores`].
pub(super) fn weighted_values(
    vector: bool,
    probs: &[f32],
    stride: usize,
    visible: &[usize],
    values: &[f16],
    head_dim: usize,
    out: &mut [f32],
) {
    let seen = visible.iter().copied().max().unwrap_or(0);
    assert!(seen <= stride && values.len() >= seen * head_dim);
    assert!(probs.len() >= visible.len() * stride && out.len() >= visible.len() * head_dim);
    if vector && self::vector(head_dim) {
        // SAFETY: as in `scores`; the slices have the lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            fma::weighted_values(probs, stride, visible, values, head_dim, out)
        };
        return;
    }
    let rows = probs.chunks_exact(stride).zip(visible);
    for ((p, &vis), o) in rows.zip(out.chunks_exact_mut(head_dim)) {
        for (d, o) in o.iter_mut().enumerate() {
            *o = (0..vis).fold(0f32, |acc, j| {
                values[j * head_dim + d].to_f32().mul_add(p[j], acc)
            });
        }
    }
}

/// One chain of fused multiply-adds, in order, from zero.
fn dot(a: &[f32], b: &[f16]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0f32, |acc, (&x, &y)| x.mul_add(y.to_f32(), acc))
}

/// Whether the AVX2 kernels can run for heads of `head_dim`: AVX2, FMA and F16C, and a
/// head width of whole vectors.
pub(super) fn vector(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        head_dim.is_multiple_of(8)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = head_dim;
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use half::f16;

    /// Eight cache values from `at`, widened to f32.
    ///
    /// # Safety
    /// The CPU has F16C; eight values from `at` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(at: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    }

    /// Query rows handled per pass over the keys in `scores`.
    const ROWS: usize = 8;

    /// As `super::scores`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present; `head_dim` is a multiple of 8; `keys` holds `len` rows and
    /// `out` `q.len() / head_dim` rows of `len`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores(
        q: &[f32],
        keys: &[f16],
        len: usize,
        head_dim: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let rows = q.len() / head_dim;
        let full = len / 8 * 8;
        let scale_v = _mm256_set1_ps(scale);
        let zero = _mm256_setzero_ps();
        for r0 in (0..rows).step_by(ROWS) {
            let nr = ROWS.min(rows - r0);
            for j0 in (0..full).step_by(8) {
                let mut acc = [zero; ROWS];
                for d0 in (0..head_dim).step_by(8) {
                    let mut block = [zero; 8];
                    for (i, b) in block.iter_mut().enumerate() {
                        *b = load8(keys.as_ptr().add((j0 + i) * head_dim + d0));
                    }
                    // by_dim[c] holds dimension d0 + c of keys j0 .. j0 + 8.
                    let by_dim = transpose(block);
                    for (r, a) in acc.iter_mut().enumerate().take(nr) {
                        let qr = q.as_ptr().add((r0 + r) * head_dim + d0);
                        for (c, k) in by_dim.iter().enumerate() {
                            *a = _mm256_fmadd_ps(_mm256_set1_ps(*qr.add(c)), *k, *a);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate().take(nr) {
                    let s = _mm256_mul_ps(*a, scale_v);
                    _mm256_storeu_ps(out.as_mut_ptr().add((r0 + r) * len + j0), s);
                }
            }
            for j in full..len {
                let k = &keys[j * head_dim..][..head_dim];
                for r in r0..r0 + nr {
                    out[r * len + j] = super::dot(&q[r * head_dim..][..head_dim], k) * scale;
                }
            }
        }
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
    pub(super) unsafe fn weighted_values(
        probs: &[f32],
        stride: usize,
        visible: &[usize],
        values: &[f16],
        head_dim: usize,
        out: &mut [f32],
    ) {
        for (r, &vis) in visible.iter().enumerate() {
            let p = &probs[r * stride..][..vis];
            let o = &mut out[r * head_dim..][..head_dim];
            let mut d0 = 0;
            while d0 + 64 <= head_dim {
                columns::<8>(p, values, head_dim, d0, o);
                d0 += 64;
            }
            match (head_dim - d0) / 8 {
                1 => columns::<1>(p, values, head_dim, d0, o),
                2 => columns::<2>(p, values, head_dim, d0, o),
                3 => columns::<3>(p, values, head_dim, d0, o),
                4 => columns::<4>(p, values, head_dim, d0, o),
                5 => columns::<5>(p, values, head_dim, d0, o),
                6 => columns::<6>(p, values, head_dim, d0, o),
                7 => columns::<7>(p, values, head_dim, d0, o),
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
    unsafe fn columns<const V: usize>(
        probs: &[f32],
        values: &[f16],
        head_dim: usize,
        d0: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); V];
        for (j, &pj) in probs.iter().enumerate() {
            let pj = _mm256_set1_ps(pj);
            let vj = values.as_ptr().add(j * head_dim + d0);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(load8(vj.add(8 * i)), pj, *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(d0 + 8 * i), *a);
        }
    }

    /// The 8x8 transpose: lane `r` of output `c` is lane `c` of input `r`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn transpose(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }
}
