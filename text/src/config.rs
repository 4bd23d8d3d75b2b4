//! Model hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Result, TextError};
use crate::gguf::{Metadata, Value};

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
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    rope_scaling: Option<serde_json::Value>,
    hidden_act: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}

impl ModelConfig {
    /// Reads `config.json` from a Hugging Face model folder.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TextError::io(path, e))?;
        let hf: HfConfig = serde_json::from_str(&text)
            .map_err(|e| TextError::invalid_model(path, format!("config.json: {e}")))?;
        let model_type = hf.model_type.clone().unwrap_or_default();
        let arch = hf.architectures.first().cloned().unwrap_or_default();
        let supported = matches!(model_type.as_str(), "llama" | "qwen2")
            || matches!(arch.as_str(), "LlamaForCausalLM" | "Qwen2ForCausalLM");
        if !supported {
            return Err(TextError::invalid_model(
                path,
                format!("unsupported architecture {arch:?} (model_type {model_type:?}); expected llama or qwen2"),
            ));
        }
        if let Some(scaling) = hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(TextError::invalid_model(
                path,
                format!("rope_scaling {scaling} is not supported"),
            ));
        }
        if let Some(act) = hf.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(TextError::invalid_model(
                path,
                format!("hidden_act {act:?} is not supported; expected silu"),
            ));
        }
        let heads = hf.num_attention_heads;
        let cfg = Self {
            architecture: if model_type == "qwen2" || arch.starts_with("Qwen2") {
                "qwen2".into()
            } else {
                "llama".into()
            },
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
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
