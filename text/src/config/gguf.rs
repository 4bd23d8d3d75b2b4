//! Model hyper-parameters from a GGUF file's metadata, read as llama.cpp reads them. Every
//! `{arch}.*` key is either read or refused, so that a setting of the file the engine does
//! not compute is never skipped; `general.*` keys describe the file and `tokenizer.*` keys
//! are the tokenizer's.

use std::path::Path;

use super::gemma::{self, GgufShape};
use super::{Activation, Architecture, ModelConfig, RopeStyle};
use crate::error::{Result, TextError};
use crate::gguf::{Metadata, Value};

mod rope;

/// The `{arch}.*` keys the engine reads, beside `rope.scaling.*` ([`rope::scaling`]),
/// the experts' ([`super::moe::GGUF_KEYS`]) and Gemma's ([`gemma::GGUF_KEYS`]).
const READ_KEYS: [&str; 13] = [
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scale_linear",
    "vocab_size",
];

impl ModelConfig {
    /// Reads the keys of a GGUF file's metadata for one of the [`Architecture`]s.
    pub fn from_gguf(meta: &Metadata, path: &Path) -> Result<Self> {
        let md = |key: &str| meta.get(key);
        let bad = |reason: String| TextError::invalid_model(path, reason);
        let arch = architecture(meta).map_err(bad)?;
        let name = arch.gguf_name();
        let num = |key: &str| -> Result<usize> {
            let full = format!("{name}.{key}");
            md(&full)
                .and_then(Value::to_u64)
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("missing {full}")))
        };
        let float = |key: &str, default: f64| -> f64 {
            md(&format!("{name}.{key}"))
                .and_then(Value::to_f64)
                .unwrap_or(default)
        };
        let hidden = num("embedding_length")?;
        let heads = num("attention.head_count")?;
        let vocab = match md("tokenizer.ggml.tokens").and_then(Value::as_array) {
            Some(tokens) => tokens.len(),
            None => num("vocab_size")?,
        };
        let (head_dim, rotary_dim) = head_dim(&num, hidden / heads, arch).map_err(bad)?;
        let tied = !meta.tensors.contains("output.weight");
        let context_length = num("context_length").unwrap_or(4096);
        let feed_forward = num("feed_forward_length")?;
        let layers = num("block_count")?;
        let moe = super::moe::from_gguf(meta, arch, feed_forward, layers).map_err(bad)?;
        let token_id = |key: &str| md(key).and_then(Value::to_u64).map(|v| v as u32);
        let rope = crate::rope::Rope {
            theta: float("rope.freq_base", 10_000.0),
            scaling: rope::scaling(meta, arch, context_length).map_err(bad)?,
        };
        // The other architectures read here attend to the whole context in llama.cpp; a
        // window key would have been refused with the other unknown keys.
        let (gemma, attention_windows) = if arch.is_gemma() {
            let shape = GgufShape {
                arch,
                layers,
                hidden,
                heads,
                head_dim,
                rope: &rope,
            };
            let (g, windows) = gemma::from_gguf(meta, &shape).map_err(bad)?;
            (Some(g), windows)
        } else {
            (None, vec![None; layers])
        };
        let cfg = Self {
            architecture: arch,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: feed_forward,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: num("attention.head_count_kv").unwrap_or(heads),
            head_dim,
            rotary_dim,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            max_position_embeddings: context_length,
            tie_word_embeddings: tied,
            // llama.cpp's converter permutes a llama file's q/k rows so that its graph
            // rotates adjacent pairs; Qwen's keep Hugging Face's halves (NEOX in llama.cpp).
            rope_style: if arch == Architecture::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Half
            },
            attention_windows,
            moe,
            hidden_act: if gemma.is_some() {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            gemma,
            bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
            eos_token_ids: token_id("tokenizer.ggml.eos_token_id")
                .into_iter()
                .collect(),
        };
        cfg.validate(path)?;
        Ok(cfg)
    }
}

/// The file's `general.architecture`, one the engine runs, whose every `{arch}.*` key the
/// engine reads.
fn architecture(meta: &Metadata) -> std::result::Result<Architecture, String> {
    let name = meta
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or("no general.architecture")?;
    let arch = Architecture::from_gguf(name).ok_or_else(|| {
        let mut known: Vec<&str> = Architecture::ALL.map(Architecture::gguf_name).to_vec();
        known.sort_unstable();
        known.dedup();
        format!(
            "unsupported GGUF architecture {name:?} ({} are supported)",
            known.join(", ")
        )
    })?;
    refuse_unknown_keys(meta, arch)?;
    Ok(arch)
}

