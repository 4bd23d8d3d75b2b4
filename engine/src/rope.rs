//! The cos/sin tables of rotary embeddings with the scaling the model's files say,
//! computed in f32 step for step as transformers computes them (`modeling_rope_utils`):
//! the reference's angles, not an approximation of them.

use candle_core::{Device, Tensor};
use text::{ModelConfig, RopeScaling, RopeStyle};

use crate::error::Result;

/// Each frequency pair's inverse frequency, and the factor cos and sin are scaled by.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Frequencies {
    pub(crate) inv_freq: Vec<f32>,
    pub(crate) attention_factor: f32,
}

impl Frequencies {
    /// The frequencies of `cfg`; `divisors` (a GGUF file's `rope_freqs`, one per pair)
    /// divide them, as llama.cpp divides its angles by them.
    pub(crate) fn of(cfg: &ModelConfig, divisors: Option<&[f32]>) -> Self {
        Self::of_rope(cfg.rope_theta, &cfg.rope_scaling, cfg.rotary_dim, divisors)
    }

    /// The frequencies of a base and scaling for heads of `dim`, divided by `divisors`.
    pub(crate) fn of_rope(
        base: f64,
        scaling: &RopeScaling,
        dim: usize,
        divisors: Option<&[f32]>,
    ) -> Self {
        let mut f = match scaling {
            RopeScaling::None => Self::plain(base, dim),
            RopeScaling::LongRope {
                factors,
                attention_factor,
                ..
            } => Self {
                inv_freq: longrope(base as f32, dim, factors),
                attention_factor: *attention_factor as f32,
            },
            RopeScaling::Linear { factor } => {
                let mut f = Self::plain(base, dim);
                f.inv_freq.iter_mut().for_each(|x| *x /= *factor as f32);
                f
            }
            &RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Self {
                inv_freq: llama3(
                    plain(base as f32, dim),
                    factor as f32,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                ),
                attention_factor: 1.0,
            },
            &RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                truncate,
            } => {
                let ramp = Ramp::yarn(
                    base,
                    dim,
                    beta_fast,
                    beta_slow,
                    original_max_position_embeddings,
                    truncate,
                );
                Self {
                    inv_freq: yarn(base as f32, dim, factor as f32, ramp),
                    attention_factor: attention_factor as f32,
                }
            }
        };
        if let Some(d) = divisors {
            f.inv_freq.iter_mut().zip(d).for_each(|(x, d)| *x /= d);
        }
        f
    }

    fn plain(base: f64, dim: usize) -> Self {
        Self {
            inv_freq: plain(base as f32, dim),
            attention_factor: 1.0,
        }
    }

    /// cos and sin of every position's angles, `(positions, dim / 2)` each.
    pub(crate) fn tables(&self, positions: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos() * self.attention_factor);
                sin.push(a.sin() * self.attention_factor);
            }
        }
        Ok((
            Tensor::from_vec(cos, (positions, half), device)?,
            Tensor::from_vec(sin, (positions, half), device)?,
        ))
    }
}

/// Plain RoPE's inverse frequencies: `1 / base^(2i / dim)`.
fn plain(base: f32, dim: usize) -> Vec<f32> {
    (0..dim)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
        .collect()
}

/// LongRoPE's: `1 / (factor_i * base^(2i / dim))`, in transformers' order of operations;
/// plain where the factors are a GGUF file's (empty here, divided by at load).
fn longrope(base: f32, dim: usize, factors: &[f64]) -> Vec<f32> {
    if factors.is_empty() {
        return plain(base, dim);
    }
    (0..dim)
        .step_by(2)
        .zip(factors)
        .map(|(i, &f)| 1.0 / (f as f32 * base.powf(i as f32 / dim as f32)))
        .collect()
}

/// Llama 3.1's: long wavelengths slowed by `factor`, short ones kept, a ramp between.
fn llama3(inv: Vec<f32>, factor: f32, low: f64, high: f64, original: f64) -> Vec<f32> {
    let low_wavelen = (original / low) as f32;
    let high_wavelen = (original / high) as f32;
    let span = (high - low) as f32;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    inv.into_iter()
        .map(|f| {
            let wavelen = two_pi / f;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            if wavelen < high_wavelen || wavelen > low_wavelen {
                return scaled;
            }
            let smooth = (original as f32 / wavelen - low as f32) / span;
            (1.0 - smooth) * scaled / factor + smooth * scaled
        })
        .collect()
}

/// YaRN's ramp over the frequency pairs: from `low` (extrapolated, kept) to `high`
/// (interpolated, scaled).
#[derive(Debug, Clone, Copy)]
struct Ramp {
    low: f64,
    high: f64,
}

