//! Attention for a decode step (one new row per sequence), in one pass per K/V head, giving
//! exactly the values of the general path in `Model::attend`. There candle runs two `gemm`
//! products with a scale and a softmax between them; at batch 1 that was 29% of a step
//! (SmolLM2, 128 to 400 keys): per layer and head, two products that each pack their
//! operands into fresh buffers, and three more tensors allocated and filled.
//!
//! The values stay the same because, for the shapes [`applies`] accepts, `gemm` (0.19, its
//! FMA kernels) sums each score as one chain of fused multiply-adds over the head
//! dimension, in order, from zero; and each output value as such chains over the keys in
//! runs of 512, the runs added in order. The scale is candle's `x * scale + 0`, and the
//! softmax is the prompt path's own (`masked_softmax::softmax_visible`).

use std::sync::OnceLock;

use candle_core::{CpuStorage, Storage, Tensor};

use crate::error::{EngineError, Result};
use crate::masked_softmax::softmax_visible;

/// Keys per run of the output sums: `gemm`'s depth block when both sides are at most 64.
const RUN: usize = 512;

/// Whether [`decode`] gives the general path's values for `group` query heads per K/V
/// head over `keys` keys of `head_dim`. Elsewhere `gemm` takes other paths: a matrix-vector
/// product for one row, its horizontal kernel for products of at most 256 values (the
/// scores of short contexts), or a depth block that depends on the cache sizes (heads over
/// 64 wide, past 512 keys).
pub(crate) fn applies(group: usize, keys: usize, head_dim: usize) -> bool {
    fma_available()
        && group >= 2
        && keys >= 3
        && group * keys > 256
        && head_dim.is_multiple_of(8)
        && head_dim <= RUN
        && ((head_dim <= 64 && group <= 64) || keys <= RUN)
}

fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Attention of one new row: `q` is `(heads, 1, head_dim)`, already rotated; `keys` and
/// `values` are `(kv_heads, len, head_dim)` views of the cache, rows contiguous. Returns
/// `(1, heads * head_dim)`. With `spread`, the K/V heads are shared out over candle's pool
/// (for a lone sequence: the pool's workers would otherwise wait); each head's values do not
/// depend on where it runs. Call only where [`applies`] holds.
pub(crate) fn decode(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    scale: f64,
    spread: bool,
) -> Result<Tensor> {
    let (heads, _, hd) = q.dims3()?;
    let (kv_heads, len, _) = keys.dims3()?;
    let q = q.contiguous()?;
    let (q_store, q_layout) = q.storage_and_layout();
    let q = &f32_data(&q_store)?[q_layout.start_offset()..][..heads * hd];
    let (k_store, k_layout) = keys.storage_and_layout();
    let (v_store, v_layout) = values.storage_and_layout();
    let k = Heads::new(f32_data(&k_store)?, k_layout, kv_heads, len, hd)?;
    let v = Heads::new(f32_data(&v_store)?, v_layout, kv_heads, len, hd)?;
    let group = heads / kv_heads;
    let head = |h: usize| {
        let q = &q[h * group * hd..][..group * hd];
        let mut out = vec![0f32; group * hd];
        let mut probs = vec![0f32; group * len];
        // SAFETY: `applies` found AVX2 and FMA; the slices have the lengths the kernels read.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            fma::scores(q, k.head(h), len, hd, scale as f32, &mut probs);
            softmax_rows(&mut probs, len);
            fma::weighted_values(&probs, v.head(h), len, hd, &mut out);
        }
        out
    };
    let outs: Vec<Vec<f32>> = if spread {
        let done: Vec<OnceLock<Vec<f32>>> = (0..kv_heads).map(|_| OnceLock::new()).collect();
        candle_core::utils::barrier_pool().execute_chunked(kv_heads, |range| {
            for h in range {
                let _ = done[h].set(head(h));
            }
        });
        done.into_iter()
            .map(|d| d.into_inner().expect("every head ran"))
            .collect()
    } else {
        (0..kv_heads).map(head).collect()
    };
    Ok(Tensor::from_vec(
        outs.concat(),
        (1, heads * hd),
        keys.device(),
    )?)
}