/// The head size as llama.cpp takes it, `attention.key_length`, else the embedding width
/// over the heads (`plain`), and the dimensions that rotate, `rope.dimension_count`.
/// Values as wide as keys are the only shapes the engine runs, so a different
/// `value_length` is refused, as is a partial rotation outside Phi-3.
fn head_dim(
    num: &dyn Fn(&str) -> Result<usize>,
    plain: usize,
    arch: Architecture,
) -> std::result::Result<(usize, usize), String> {
    let key = num("attention.key_length").unwrap_or(plain);
    let value = num("attention.value_length").unwrap_or(key);
    if value != key {
        return Err(format!(
            "attention.value_length {value} differs from the head size {key}, which the \
             engine does not run"
        ));
    }
    let rotary = num("rope.dimension_count").unwrap_or(key);
    let partial_ok =
        arch == Architecture::Phi3 && rotary <= key && rotary >= 2 && rotary.is_multiple_of(2);
    if rotary != key && !partial_ok {
        return Err(format!(
            "rope.dimension_count {rotary} differs from the head size {key}, which the engine \
             does not run"
        ));
    }
    Ok((key, rotary))
}

/// The metadata keys starting with `prefix`, in order, each with the rest of its name.
fn keys_under<'a>(meta: &'a Metadata, prefix: &str) -> Vec<(&'a str, &'a str)> {
    let mut keys: Vec<(&str, &str)> = meta
        .values
        .keys()
        .filter_map(|k| Some((k.as_str(), k.strip_prefix(prefix)?)))
        .collect();
    keys.sort();
    keys
}

/// Refuses an `{arch}.*` key the engine neither reads nor knows to be neutral.
fn refuse_unknown_keys(meta: &Metadata, arch: Architecture) -> std::result::Result<(), String> {
    let prefix = format!("{}.", arch.gguf_name());
    for (key, name) in keys_under(meta, &prefix) {
        // llama.cpp's phi3 reads its window and attends to the whole context.
        let phi3_window = arch == Architecture::Phi3 && name == "attention.sliding_window";
        let read = READ_KEYS.contains(&name)
            || phi3_window
            || super::moe::GGUF_KEYS.contains(&name)
            || (arch.is_gemma() && gemma::GGUF_KEYS.contains(&name));
        if !read && !name.starts_with("rope.scaling.") {
            return Err(format!(
                "{key} is not supported: the engine does not compute what it sets"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Metadata of `values` and no tensors.
    pub(crate) fn meta(values: &[(&str, Value)]) -> Metadata {
        Metadata {
            values: values
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            tensors: Default::default(),
        }
    }

    #[test]
    fn gguf_keys_the_engine_does_not_read_are_refused() {
        let read = meta(&[
            ("qwen3.block_count", Value::U32(2)),
            ("qwen3.rope.scaling.type", Value::String("none".into())),
            ("general.name", Value::String("tiny".into())),
        ]);
        assert_eq!(refuse_unknown_keys(&read, Architecture::Qwen3), Ok(()));
        let gating = meta(&[("qwen3moe.expert_gating_func", Value::U32(2))]);
        assert_eq!(
            refuse_unknown_keys(&gating, Architecture::Qwen3Moe),
            Err(
                "qwen3moe.expert_gating_func is not supported: the engine does not compute what \
                 it sets"
                    .into()
            )
        );
        let window = meta(&[("llama.attention.sliding_window", Value::U32(4096))]);
        assert!(refuse_unknown_keys(&window, Architecture::Llama).is_err());
    }

    #[test]
    fn the_head_size_is_the_key_length_with_every_dimension_rotated() {
        let of = |pairs: &'static [(&'static str, usize)]| {
            move |key: &str| -> Result<usize> {
                pairs
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| *v)
                    .ok_or_else(|| TextError::invalid_model(Path::new("x"), key.to_string()))
            }
        };
        assert_eq!(head_dim(&of(&[]), 64, Architecture::Qwen3), Ok((64, 64)));
        let qwen3 = of(&[
            ("attention.key_length", 128),
            ("attention.value_length", 128),
        ]);
        assert_eq!(head_dim(&qwen3, 64, Architecture::Qwen3), Ok((128, 128)));
        let partial = of(&[("rope.dimension_count", 32)]);
        assert_eq!(
            head_dim(&partial, 64, Architecture::Qwen3),
            Err(
                "rope.dimension_count 32 differs from the head size 64, which the engine does \
                 not run"
                    .into()
            )
        );
        let narrow_values = of(&[
            ("attention.key_length", 128),
            ("attention.value_length", 64),
        ]);
        assert!(head_dim(&narrow_values, 64, Architecture::Qwen3).is_err());
        assert_eq!(head_dim(&partial, 64, Architecture::Phi3), Ok((64, 32)));
    }
}