impl Ramp {
    /// The pairs between `beta_fast` and `beta_slow` rotations over the original context.
    fn yarn(
        base: f64,
        dim: usize,
        beta_fast: f64,
        beta_slow: f64,
        original: f64,
        truncate: bool,
    ) -> Self {
        let pair = |rotations: f64| {
            dim as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let (mut low, mut high) = (pair(beta_fast), pair(beta_slow));
        if truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        Self { low, high }
    }

    /// How far pair `i` is interpolated, in [0, 1].
    fn at(self, i: usize) -> f32 {
        ((i as f32 - self.low as f32) / (self.high - self.low) as f32).clamp(0.0, 1.0)
    }
}

/// YaRN's inverse frequencies: each pair's blend of the plain one and the one slowed by
/// `factor`.
fn yarn(base: f32, dim: usize, factor: f32, ramp: Ramp) -> Vec<f32> {
    (0..dim)
        .step_by(2)
        .enumerate()
        .map(|(pair, i)| {
            let pos_freq = base.powf(i as f32 / dim as f32);
            let extrapolated = 1.0 / pos_freq;
            let interpolated = 1.0 / (factor * pos_freq);
            let kept = 1.0 - ramp.at(pair);
            interpolated * (1.0 - kept) + extrapolated * kept
        })
        .collect()
}

/// One position's `heads` heads of `x` (`heads * head_dim` values) rotated into `out`: the
/// leading `cos.len() * 2` dimensions of each head by the position's `cos` and `sin`, the
/// others passed through; pairs `(2j, 2j + 1)` for `RopeStyle::Interleaved`, `(j, j + r/2)`
/// for `RopeStyle::Half`. The same products and differences as candle's `rope_i` and
/// `rope`, so the same bits: a decode step's rows rotated here and a prompt's by candle's
/// ops give one cache.
pub(crate) fn rotate_row(
    x: &[f32],
    head_dim: usize,
    style: RopeStyle,
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
) {
    let half = cos.len();
    assert!(sin.len() == half && 2 * half <= head_dim && x.len() == out.len());
    for (x, out) in x.chunks_exact(head_dim).zip(out.chunks_exact_mut(head_dim)) {
        for (j, (&c, &s)) in cos.iter().zip(sin).enumerate() {
            let (i1, i2) = match style {
                RopeStyle::Interleaved => (2 * j, 2 * j + 1),
                RopeStyle::Half => (j, j + half),
            };
            out[i1] = x[i1] * c - x[i2] * s;
            out[i2] = x[i1] * s + x[i2] * c;
        }
        out[2 * half..].copy_from_slice(&x[2 * half..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frequencies of Llama 3's base for heads of 128 under `scaling`.
    fn of(scaling: RopeScaling, divisors: Option<&[f32]>) -> Frequencies {
        Frequencies::of_rope(500_000.0, &scaling, 128, divisors)
    }

    /// llama.cpp's converter writes Llama 3's scaling as one divisor per frequency
    /// (`rope_freqs`): 1 for short wavelengths, the factor for long ones, the inverse of
    /// transformers' blend between. Divided by them, plain frequencies must be the llama3
    /// ones, so a GGUF file and its Hugging Face folder rotate alike.
    #[test]
    fn llama_cpp_rope_freqs_are_the_llama3_scaling() {
        let (factor, low, high, original) = (8.0, 1.0, 4.0, 8192.0);
        let llama3 = of(
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            },
            None,
        );
        let divisors: Vec<f32> = plain(500_000.0, 128)
            .iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f64::from(f);
                if wavelen < original / high {
                    1.0
                } else if wavelen > original / low {
                    factor as f32
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                }
            })
            .collect();
        let converted = of(RopeScaling::None, Some(&divisors));
        let kinds = divisors
            .iter()
            .map(|d| d.to_bits())
            .collect::<std::collections::HashSet<_>>();
        assert!(
            kinds.len() > 3,
            "short, long and blended wavelengths are all covered"
        );
        for (a, b) in llama3.inv_freq.iter().zip(&converted.inv_freq) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{a} vs {b}");
        }
    }

    #[test]
    fn linear_scaling_divides_every_frequency_and_yarn_scales_cos_and_sin() {
        let plain = of(RopeScaling::None, None);
        let linear = of(RopeScaling::Linear { factor: 4.0 }, None);
        for (p, l) in plain.inv_freq.iter().zip(&linear.inv_freq) {
            assert_eq!(p / 4.0, *l);
        }
        let yarn = of(
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 64.0,
                attention_factor: 1.25,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
            },
            None,
        );
        // The fastest pairs keep their frequency, the slowest are interpolated.
        assert_eq!(yarn.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((yarn.inv_freq[last] - plain.inv_freq[last] / 4.0).abs() < 1e-12);
        let (cos, _) = yarn.tables(1, &Device::Cpu).unwrap();
        assert_eq!(cos.to_vec2::<f32>().unwrap()[0][0], 1.25, "cos 0, scaled");
    }

    /// A row rotated here against candle's `rope_i` and `rope` over the same row (the
    /// per-sequence tables of a decode step), bit for bit, with dimensions past the
    /// rotary ones passed through.
    #[test]
    fn a_rotated_row_has_candles_bits() {
        use crate::act_quant::testing::{bits_differ, xorshift_data};
        let (heads, head_dim, rotary) = (3, 64, 48);
        let x = xorshift_data(heads * head_dim, 7, 8.0);
        let cos = xorshift_data(rotary / 2, 8, 1.0);
        let sin = xorshift_data(rotary / 2, 9, 1.0);
        for style in [RopeStyle::Interleaved, RopeStyle::Half] {
            let mut ours = vec![0f32; x.len()];
            rotate_row(&x, head_dim, style, &cos, &sin, &mut ours);
            let t = Tensor::from_slice(&x, (1, heads, 1, head_dim), &Device::Cpu).unwrap();
            let rotating = t.narrow(3, 0, rotary).unwrap().contiguous().unwrap();
            let c = Tensor::from_slice(&cos, (1, 1, rotary / 2), &Device::Cpu).unwrap();
            let s = Tensor::from_slice(&sin, (1, 1, rotary / 2), &Device::Cpu).unwrap();
            let y = match style {
                RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&rotating, &c, &s),
                RopeStyle::Half => candle_nn::rotary_emb::rope(&rotating, &c, &s),
            }
            .unwrap();
            let rest = t.narrow(3, rotary, head_dim - rotary).unwrap();
            let theirs = Tensor::cat(&[y, rest], 3).unwrap();
            let theirs: Vec<f32> = theirs.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(bits_differ(&ours, &theirs), 0, "{style:?}");
        }
    }
}