fn f32_data(storage: &Storage) -> Result<&[f32]> {
    match storage {
        Storage::Cpu(CpuStorage::F32(data)) => Ok(data),
        _ => Err(EngineError::InvalidInput(
            "decode attention runs on f32 tensors in CPU memory".into(),
        )),
    }
}

/// The K or V heads of one layer: head `h` is `len` rows of `head_dim` from `h * stride`.
struct Heads<'a> {
    data: &'a [f32],
    stride: usize,
    len: usize,
    head_dim: usize,
}

impl<'a> Heads<'a> {
    fn new(
        data: &'a [f32],
        layout: &candle_core::Layout,
        heads: usize,
        len: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let stride = layout.stride();
        let start = layout.start_offset();
        let fits = stride.len() == 3
            && stride[2] == 1
            && stride[1] == head_dim
            && stride[0] >= len * head_dim
            && start + (heads - 1) * stride[0] + len * head_dim <= data.len();
        if !fits {
            return Err(EngineError::KvCache(
                "cache view is not rows of contiguous heads".into(),
            ));
        }
        Ok(Self {
            data: &data[start..],
            stride: stride[0],
            len,
            head_dim,
        })
    }

    fn head(&self, h: usize) -> &'a [f32] {
        &self.data[h * self.stride..][..self.len * self.head_dim]
    }
}

