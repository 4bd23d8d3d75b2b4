//! Model hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Result, TextError};
use crate::rope::{Rope, RopeScaling};

mod architecture;
mod fields;
mod gemma;
mod gguf;
mod moe;
mod windows;
pub use architecture::Architecture;
pub use fields::{field_use, FieldUse};
pub use gemma::Gemma;
pub use moe::MoeConfig;

/// The activation of a feed-forward's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`: Llama's, Qwen's, Mistral's.
    Silu,
    /// GeLU's tanh approximation (`gelu_pytorch_tanh`): Gemma's.
    GeluTanh,
}

/// How rotary embeddings pair the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (i, i + d/2): Hugging Face's `rotate_half`, and GGUF for Qwen2.
    Half,
    /// Pairs (2i, 2i + 1): GGUF llama files, whose q/k weights llama.cpp permuted.
    Interleaved,
}

/// The hyper-parameters the forward pass needs; identical for HF and GGUF sources.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// The leading dimensions of each head that rotate (Phi-3's partial rotary); the
    /// others pass through. `head_dim` for the other architectures.
    pub rotary_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// How rotary angles are stretched past the trained context.
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub rope_style: RopeStyle,
    /// Each layer's attention span: `None` for the whole context, `Some(w)` for the last
    /// `w` positions up to and including the row's own.
    pub attention_windows: Vec<Option<usize>>,
    /// The mixture of experts of a sparse model; `None` for a dense one.
    pub moe: Option<MoeConfig>,
    /// The feed-forward's gate activation.
    pub hidden_act: Activation,
    /// What a Gemma decoder adds to Llama's; `None` for the other architectures.
    pub gemma: Option<Gemma>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    hidden_act: Option<String>,
}

/// The feed-forward's activation: Gemma's GeLU (its classes read `hidden_activation`,
/// checked with Gemma's settings, and leave the `hidden_act` older configs also carry
/// unread), else `hidden_act`, which must be silu.
fn activation(gemma: bool, hidden_act: Option<&str>) -> std::result::Result<Activation, String> {
    match (gemma, hidden_act) {
        (true, _) => Ok(Activation::GeluTanh),
        (false, None | Some("silu")) => Ok(Activation::Silu),
        (false, Some(act)) => Err(format!(
            "hidden_act {act:?} is not supported; expected silu"
        )),
    }
}

/// The dimensions of a head that rotate: `partial_rotary_factor` of them for Phi-3 (as
/// transformers rounds it down), all of them elsewhere (a partial factor is refused);
/// LongRoPE's factors must be one per rotating pair.
fn rotary_dim(
    arch: Architecture,
    raw: &serde_json::Map<String, serde_json::Value>,
    head_dim: usize,
    scaling: &crate::rope::RopeScaling,
) -> std::result::Result<usize, String> {
    let partial = crate::rope::partial_rotary_factor(raw)?;
    if arch != Architecture::Phi3 && partial != 1.0 {
        return Err(format!(
            "partial_rotary_factor {partial} is not supported for {arch}: every dimension of \
             a head rotates"
        ));
    }
    let dim = (head_dim as f64 * partial) as usize;
    if dim == 0 || dim > head_dim || !dim.is_multiple_of(2) {
        return Err(format!(
            "partial_rotary_factor {partial} rotates {dim} of {head_dim} dimensions; an even \
             number from 2 to all of them is supported"
        ));
    }
    if let crate::rope::RopeScaling::LongRope { factors, .. } = scaling {
        if factors.len() != dim / 2 {
            return Err(format!(
                "the LongRoPE factors number {}, not one per rotating pair ({})",
                factors.len(),
                dim / 2
            ));
        }
    }
    Ok(dim)
}

fn default_eps() -> f64 {
    1e-6
}

/// Defaults of the configuration classes for fields a config may leave out, where
/// Gemma's differ from the others'.
struct ClassDefaults {
    max_position_embeddings: usize,
    tie_word_embeddings: bool,
    head_dim: Option<usize>,
}

impl ClassDefaults {
    fn of(architecture: Architecture) -> Self {
        match architecture {
            Architecture::Gemma2 => Self {
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                head_dim: Some(256),
            },
            Architecture::Gemma3 => Self {
                max_position_embeddings: 131_072,
                tie_word_embeddings: true,
                head_dim: Some(256),
            },
            _ => Self {
                max_position_embeddings: 4096,
                tie_word_embeddings: false,
                head_dim: None,
            },
        }
    }
}

