//! What Gemma 2's and Gemma 3's decoders add to Llama's, read from a `config.json` as
//! transformers' `Gemma2Config` and `Gemma3TextConfig` read it, or from a GGUF file as
//! llama.cpp reads it.
//!
//! Beside the settings here, every Gemma scales its embeddings by `sqrt(hidden_size)`,
//! normalizes each attention's and each feed-forward's output as well as its input, gates
//! its feed-forward with GeLU (tanh approximation), and stores its RMSNorm weights as
//! offsets from 1 (llama.cpp's converter adds the 1 when it writes a GGUF file).

use serde_json::{Map, Value};

use super::Architecture;
use crate::gguf::{Metadata, Value as GgufValue};
use crate::rope::Rope;

/// Gemma's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma {
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2` rather than by the
    /// head size's.
    pub query_pre_attn_scalar: f64,
    /// Attention scores become `cap * tanh(score / cap)` (Gemma 2).
    pub attn_logit_softcapping: Option<f64>,
    /// The output logits become `cap * tanh(logit / cap)`.
    pub final_logit_softcapping: Option<f64>,
    /// The RoPE of the sliding-window layers where it is not the model's (Gemma 3's
    /// local base); `None` where every layer rotates alike.
    pub sliding_rope: Option<Rope>,
}

/// The fields only Gemma's configs have; another architecture carrying one is refused, as
/// it would not run them. Gemma 2 has the first five and the last (an older name of its
/// `sliding_window`, which transformers no longer reads); Gemma 3 the first seven.
pub(super) const GEMMA_FIELDS: [&str; 8] = [
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "rope_local_base_freq",
    "sliding_window_pattern",
    "sliding_window_size",
];

/// The fields of [`GEMMA_FIELDS`] `arch`'s configuration class reads.
fn read_by(arch: Architecture) -> Vec<&'static str> {
    match arch {
        Architecture::Gemma2 => GEMMA_FIELDS
            .iter()
            .copied()
            .filter(|k| !matches!(*k, "rope_local_base_freq" | "sliding_window_pattern"))
            .collect(),
        Architecture::Gemma3 => GEMMA_FIELDS[..7].to_vec(),
        _ => Vec::new(),
    }
}

/// The activation every Gemma's feed-forward gates with.
const GELU_TANH: &str = "gelu_pytorch_tanh";
/// `query_pre_attn_scalar` when a Gemma config has none: both classes' default.
const DEFAULT_QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
/// Gemma 2's soft caps when its config has no field (a null field turns one off).
const GEMMA2_ATTN_SOFTCAP: f64 = 50.0;
const GEMMA2_FINAL_SOFTCAP: f64 = 30.0;

/// Gemma's settings of `arch`'s config, `None` for another architecture (which is refused
/// if it carries one of [`GEMMA_FIELDS`]). `max_positions` bounds the context, for Gemma
/// 3's RoPE of its global layers.
pub(super) fn from_hf(
    arch: Architecture,
    raw: &Map<String, Value>,
    max_positions: usize,
) -> Result<Option<Gemma>, String> {
    let read = read_by(arch);
    if let Some(key) = GEMMA_FIELDS
        .iter()
        .find(|k| !read.contains(k) && raw.get(**k).is_some_and(|v| !v.is_null()))
    {
        return Err(format!(
            "{key} is not read by transformers' {arch}, so a config that sets it is not one \
             it runs"
        ));
    }
    if !arch.is_gemma() {
        return Ok(None);
    }
    if let Some(act) = raw
        .get("hidden_activation")
        .filter(|v| !v.is_null() && v.as_str() != Some(GELU_TANH))
    {
        return Err(format!(
            "hidden_activation {act} is not supported; expected \"{GELU_TANH}\""
        ));
    }
    if super::windows::flag(raw, "use_bidirectional_attention")? {
        return Err(
            "use_bidirectional_attention true is not supported: the engine's \
                    attention is causal"
                .into(),
        );
    }
    let gemma2 = arch == Architecture::Gemma2;
    let cap = |key: &str, gemma2_default: f64| -> Result<Option<f64>, String> {
        match raw.get(key) {
            None if gemma2 => Ok(Some(gemma2_default)),
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(c) if c > 0.0 => Ok(Some(c)),
                _ => Err(format!("{key} must be a positive number or null, got {v}")),
            },
        }
    };
    let query_pre_attn_scalar = match raw.get("query_pre_attn_scalar") {
        None | Some(Value::Null) => DEFAULT_QUERY_PRE_ATTN_SCALAR,
        Some(v) => v
            .as_f64()
            .filter(|s| *s > 0.0)
            .ok_or_else(|| format!("query_pre_attn_scalar must be a positive number, got {v}"))?,
    };
    Ok(Some(Gemma {
        query_pre_attn_scalar,
        attn_logit_softcapping: cap("attn_logit_softcapping", GEMMA2_ATTN_SOFTCAP)?,
        final_logit_softcapping: cap("final_logit_softcapping", GEMMA2_FINAL_SOFTCAP)?,
        sliding_rope: if gemma2 {
            None
        } else {
            Some(Rope::by_layer_type(raw, max_positions)?.sliding)
        },
    }))
}

/// The `{arch}.*` keys Gemma's GGUF files have beyond Llama's.
pub(super) const GGUF_KEYS: [&str; 5] = [
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope.freq_base_swa",
];

/// The shape of a Gemma GGUF model that [`from_gguf`] reads beside Gemma's settings.
pub(super) struct GgufShape<'a> {
    pub arch: Architecture,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// The global layers' RoPE.
    pub rope: &'a Rope,
}

/// Gemma's settings and each layer's window, from a GGUF file as llama.cpp's `gemma2` and
/// `gemma3` read them:
/// - Gemma 2 slides every other layer (from the first) over `attention.sliding_window`
///   (4096 without the key), soft-caps as its keys say, and rotates its sliding layers
///   by `rope.freq_base_swa` when the file has one;
/// - Gemma 3 slides five layers of six when the file has a window, caps the output only,
///   and rotates its sliding layers by `rope.freq_base_swa` (10000 without the key) and
///   no scaling;
/// - `attention.sliding_window_pattern` (a period or one flag per layer) overrides the
///   pattern;
/// - the file holds no `query_pre_attn_scalar`: llama.cpp takes the head size, and for
///   the 27B models (known by their layer count) `hidden / heads`, which is what those
///   models' configs say.
pub(super) fn from_gguf(
    meta: &Metadata,
    shape: &GgufShape<'_>,
) -> Result<(Gemma, Vec<Option<usize>>), String> {
    let arch = shape.arch.gguf_name();
    let key = |name: &str| meta.get(&format!("{arch}.{name}"));
    let float = |name: &str| key(name).and_then(GgufValue::to_f64);
    let gemma2 = shape.arch == Architecture::Gemma2;
    let window = match key("attention.sliding_window").and_then(GgufValue::to_u64) {
        Some(w) if w > 0 => Some(w as usize),
        Some(_) => None,
        None if gemma2 => Some(4096),
        None => None,
    };
    let sliding = match window {
        Some(_) => sliding_layers(meta, arch, shape.layers, if gemma2 { 2 } else { 6 })?,
        None => vec![false; shape.layers],
    };
    let big = shape.layers == if gemma2 { 46 } else { 62 };
    let swa_base = float("rope.freq_base_swa");
    let sliding_rope = match (gemma2, swa_base) {
        (true, None) => None,
        (true, Some(theta)) => Some(Rope {
            theta,
            scaling: shape.rope.scaling.clone(),
        }),
        (false, theta) => Some(Rope {
            theta: theta.unwrap_or(10_000.0),
            scaling: crate::rope::RopeScaling::None,
        }),
    };
    let gemma = Gemma {
        query_pre_attn_scalar: if big {
            (shape.hidden / shape.heads) as f64
        } else {
            shape.head_dim as f64
        },
        attn_logit_softcapping: float("attn_logit_softcapping").filter(|c| gemma2 && *c > 0.0),
        final_logit_softcapping: float("final_logit_softcapping").filter(|c| *c > 0.0),
        sliding_rope,
    };
    if !gemma2 && key("attn_logit_softcapping").is_some() {
        return Err(format!(
            "{arch}.attn_logit_softcapping is not supported: llama.cpp's gemma3 does not read it"
        ));
    }
    let windows = sliding.into_iter().map(|s| window.filter(|_| s)).collect();
    Ok((gemma, windows))
}

/// Which of `layers` layers slide: `attention.sliding_window_pattern` as flags or a
/// period, else `period`; with a period `p`, all but every `p`-th layer (llama.cpp's
/// `set_swa_pattern`).
fn sliding_layers(
    meta: &Metadata,
    arch: &str,
    layers: usize,
    period: u64,
) -> Result<Vec<bool>, String> {
    let name = format!("{arch}.attention.sliding_window_pattern");
    let period = match meta.get(&name) {
        Some(GgufValue::Array(flags)) => {
            return flags
                .iter()
                .map(|f| match f {
                    GgufValue::Bool(b) => Ok(*b),
                    _ => Err(format!("{name} must hold flags, got {f:?}")),
                })
                .collect::<Result<Vec<_>, _>>()
                .and_then(|v| {
                    if v.len() == layers {
                        Ok(v)
                    } else {
                        Err(format!("{name} must flag the {layers} layers"))
                    }
                })
        }
        Some(v) => v
            .to_u64()
            .ok_or_else(|| format!("{name} must be a period or flags, got {v:?}"))?,
        None => period,
    };
    Ok((0..layers as u64)
        .map(|i| period == 0 || i % period < period - 1)
        .collect())
}

#[cfg(test)]
mod tests;
