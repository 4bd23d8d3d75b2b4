//! Activations quantized to signed 8-bit blocks of 32, value for value as candle's
//! `from_float` for Q8_0 and Q8_1 does it on x86. Every quantized product runs this before
//! its rows are split across workers, so its speed counts once per matmul: candle's scalar
//! loop (a `roundf` call per value) took 6% of a batch-16 step; one 256-bit block at a time
//! 3.5-3.7% (with handing the blocks out); sixteen blocks at a time on 512-bit registers
//! (`quantize_blocks`) 2.5-2.7%, most of it now reading activations the other core wrote.

use std::ops::Range;

use half::f16;

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

/// `run(blocks)` over the blocks of `n` activation rows of `per_row` blocks: shared out
/// across candle's pool from [`POOLED_ROWS`] in runs of [`RUN`] blocks (the last one
/// shorter), which may cross rows, else one run on the calling thread. Runs of whole rows
/// left two blocks of each 18-block row of SmolLM2 to the one-block kernel.
pub(crate) fn each_run(n: usize, per_row: usize, run: impl Fn(Range<usize>) + Sync) {
    let blocks = n * per_row;
    if n < POOLED_ROWS {
        return run(0..blocks);
    }
    crate::split::in_ranges(blocks.div_ceil(RUN), |runs| {
        run(RUN * runs.start..blocks.min(RUN * runs.end));
    });
}

/// Blocks the 512-bit kernel quantizes at once.
pub(crate) const RUN: usize = 16;

/// Blocks of 32 values, each quantized as [`quantize_block`] quantizes it: block `b`'s values
/// into `qs[QK * b..]`, its scale into `d[b]` and the sum of its quantized values into
/// `sums[b]`. Sixteen at a time where the CPU has AVX-512, the same bytes.
pub(crate) fn quantize_blocks(xs: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i32]) {
    let blocks = d.len();
    assert!(
        xs.len() == blocks * QK && qs.len() == blocks * QK && sums.len() == blocks,
        "blocks of 32 values, a scale and a sum each"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            while done + RUN <= blocks {
                let (x, q) = (&xs[QK * done..], &mut qs[QK * done..]);
                // SAFETY: AVX-512F is present, checked just above; `RUN` blocks remain
                // from `done`, checked by the loop.
                unsafe { avx512::quantize_run(x, q, &mut d[done..], &mut sums[done..]) };
                done += RUN;
            }
        }
    }
    for b in done..blocks {
        (d[b], sums[b]) = quantize_block(&xs[QK * b..][..QK], &mut qs[QK * b..][..QK]);
    }
}

/// Q8_1's scales from blocks' scales `d` and sums, as candle's `BlockQ8_1` stores them:
/// each scale rounded through f16 in place, and `s[b] = f16(f16(sums[b]) * d[b])`.
pub(crate) fn q81_scales(d: &mut [f32], sums: &[i32], s: &mut [f32]) {
    assert!(
        sums.len() == d.len() && s.len() == d.len(),
        "a scale and a sum a block"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            while done + RUN <= d.len() {
                // SAFETY: AVX-512F is present, checked just above; `RUN` values remain in
                // each from `done`, checked by the loop.
                unsafe { avx512::q81_scales(&mut d[done..], &sums[done..], &mut s[done..]) };
                done += RUN;
            }
        }
    }
    for b in done..d.len() {
        let d16 = f16::from_f32(d[b]);
        d[b] = d16.to_f32();
        s[b] = (f16::from_f32(sums[b] as f32) * d16).to_f32();
    }
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
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

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

    /// Blocks that quantize at the edges: zeros, ties, values no model should make, and
    /// two thousand of random scales.
    fn blocks() -> Vec<Vec<f32>> {
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
        for seed in 0..2000u64 {
            let scale = (seed * 7919 % 1000) as f32 / 10.0 + 1e-3;
            blocks.push(testing::xorshift_data(QK, seed, scale));
        }
        blocks
    }

    /// A NaN scale is the same NaN either way, not the same bits.
    fn scale_bits(d: f32) -> u32 {
        if d.is_nan() {
            u32::MAX
        } else {
            d.to_bits()
        }
    }

    #[test]
    fn equals_candles_scalar_loop_value_for_value() {
        for xs in &blocks() {
            let (mut want, mut got) = ([0i8; QK], [0i8; QK]);
            let a = scalar_quantize_block(xs, &mut want);
            let b = quantize_block(xs, &mut got);
            assert_eq!(
                (scale_bits(a.0), a.1, want),
                (scale_bits(b.0), b.1, got),
                "{xs:?}"
            );
        }
    }

    /// Every block lands in every lane of a 512-bit run, and runs end with the blocks left
    /// over, which take the one-block path.
    #[test]
    fn runs_of_blocks_equal_the_scalar_loop_block_for_block() {
        let blocks = blocks();
        for skip in 0..RUN {
            let xs: Vec<f32> = blocks[skip..].concat();
            let n = blocks.len() - skip;
            let (mut qs, mut d, mut sums) = (vec![0i8; xs.len()], vec![0f32; n], vec![0; n]);
            quantize_blocks(&xs, &mut qs, &mut d, &mut sums);
            for (b, x) in blocks[skip..].iter().enumerate() {
                let mut want = [0i8; QK];
                let (wd, ws) = scalar_quantize_block(x, &mut want);
                let got = (scale_bits(d[b]), sums[b], &qs[QK * b..][..QK]);
                assert_eq!((scale_bits(wd), ws, &want[..]), got, "{x:?}");
            }
        }
    }

    /// Q8_1's scales as `half` rounds them one at a time, over runs and the values left.
    #[test]
    fn q81_scales_round_as_half_does() {
        let mut rng = crate::fuzz::Rng(11);
        let n = 3 * RUN + 5;
        let d: Vec<f32> = (0..n)
            .map(|i| match i % 4 {
                0 => 0.0,
                1 => rng.below(1 << 20) as f32 * 1e-9,
                2 => rng.below(1 << 20) as f32 * 1e-3,
                _ => 7e4 + rng.below(1000) as f32,
            })
            .collect();
        let sums: Vec<i32> = (0..n).map(|_| rng.below(8191) as i32 - 4095).collect();
        let (mut got_d, mut got_s) = (d.clone(), vec![0f32; n]);
        q81_scales(&mut got_d, &sums, &mut got_s);
        for b in 0..n {
            let d16 = f16::from_f32(d[b]);
            let s = (f16::from_f32(sums[b] as f32) * d16).to_f32();
            let want = (d16.to_f32().to_bits(), scale_bits(s));
            assert_eq!(
                want,
                (got_d[b].to_bits(), scale_bits(got_s[b])),
                "block {b}"
            );
        }
    }
}