impl ModelConfig {
    /// Reads `config.json` from a Hugging Face model folder.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TextError::io(path, e))?;
        let invalid = |e: String| TextError::invalid_model(path, format!("config.json: {e}"));
        let raw: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let hf = HfConfig::deserialize(serde_json::Value::Object(raw.clone()))
            .map_err(|e| invalid(e.to_string()))?;
        let model_type = hf.model_type.clone().unwrap_or_default();
        let arch = hf.architectures.first().cloned().unwrap_or_default();
        let architecture = Architecture::from_hf(&model_type, &arch).ok_or_else(|| {
            let known: Vec<&str> = Architecture::ALL.map(Architecture::model_type).to_vec();
            TextError::invalid_model(
                path,
                format!(
                    "unsupported architecture {arch:?} (model_type {model_type:?}); \
                     expected one of {}",
                    known.join(", ")
                ),
            )
        })?;
        fields::check(&raw).map_err(invalid)?;
        let defaults = ClassDefaults::of(architecture);
        let max_positions = hf
            .max_position_embeddings
            .unwrap_or(defaults.max_position_embeddings);
        // Gemma 3's full-attention layers rotate by the model's RoPE; its sliding ones are
        // read with Gemma's settings.
        let rope = match architecture {
            Architecture::Gemma3 => Rope::by_layer_type(&raw, max_positions).map(|r| r.full),
            _ => Rope::from_hf(&raw, max_positions),
        };
        let rope = rope.map_err(invalid)?;
        let gemma = gemma::from_hf(architecture, &raw, max_positions).map_err(invalid)?;
        let attention_windows =
            windows::attention_windows(architecture, &raw, hf.num_hidden_layers)
                .map_err(invalid)?;
        let (inter, layers) = (hf.intermediate_size, hf.num_hidden_layers);
        let moe = moe::from_hf(architecture, &raw, inter, layers).map_err(invalid)?;
        let hidden_act = activation(gemma.is_some(), hf.hidden_act.as_deref()).map_err(invalid)?;
        let heads = hf.num_attention_heads;
        let head_dim = hf
            .head_dim
            .or(defaults.head_dim)
            .unwrap_or(hf.hidden_size / heads);
        let rotary_dim =
            rotary_dim(architecture, &raw, head_dim, &rope.scaling).map_err(invalid)?;
        let cfg = Self {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim,
            rotary_dim,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            max_position_embeddings: max_positions,
            tie_word_embeddings: hf
                .tie_word_embeddings
                .unwrap_or(defaults.tie_word_embeddings),
            rope_style: RopeStyle::Half,
            attention_windows,
            moe,
            hidden_act,
            gemma,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map_or_else(Vec::new, OneOrMany::into_vec),
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let ok = self.num_attention_heads > 0
            && self.num_key_value_heads > 0
            && self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
            && self.head_dim.is_multiple_of(2)
            && self.num_hidden_layers > 0
            && self.vocab_size > 0;
        if ok {
            Ok(())
        } else {
            Err(TextError::invalid_model(
                path,
                format!("inconsistent hyper-parameters: {self:?}"),
            ))
        }
    }

    /// Whether each head's queries and keys are RMS-normalized before RoPE (Qwen3's and
    /// Gemma 3's).
    pub fn has_qk_norm(&self) -> bool {
        matches!(
            self.architecture,
            Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
        )
    }

    /// Whether q, k and v carry biases where the weights hold them: Qwen2's and
    /// Qwen2-MoE's, and any llama GGUF file's, as llama.cpp's llama graph adds them.
    pub fn reads_qkv_biases(&self, gguf: bool) -> bool {
        match self.architecture {
            Architecture::Qwen2 | Architecture::Qwen2Moe => true,
            Architecture::Llama => gguf,
            _ => false,
        }
    }

    /// What the files' RMSNorm weights are offset by: Gemma's store `w - 1` (its norms
    /// multiply by `1 + w`), except in GGUF files, where llama.cpp's converter added the 1.
    pub fn norm_weight_offset(&self, gguf: bool) -> f64 {
        if self.gemma.is_some() && !gguf {
            1.0
        } else {
            0.0
        }
    }

    /// Heads that share one K/V head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::rope::RopeScaling;

    fn dim(
        arch: Architecture,
        v: serde_json::Value,
        scaling: &RopeScaling,
    ) -> Result<usize, String> {
        rotary_dim(arch, v.as_object().unwrap(), 16, scaling)
    }

    #[test]
    fn only_phi3_rotates_part_of_a_head_and_longrope_has_a_factor_a_pair() {
        let partial = json!({"partial_rotary_factor": 0.75});
        assert_eq!(
            dim(Architecture::Phi3, partial.clone(), &RopeScaling::None),
            Ok(12)
        );
        assert_eq!(
            dim(Architecture::Llama, json!({}), &RopeScaling::None),
            Ok(16)
        );
        let refused = dim(Architecture::Llama, partial.clone(), &RopeScaling::None).unwrap_err();
        assert!(refused.starts_with("partial_rotary_factor 0.75 is not supported for llama"));
        let odd = json!({"partial_rotary_factor": 0.2});
        assert!(dim(Architecture::Phi3, odd, &RopeScaling::None).is_err());
        let longrope = |n: usize| RopeScaling::LongRope {
            factors: vec![1.0; n],
            original_max_position_embeddings: 64.0,
            attention_factor: 1.0,
        };
        assert_eq!(
            dim(Architecture::Phi3, partial.clone(), &longrope(6)),
            Ok(12)
        );
        assert!(dim(Architecture::Phi3, partial, &longrope(8)).is_err());
    }
}
