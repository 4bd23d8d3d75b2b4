//! Activations quantized to signed 8-bit blocks of 32, value for value as candle's
//! `from_float` for Q8_0 and Q8_1 does it on x86. Both quantized kernels run this on the
//! calling thread before the rows are split across workers, so its speed counts once per
//! matmul: candle's scalar loop (a `roundf` call per value) took 6% of a batch-16 step.

/// Values per block.
pub(crate) const QK: usize = 32;

/// True where the CPU has AVX-512 VNNI for 256-bit vectors (Zen 4, Ice Lake and later): both
/// quantized kernels then sum their integers with `vpdpbusd`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_vnni() -> bool {
    is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
}

/// True where the CPU also has VNNI, and bytes, on 512-bit vectors: the kernels then take
/// two groups of weight rows at once. Where those registers run at full width (Zen 5),
/// they multiply twice what 256-bit ones do.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_vnni_512() -> bool {
    has_vnni() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// Rows from which a product quantizes its activations across the pool: below it, handing
/// the rows out costs more than quantizing them on the calling thread.
pub(crate) const POOLED_ROWS: usize = 8;

/// `block(b)` for each block of `n` activation rows of `per_row` blocks: the rows shared
/// out across candle's pool from [`POOLED_ROWS`], else all on the calling thread.
pub(crate) fn each_block(n: usize, per_row: usize, block: impl Fn(usize) + Sync) {
    if n < POOLED_ROWS {
        (0..n * per_row).for_each(block);
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(n, |rows| {
        (rows.start * per_row..rows.end * per_row).for_each(&block);
    });
}

/// Quantizes one block of 32 values into `qs`: returns the scale `max |x| / 127`, before
/// any rounding to f16, and the sum of the quantized values.
pub(crate) fn quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    assert!(xs.len() == QK && qs.len() == QK, "a block is 32 values");
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present, checked just above; the lengths are checked above.
            return unsafe { avx2::quantize_block(xs, qs) };
        }
    }
    scalar_quantize_block(xs, qs)
}

/// candle's loop.
fn scalar_quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = xs.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let d = amax / ((1 << 7) - 1) as f32;
    let id = if d != 0f32 { 1. / d } else { 0. };
    let mut sum = 0;
    for (q, &x) in qs.iter_mut().zip(xs) {
        *q = f32::round(x * id) as i8;
        sum += *q as i32;
    }
    (d, sum)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX2; `xs` and `qs` hold at least `QK` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
        let sign = _mm256_set1_ps(-0.0);
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xs.as_ptr().add(8 * i)));
        // `max(a, m)` is `m` where `a` is NaN, as `f32::max` passes NaNs over.
        let mut m = _mm256_setzero_ps();
        for &x in &v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, x), m);
        }
        // The lanes' largest: the order does not matter to a maximum of magnitudes.
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let d = amax / ((1 << 7) - 1) as f32;
        let id = _mm256_set1_ps(if d != 0f32 { 1. / d } else { 0. });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let ints = v.map(|x| {
            // `f32::round` rounds halves away from zero: truncate, then step one away from
            // zero where the dropped part is at least a half (`x - trunc(x)` is exact).
            let x = _mm256_mul_ps(x, id);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(x, t));
            let away = _mm256_or_ps(_mm256_and_ps(x, sign), one);
            let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), away);
            let r = _mm256_add_ps(t, step);
            // As `as i8` takes a float: NaN to 0 (a NaN or infinite value's; the products
            // of a scale that underflowed), the rest saturated, so that the conversion
            // meets only the integers a byte holds.
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            let r = _mm256_min_ps(
                _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
                _mm256_set1_ps(127.0),
            );
            _mm256_cvttps_epi32(r)
        });
        // The packs interleave the 128-bit lanes: four values of each vector in turn, the
        // low halves first; the permutation puts them back in order.
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, bytes);
        // Their sum: byte pairs times one into i16, i16 pairs into i32, then the lanes.
        let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
        let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(quads),
            _mm256_extracti128_si256::<1>(quads),
        );
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
        (d, sum)
    }
}

/// Inputs and candle's reference products for the kernels' tests.
#[cfg(test)]
pub(crate) mod testing {
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    /// Weights and activations with a spread of magnitudes and signs.
    pub fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32;
                (x - 1000.0) / 700.0 * if i % 7 == 0 { 3.0 } else { 1.0 }
            })
            .collect()
    }

    /// Values spread evenly over `-width / 2 .. width / 2` by a xorshift generator,
    /// deterministic per seed; unlike [`data`], neighbouring seeds give unrelated values.
    pub fn xorshift_data(n: usize, seed: u64, width: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * width
            })
            .collect()
    }

    /// A tensor's values, flattened.
    pub fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// How many values differ in any bit between two lists of the same length.
    pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
        assert_eq!(a.len(), b.len(), "lists of different lengths");
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    }

    /// candle's `x Wᵀ` for `x` of `n` rows of `cols`, flattened.
    pub fn candle_product(w: &QMatMul, x: &[f32], n: usize, cols: usize) -> Vec<f32> {
        let xt = Tensor::from_vec(x.to_vec(), (n, cols), &Device::Cpu).unwrap();
        w.forward(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equals_candles_scalar_loop_value_for_value() {
        let mut blocks: Vec<Vec<f32>> = vec![vec![0.0; QK], vec![-0.0; QK]];
        // Scales of 1 and 2, so that values land exactly on halves, of both signs.
        blocks.push(
            (0..QK)
                .map(|i| if i == 3 { 127.0 } else { i as f32 + 0.5 })
                .collect(),
        );
        blocks.push(
            (0..QK)
                .map(|i| if i == 0 { -254.0 } else { -(i as f32) - 1.0 })
                .collect(),
        );
        // Values no model should make, which must still quantize the same everywhere (a
        // KV cache's rows are these blocks): NaNs, infinities, subnormals, a value just
        // under a half, and scales that underflow.
        let odd = [
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            1e-40,
            -1e-45,
            0.499_999_97,
            3.4e38,
        ];
        for (i, &x) in odd.iter().enumerate() {
            blocks.push(
                (0..QK)
                    .map(|j| if j % 5 == i % 5 { x } else { j as f32 * 1e-3 })
                    .collect(),
            );
            blocks.push(
                (0..QK)
                    .map(|j| if j == i { x } else { 1e-44 * j as f32 })
                    .collect(),
            );
        }
        let mut s = 0x2545F4914F6CDD1Du64;
        for _ in 0..2000 {
            let scale = (s % 1000) as f32 / 10.0 + 1e-3;
            blocks.push(
                (0..QK)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
                    })
                    .collect(),
            );
        }
        for xs in &blocks {
            let (mut want, mut got) = ([0i8; QK], [0i8; QK]);
            let a = scalar_quantize_block(xs, &mut want);
            let b = quantize_block(xs, &mut got);
            // A NaN scale is the same NaN either way, not the same bits.
            let scale = |d: f32| if d.is_nan() { u32::MAX } else { d.to_bits() };
            assert_eq!((scale(a.0), a.1, want), (scale(b.0), b.1, got), "{xs:?}");
        }
    }
}
