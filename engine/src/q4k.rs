//! Q4_K weights on our Q4_1 kernel ([`Q41Matrix`]). A Q4_K super-block holds 256 weights in
//! eight blocks of 32, each weight `d * sc * q - dmin * m` for its 4-bit `q` and its block's
//! 6-bit scale `sc` and minimum `m`: a Q4_1 block with scale `d * sc` and minimum
//! `-(dmin * m)`. Both are exact in f32 (an f16 times a 6-bit integer), so the conversion at
//! load loses nothing: the kernel multiplies exactly the weights GGML dequantizes, and PD
//! gives colocated's tokens as on Q4_1. The price is memory: f32 scales and minimums for
//! each 32 weights, 0.75 bytes a weight against Q4_K's 0.5625.
//!
//! The activations are quantized as llama.cpp quantizes them for Q4_K: Q8_K, a scale per
//! 256 values ([`quantize_q8k`]). Q4_1's finer grid (a scale per 32) is nearer the
//! f32 product, but its roundings are not llama.cpp's: on the wide test model it chose
//! llama.cpp's second token, up to a nat behind its first, at 5 of 512 positions. With
//! llama.cpp's grid every miss is within the K-quants' near-tie of 0.75 nats, as candle's
//! Q4_K kernel's are (engine/tests/engine/llama_cpp.rs says why that bar is not 0.5).

use half::f16;

use crate::error::{EngineError, Result};
use crate::q4::{Activations, Block, Q41Matrix};

/// Weights in a Q4_K super-block.
pub(crate) const QK_K: usize = 256;
/// Bytes of one Q4_K super-block: `d` and `dmin` (f16), 12 bytes of packed 6-bit scales and
/// minimums, 128 bytes of nibbles.
const Q4K_BYTES: usize = 144;

/// GGML Q4_K data of a `[rows, cols]` tensor as a Q4_1 matrix of the same weights.
pub fn from_ggml(bytes: &[u8], rows: usize, cols: usize) -> Result<Q41Matrix> {
    if !cols.is_multiple_of(QK_K) || bytes.len() != rows * cols / QK_K * Q4K_BYTES {
        return Err(EngineError::InvalidInput(format!(
            "Q4_K data of {} bytes does not make a [{rows}, {cols}] matrix",
            bytes.len()
        )));
    }
    let blocks = bytes.chunks_exact(Q4K_BYTES).flat_map(super_block);
    Ok(Q41Matrix::from_blocks(rows, cols, blocks, Activations::Q8K))
}

/// Quantizes 256 values into `qs` as llama.cpp's Q8_K (`quantize_row_q8_K_ref`) does and
/// returns their scale: `-127 / max`, `max` the value of largest magnitude, each value
/// rounded half to even.
pub(crate) fn quantize_q8k(xs: &[f32], qs: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &x in xs {
        if x.abs() > amax {
            (amax, max) = (x.abs(), x);
        }
    }
    if amax == 0.0 {
        qs.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &x) in qs.iter_mut().zip(xs) {
        *q = ((iscale * x).round_ties_even() as i32).min(127) as i8;
    }
    1.0 / iscale
}

/// The eight Q4_1 blocks of one Q4_K super-block, in order.
fn super_block(sb: &[u8]) -> impl Iterator<Item = Block> + '_ {
    let d = f16::from_le_bytes([sb[0], sb[1]]).to_f32();
    let dmin = f16::from_le_bytes([sb[2], sb[3]]).to_f32();
    let scales: &[u8; 12] = sb[4..16].try_into().expect("12 bytes of scales");
    // Blocks 2c and 2c + 1 are the low and high nibbles of the same 32 bytes, weight `l`
    // of each in byte `l`; a Q4_1 block keeps weights `i` and `i + 16` in byte `i`.
    let chunks = &sb[16..];
    (0..8).map(move |j| {
        let (sc, m) = scale_min(j, scales);
        let chunk = &chunks[j / 2 * 32..][..32];
        let nibble = |l: usize| {
            if j % 2 == 0 {
                chunk[l] & 0x0F
            } else {
                chunk[l] >> 4
            }
        };
        Block {
            d: d * f32::from(sc),
            m: -(dmin * f32::from(m)),
            qs: std::array::from_fn(|i| nibble(i) | (nibble(i + 16) << 4)),
        }
    })
}

/// Block `j`'s 6-bit scale and minimum, as GGML packs them (`get_scale_min_k4`): blocks 0-3
/// in the low six bits of bytes `j` and `j + 4`; blocks 4-7 in the nibbles of byte `j + 4`
/// with their top two bits in the high bits of bytes `j - 4` and `j`.
fn scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act_quant::testing::{candle_product, data};
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Tensor};

    /// Rows past whole groups of eight, and two super-blocks a row.
    const ROWS: usize = 19;
    const COLS: usize = 512;

    fn quantized(seed: u32) -> QTensor {
        let w = Tensor::from_vec(data(ROWS * COLS, seed), (ROWS, COLS), &Device::Cpu).unwrap();
        QTensor::quantize(&w, GgmlDType::Q4K).unwrap()
    }

    #[test]
    fn holds_exactly_the_weights_ggml_dequantizes() {
        let q = quantized(3);
        let ours = from_ggml(&q.data().unwrap(), ROWS, COLS).unwrap();
        let want: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        for (r, want) in want.iter().enumerate() {
            assert_eq!(&ours.dequantized_row(r), want, "row {r}");
        }
    }

    #[test]
    fn multiplies_within_rounding_of_candles_q4k_product() {
        let q = quantized(5);
        let ours = from_ggml(&q.data().unwrap(), ROWS, COLS).unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        for n in [1, 4, 9] {
            let x = data(n * COLS, 11 + n as u32);
            let (got, want) = (ours.matmul(&x, n), candle_product(&reference, &x, n, COLS));
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                // The same activations, summed in another order.
                assert!((g - w).abs() <= scale * 1e-4, "{g} against candle's {w}");
            }
            // A row's outputs do not depend on the rows beside it: PD gives colocated's.
            for (y, xs) in x.chunks_exact(COLS).enumerate() {
                assert_eq!(
                    ours.matmul(xs, 1)[..],
                    got[y * ROWS..][..ROWS],
                    "row {y} of {n}"
                );
            }
        }
    }

    #[test]
    fn refuses_data_of_the_wrong_size() {
        assert!(from_ggml(&[0; 143], 1, 256).is_err());
        assert!(from_ggml(&[0; 144], 1, 255).is_err());
    }
}
