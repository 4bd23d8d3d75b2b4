//! Model hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Result, TextError};
use crate::gguf::{Metadata, Value};
use crate::rope::{Rope, RopeScaling};

mod fields;
pub use fields::{field_use, FieldUse};

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
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// How rotary angles are stretched past the trained context.
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub rope_style: RopeStyle,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
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
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    hidden_act: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    4096
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
        let architecture = match (model_type.as_str(), arch.as_str()) {
            ("llama", _) | ("", "LlamaForCausalLM") => "llama",
            ("qwen2", _) | ("", "Qwen2ForCausalLM") => "qwen2",
            ("qwen3", _) | ("", "Qwen3ForCausalLM") => "qwen3",
            _ => {
                return Err(TextError::invalid_model(
                    path,
                    format!(
                        "unsupported architecture {arch:?} (model_type {model_type:?}); \
                         expected llama, qwen2 or qwen3"
                    ),
                ))
            }
        };
        fields::check(&raw).map_err(invalid)?;
        let rope = Rope::from_hf(&raw, hf.max_position_embeddings).map_err(invalid)?;
        if let Some(act) = hf.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(TextError::invalid_model(
                path,
                format!("hidden_act {act:?} is not supported; expected silu"),
            ));
        }
        let heads = hf.num_attention_heads;
        let cfg = Self {
            architecture: architecture.into(),
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            rope_style: RopeStyle::Half,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: match hf.eos_token_id {
                None => vec![],
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Reads the `llama`/`qwen2` keys of a GGUF file's metadata.
    pub fn from_gguf(meta: &Metadata, path: &Path) -> Result<Self> {
        let md = |key: &str| meta.get(key);
        let bad = |reason: String| TextError::invalid_model(path, reason);
        let arch = md("general.architecture")
            .and_then(|v| v.as_str().map(str::to_string))
            .ok_or_else(|| bad("no general.architecture".into()))?;
        if arch != "llama" && arch != "qwen2" {
            return Err(bad(format!("unsupported GGUF architecture {arch:?}")));
        }
        let num = |key: &str| -> Result<usize> {
            let full = format!("{arch}.{key}");
            md(&full)
                .and_then(Value::to_u64)
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("missing {full}")))
        };
        let float = |key: &str, default: f64| -> f64 {
            md(&format!("{arch}.{key}"))
                .and_then(Value::to_f64)
                .unwrap_or(default)
        };
        let hidden = num("embedding_length")?;
        let heads = num("attention.head_count")?;
        let vocab = match md("tokenizer.ggml.tokens").and_then(Value::as_array) {
            Some(tokens) => tokens.len(),
            None => num("vocab_size")?,
        };
        let tied = !meta.tensors.contains("output.weight");
        let token_id = |key: &str| md(key).and_then(Value::to_u64).map(|v| v as u32);
        let cfg = Self {
            architecture: arch.clone(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: num("feed_forward_length")?,
            num_hidden_layers: num("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: num("attention.head_count_kv").unwrap_or(heads),
            head_dim: num("rope.dimension_count").unwrap_or(hidden / heads),
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta: float("rope.freq_base", 10_000.0),
            rope_scaling: gguf_rope_scaling(meta, &arch).map_err(bad)?,
            max_position_embeddings: num("context_length").unwrap_or(4096),
            tie_word_embeddings: tied,
            rope_style: if arch == "llama" {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Half
            },
            bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
            eos_token_ids: token_id("tokenizer.ggml.eos_token_id")
                .into_iter()
                .collect(),
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

    /// Heads that share one K/V head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// The `{arch}.rope.scaling.*` keys of a GGUF file, read as llama.cpp reads them: a
/// `factor` divides every frequency (llama.cpp's `freq_scale`) under type `none` or
/// `linear`. YaRN and the keys llama.cpp reads only for it are refused, as is any other
/// scaling key, so that no setting of the file is skipped.
fn gguf_rope_scaling(meta: &Metadata, arch: &str) -> std::result::Result<RopeScaling, String> {
    let prefix = format!("{arch}.rope.scaling.");
    let kind = meta
        .get(&format!("{prefix}type"))
        .and_then(Value::as_str)
        .unwrap_or("none");
    if !matches!(kind, "none" | "linear") {
        return Err(format!(
            "{prefix}type {kind:?} is not supported (none and linear are)"
        ));
    }
    // Informational, or read by llama.cpp only for YaRN.
    let neutral = ["type", "factor", "original_context_length", "finetuned"];
    let mut keys: Vec<&String> = meta
        .values
        .keys()
        .filter(|k| k.starts_with(&prefix))
        .collect();
    keys.sort();
    for key in keys {
        let name = &key[prefix.len()..];
        let unit = meta.get(key).and_then(Value::to_f64) == Some(1.0);
        let allowed = neutral.contains(&name) || (name == "attn_factor" && unit);
        if !allowed {
            return Err(format!("{key} is not supported"));
        }
    }
    // The key older converters wrote, which llama.cpp still reads first.
    let factor = meta
        .get(&format!("{arch}.rope.scale_linear"))
        .or_else(|| meta.get(&format!("{prefix}factor")))
        .and_then(Value::to_f64);
    match factor {
        Some(factor) if factor != 0.0 && factor != 1.0 => Ok(RopeScaling::Linear { factor }),
        _ => Ok(RopeScaling::None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(values: &[(&str, Value)]) -> Metadata {
        Metadata {
            values: values
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            tensors: Default::default(),
        }
    }

    #[test]
    fn a_gguf_factor_scales_linearly_as_llama_cpp_reads_it() {
        let linear = RopeScaling::Linear { factor: 4.0 };
        assert_eq!(
            gguf_rope_scaling(&meta(&[]), "llama"),
            Ok(RopeScaling::None)
        );
        let typed = meta(&[
            ("llama.rope.scaling.type", Value::String("linear".into())),
            ("llama.rope.scaling.factor", Value::F32(4.0)),
        ]);
        assert_eq!(gguf_rope_scaling(&typed, "llama"), Ok(linear.clone()));
        // llama.cpp applies the factor whatever the type says, and the old key first.
        let untyped = meta(&[("qwen2.rope.scale_linear", Value::F32(4.0))]);
        assert_eq!(gguf_rope_scaling(&untyped, "qwen2"), Ok(linear));
        let neutral = meta(&[
            ("llama.rope.scaling.attn_factor", Value::F32(1.0)),
            (
                "llama.rope.scaling.original_context_length",
                Value::U32(8192),
            ),
        ]);
        assert_eq!(gguf_rope_scaling(&neutral, "llama"), Ok(RopeScaling::None));
    }

    #[test]
    fn gguf_scaling_the_engine_does_not_compute_is_refused_by_key() {
        let yarn = meta(&[("qwen2.rope.scaling.type", Value::String("yarn".into()))]);
        assert_eq!(
            gguf_rope_scaling(&yarn, "qwen2"),
            Err("qwen2.rope.scaling.type \"yarn\" is not supported (none and linear are)".into())
        );
        let attn = meta(&[("llama.rope.scaling.attn_factor", Value::F32(0.8))]);
        assert_eq!(
            gguf_rope_scaling(&attn, "llama"),
            Err("llama.rope.scaling.attn_factor is not supported".into())
        );
        let other = meta(&[("llama.rope.scaling.yarn_log_multiplier", Value::F32(0.1))]);
        assert!(gguf_rope_scaling(&other, "llama").is_err());
    }
}