/// The prompt path's softmax on each row of `len` values, all of them visible.
fn softmax_rows(rows: &mut [f32], len: usize) {
    for row in rows.chunks_exact_mut(len) {
        softmax_visible(row, len);
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use super::RUN;

    /// Query rows handled per pass over the keys.
    const ROWS: usize = 8;

    /// `out[r * len + j] = (q_r · k_j) * scale + 0` for each query row `r` of `q`, the dot
    /// product one fused multiply-add chain over the head dimension.
    ///
    /// # Safety
    /// AVX2 and FMA are present; `head_dim` is a multiple of 8; `keys` holds `len` rows and
    /// `out` `q.len() / head_dim` rows of `len`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores(
        q: &[f32],
        keys: &[f32],
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
                        *b = _mm256_loadu_ps(keys.as_ptr().add((j0 + i) * head_dim + d0));
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
                    let s = _mm256_add_ps(_mm256_mul_ps(*a, scale_v), zero);
                    _mm256_storeu_ps(out.as_mut_ptr().add((r0 + r) * len + j0), s);
                }
            }
            for j in full..len {
                let k = &keys[j * head_dim..][..head_dim];
                for r in r0..r0 + nr {
                    let qr = &q[r * head_dim..][..head_dim];
                    let dot = qr.iter().zip(k).fold(0f32, |a, (&x, &y)| x.mul_add(y, a));
                    out[r * len + j] = dot * scale + 0.0;
                }
            }
        }
    }

    /// `out[r] = sum over j of probs[r * len + j] * values_j`, each value a fused
    /// multiply-add chain over the keys in runs of [`RUN`], the runs added in order.
    ///
    /// # Safety
    /// As for [`scores`]; `out` holds `probs.len() / len` rows of `head_dim`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_values(
        probs: &[f32],
        values: &[f32],
        len: usize,
        head_dim: usize,
        out: &mut [f32],
    ) {
        const WIDTH: usize = 64;
        let zero = _mm256_setzero_ps();
        for (p, o) in probs.chunks_exact(len).zip(out.chunks_exact_mut(head_dim)) {
            for d0 in (0..head_dim).step_by(WIDTH) {
                let nv = WIDTH.min(head_dim - d0) / 8;
                let o = o.as_mut_ptr().add(d0);
                for run in (0..len).step_by(RUN) {
                    let mut acc = [zero; WIDTH / 8];
                    for (j, &pj) in p.iter().enumerate().skip(run).take(RUN) {
                        let pj = _mm256_set1_ps(pj);
                        let vj = values.as_ptr().add(j * head_dim + d0);
                        for (i, a) in acc.iter_mut().enumerate().take(nv) {
                            *a = _mm256_fmadd_ps(_mm256_loadu_ps(vj.add(8 * i)), pj, *a);
                        }
                    }
                    for (i, a) in acc.iter().enumerate().take(nv) {
                        let sum = if run == 0 {
                            *a
                        } else {
                            _mm256_add_ps(*a, _mm256_loadu_ps(o.add(8 * i)))
                        };
                        _mm256_storeu_ps(o.add(8 * i), sum);
                    }
                }
            }
        }
    }

    /// The 8x8 transpose: lane `r` of output `c` is lane `c` of input `r`.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
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

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::act_quant::testing::{bits_differ, values};

    /// `Model::attend`'s general path for one new row.
    fn general(q: &Tensor, keys: &Tensor, values: &Tensor, scale: f64) -> Tensor {
        let (heads, _, hd) = q.dims3().unwrap();
        let kv_heads = keys.dim(0).unwrap();
        let q = q.reshape((kv_heads, heads / kv_heads, hd)).unwrap();
        let probs = q.matmul(&keys.t().unwrap()).unwrap();
        let len = keys.dim(1).unwrap();
        probs
            .inplace_op1(&crate::masked_softmax::MaskedSoftmax {
                scale,
                rows: 1,
                first_pos: len - 1,
            })
            .unwrap();
        probs
            .matmul(values)
            .unwrap()
            .reshape((1, heads * hd))
            .unwrap()
    }

    /// Values spread like activations, deterministic per seed.
    fn data(n: usize, seed: u64) -> Vec<f32> {
        crate::act_quant::testing::xorshift_data(n, seed, 4.0)
    }

    #[test]
    fn equals_the_gemm_path_bit_for_bit() {
        if !fma_available() {
            eprintln!("no AVX2/FMA: decode attention is not used on this CPU");
            return;
        }
        let dev = Device::Cpu;
        // (kv heads, group, head dim, keys): SmolLM2's and Qwen2.5's shapes, runs of 512
        // with a partial last one, key counts off the multiple of 8, nine rows per head.
        let shapes = [
            (3, 3, 64, 86),
            (3, 3, 64, 129),
            (3, 3, 64, 512),
            (3, 3, 64, 513),
            (3, 3, 64, 1100),
            (2, 7, 128, 301),
            (2, 7, 128, 512),
            (1, 9, 64, 40),
            (4, 2, 32, 2047),
        ];
        for (i, &(kv, group, hd, len)) in shapes.iter().enumerate() {
            assert!(applies(group, len, hd), "shape {i} should use the kernel");
            // Cache storage with room past `len`, viewed as the model views it.
            let cap = len + 37;
            let seed = i as u64 * 3;
            let k = Tensor::from_vec(data(kv * cap * hd, seed), (kv, cap, hd), &dev).unwrap();
            let v = Tensor::from_vec(data(kv * cap * hd, seed + 1), (kv, cap, hd), &dev).unwrap();
            let (k, v) = (k.narrow(1, 0, len).unwrap(), v.narrow(1, 0, len).unwrap());
            let q = Tensor::from_vec(data(kv * group * hd, seed + 2), (kv * group, 1, hd), &dev)
                .unwrap();
            let scale = 1.0 / (hd as f64).sqrt();
            let ours = values(&decode(&q, &k, &v, scale, i % 2 == 0).unwrap());
            let differ = bits_differ(&ours, &values(&general(&q, &k, &v, scale)));
            assert_eq!(
                differ,
                0,
                "shape {:?}: {differ} of {} values differ",
                (kv, group, hd, len),
                ours.len()
            );
        }
    }

    #[test]
    fn leaves_other_shapes_to_the_general_path() {
        assert!(!applies(1, 1000, 64), "one row per head: gemm's gemv");
        assert!(!applies(3, 85, 64), "255 scores: gemm's horizontal kernel");
        assert!(
            !applies(2, 513, 128),
            "a depth block that depends on the cache"
        );
        assert!(!applies(4, 300, 60), "a head width off the vector width");
    }
}
