//! A cache row's values as Q8_0 blocks, as the products quantize their activations.

use half::f16;

use super::{Q8_0_BYTES, Q8_0_VALUES};
use crate::act_quant;

/// `values` as Q8_0 blocks into `out`: each block's scale `d` is its largest magnitude over
/// 127, stored as f16, and each value `round(x / d)` (half away from zero), computed with
/// the unrounded `1 / d`, as GGML's reference `quantize_row_q8_0` and candle's
/// `BlockQ8_0::from_float` compute them: `act_quant::quantize_block`, in vectors where the
/// CPU has them (the same bytes). A block of zeros has scale 0.
pub(crate) fn quantize_row(values: &[f32], out: &mut [u8]) {
    for (x, block) in values
        .chunks_exact(Q8_0_VALUES)
        .zip(out.chunks_exact_mut(Q8_0_BYTES))
    {
        let (scale, q) = block.split_at_mut(2);
        let (d, _) = act_quant::quantize_block(x, bytemuck::cast_slice_mut(q));
        scale.copy_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;

    /// The quantizer writes candle's Q8_0 blocks byte for byte: zeros, ties and a block
    /// with one value far past the rest included.
    #[test]
    fn rows_quantize_as_candles_blocks() {
        let mut rng = crate::fuzz::Rng(7);
        let mut values: Vec<f32> = (0..32 * 64)
            .map(|_| (rng.below(20_001) as f32 - 10_000.0) / 997.0)
            .collect();
        values[..32].fill(0.0);
        // Scale 1: every value a tie between two integers.
        for (i, v) in values[32..64].iter_mut().enumerate() {
            *v = i as f32 - 16.5;
        }
        values[63] = 127.0;
        values[64..96].fill(1e-3);
        values[70] = -6.0e4;
        let mut ours = vec![0u8; values.len() / 32 * 34];
        quantize_row(&values, &mut ours);
        let t = Tensor::from_vec(values.clone(), (values.len() / 32, 32), &Device::Cpu).unwrap();
        let theirs = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        let theirs = theirs.data().unwrap();
        for (b, (a, c)) in ours
            .chunks_exact(34)
            .zip(theirs.chunks_exact(34))
            .enumerate()
        {
            assert_eq!(a, c, "block {b}");
        }
        assert_eq!(ours.len(), theirs.len());
        assert_eq!(ours[34 + 2 + 31], 127, "the largest value is 127");
    }
}
