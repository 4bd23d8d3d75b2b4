//! Rotary position embeddings as a model's files set them: the base and the scaling that
//! stretches a context past the one trained. A Hugging Face `config.json` says it in one of
//! two layouts, transformers 4's top-level `rope_theta` and `rope_scaling`, or transformers
//! 5's `rope_parameters`, read here the way transformers reads them; a GGUF file says it in
//! its `rope.*` keys (and, for Llama 3, in a `rope_freqs` tensor the engine reads). A
//! setting the engine does not compute is refused, naming its field.

use serde_json::{Map, Value};

/// How positions become rotation angles beyond the plain base.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// Llama 3.1's: frequencies whose wavelength is past `original / low_freq_factor`
    /// divided by `factor`, those under `original / high_freq_factor` kept, a smooth ramp
    /// between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: interpolated and extrapolated frequencies blended by a ramp over the dimensions
    /// between `beta_fast` and `beta_slow` rotations in the original context, and cos/sin
    /// scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Round the ramp's bounds to whole dimensions.
        truncate: bool,
    },
    /// LongRoPE (Phi-3, Phi-4): each frequency divided by its own factor, and cos/sin
    /// scaled by `attention_factor`. A model has short factors for contexts within its
    /// original one and long factors past it; `factors` are those of the context the
    /// engine serves, `max_position_embeddings` (as llama.cpp takes those of its context),
    /// so that a position rotates alike however its sequence was computed. A GGUF file
    /// keeps them in tensors, which the loader reads: `factors` is then empty.
    LongRope {
        factors: Vec<f64>,
        original_max_position_embeddings: f64,
        attention_factor: f64,
    },
}

/// The RoPE settings of a config: its base and its scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// transformers' base when a config names none.
const DEFAULT_THETA: f64 = 10_000.0;

/// The keys each rope type takes beside `rope_type` (or `type`) and `rope_theta`.
fn keys_of(rope_type: &str) -> Option<&'static [&'static str]> {
    Some(match rope_type {
        "default" => &[],
        "linear" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "longrope" | "su" => &[
            "short_factor",
            "long_factor",
            "factor",
            "attention_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        _ => return None,
    })
}

impl Rope {
    /// The RoPE settings of a `config.json`'s top-level object, for a model of
    /// `max_position_embeddings`, or why the engine cannot run them. `rope_scaling` (when set)
    /// is taken over `rope_parameters`, and a `rope_theta` inside them over a top-level
    /// one, as transformers 5 does.
    pub fn from_hf(
        config: &Map<String, Value>,
        max_position_embeddings: usize,
    ) -> Result<Self, String> {
        let (field, params) = parameters(config);
        let number = |key: &str| number(&params, field, key);
        let theta = match number("rope_theta")? {
            Some(t) => t,
            None => match config.get("rope_theta") {
                None | Some(Value::Null) => DEFAULT_THETA,
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| format!("rope_theta must be a number, got {v}"))?,
            },
        };
        let rope_type = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        refuse_unknown_keys(&params, field, rope_type)?;
        // A top-level original_max_position_embeddings is taken over the one in the
        // parameters, as transformers does for the models that keep it there (Phi-3).
        let original = || -> Result<f64, String> {
            match config
                .get("original_max_position_embeddings")
                .and_then(Value::as_f64)
            {
                Some(o) => Ok(o),
                None => Ok(number("original_max_position_embeddings")?
                    .unwrap_or(max_position_embeddings as f64)),
            }
        };
        let required = |key: &str| -> Result<f64, String> {
            number(key)?
                .ok_or_else(|| format!("{field}.{key} is missing for rope type {rope_type:?}"))
        };
        let scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: required("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: required("factor")?,
                low_freq_factor: required("low_freq_factor")?,
                high_freq_factor: required("high_freq_factor")?,
                original_max_position_embeddings: original()?,
            },
            "longrope" | "su" => longrope(&params, field, max_position_embeddings, original()?)?,
            _ => yarn(&params, field, max_position_embeddings, original()?)?,
        };
        Ok(Self { theta, scaling })
    }
}

/// The RoPEs of a model whose full-attention and sliding-window layers rotate apart
/// (Gemma 3).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRopes {
    pub full: Rope,
    pub sliding: Rope,
}

/// Gemma 3's bases when its config names none: of its full layers and its sliding ones.
const FULL_THETA: f64 = 1_000_000.0;
const SLIDING_THETA: f64 = 10_000.0;

impl Rope {
    /// The two RoPEs of a config, as transformers' `Gemma3TextConfig` reads them: from
    /// transformers 5's `rope_parameters` keyed by `full_attention` and
    /// `sliding_attention`, or from transformers 4's `rope_theta` and `rope_scaling` (the
    /// full layers') and `rope_local_base_freq` (the sliding layers', never scaled).
    pub fn by_layer_type(
        config: &Map<String, Value>,
        max_position_embeddings: usize,
    ) -> Result<LayerRopes, String> {
        let params = config
            .get("rope_parameters")
            .and_then(Value::as_object)
            .filter(|m| !m.is_empty());
        let (mut full, mut sliding) = match params {
            Some(types)
                if types.contains_key("full_attention")
                    || types.contains_key("sliding_attention") =>
            {
                if let Some(other) = types
                    .keys()
                    .find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention"))
                {
                    return Err(format!(
                        "rope_parameters.{other} is not supported: the parameters are keyed \
                         by layer type, full_attention and sliding_attention"
                    ));
                }
                let of = |key: &str| types.get(key).and_then(Value::as_object).cloned();
                (of("full_attention"), of("sliding_attention"))
            }
            Some(_) => {
                return Err(
                    "rope_parameters must be keyed by layer type (full_attention and \
                            sliding_attention)"
                        .into(),
                )
            }
            None => (Some(parameters(config).1), None),
        };
        let base =
            |key: &str, default: f64| config.get(key).and_then(Value::as_f64).unwrap_or(default);
        let full = full.get_or_insert_with(Map::new);
        full.entry("rope_theta")
            .or_insert(base("rope_theta", FULL_THETA).into());
        let sliding = sliding.get_or_insert_with(Map::new);
        sliding
            .entry("rope_theta")
            .or_insert(base("rope_local_base_freq", SLIDING_THETA).into());
        let read = |params: &Map<String, Value>| {
            let mut alone = Map::new();
            alone.insert("rope_parameters".into(), Value::Object(params.clone()));
            if partial_rotary_factor(&alone)? != 1.0 {
                return Err("partial_rotary_factor is not supported per layer type".into());
            }
            Rope::from_hf(&alone, max_position_embeddings)
        };
        Ok(LayerRopes {
            full: read(full)?,
            sliding: read(sliding)?,
        })
    }
}

/// The field the RoPE parameters are read from and its contents: a non-empty
/// `rope_scaling` over a non-empty `rope_parameters`, none as an empty `rope_parameters`.
fn parameters(config: &Map<String, Value>) -> (&'static str, Map<String, Value>) {
    let nonempty = |key: &'static str| {
        config
            .get(key)
            .and_then(Value::as_object)
            .filter(|m| !m.is_empty())
            .map(|m| (key, m.clone()))
    };
    nonempty("rope_scaling")
        .or_else(|| nonempty("rope_parameters"))
        .unwrap_or(("rope_parameters", Map::new()))
}

/// The fraction of each head's dimensions that rotate, from the RoPE parameters or the
/// top level of a config (1 when neither has it), as transformers reads it.
pub fn partial_rotary_factor(config: &Map<String, Value>) -> Result<f64, String> {
    let (field, params) = parameters(config);
    match number(&params, field, "partial_rotary_factor")? {
        Some(p) => Ok(p),
        None => match config.get("partial_rotary_factor") {
            None | Some(Value::Null) => Ok(1.0),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("partial_rotary_factor must be a number, got {v}")),
        },
    }
}

/// Refuses a rope type the engine does not compute, and a key its type does not take.
fn refuse_unknown_keys(
    params: &Map<String, Value>,
    field: &str,
    rope_type: &str,
) -> Result<(), String> {
    let known = keys_of(rope_type).ok_or_else(|| refused_type(field, rope_type))?;
    let common = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
    match params
        .keys()
        .find(|k| !common.contains(&k.as_str()) && !known.contains(&k.as_str()))
    {
        Some(key) => Err(format!(
            "{field}.{key} is not supported for rope type {rope_type:?}"
        )),
        None => Ok(()),
    }
}

/// Why a rope type is refused: `dynamic` for its own reason, the others as unknown.
fn refused_type(field: &str, rope_type: &str) -> String {
    if rope_type == "dynamic" {
        format!(
            "{field} rope type \"dynamic\" is not supported: its angles depend on the sequence's \
             length when each token is computed, so a prompt computed in chunks or on a prefill \
             node would not be the model colocated runs"
        )
    } else {
        format!(
            "{field} rope type {rope_type:?} is not supported (default, linear, llama3, yarn \
             and longrope are)"
        )
    }
}

/// `params[key]` as a number, `None` when unset or null.
fn number(params: &Map<String, Value>, field: &str, key: &str) -> Result<Option<f64>, String> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("{field}.{key} must be a number, got {v}")),
    }
}

/// transformers' YaRN magnitude scale for a context stretched by `scale`.
pub(crate) fn mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// Whether LongRoPE rotates by its long factors: when the served context
/// (`max_position_embeddings`) is past the `original` one, as llama.cpp decides it once for
/// the model (transformers switches per sequence length, which would make a sequence's
/// early keys disagree with its later ones in a KV cache). GGUF files hold both lists, so
/// the engine's loader decides again with this function.
pub fn longrope_uses_long_factors(max_position_embeddings: usize, original: f64) -> bool {
    max_position_embeddings as f64 > original
}

/// LongRoPE's factors for a served context of `max_position_embeddings` (the long ones
/// past `original`, else the short ones), and its attention factor as transformers takes
/// it: given, or `sqrt(1 + ln(s) / ln(original))` for the stretch `s` (`factor`, else
/// max over original) past 1.
fn longrope(
    params: &Map<String, Value>,
    field: &str,
    max_position_embeddings: usize,
    original: f64,
) -> Result<RopeScaling, String> {
    let list = |key: &str| -> Result<Vec<f64>, String> {
        params
            .get(key)
            .and_then(Value::as_array)
            .and_then(|l| l.iter().map(Value::as_f64).collect::<Option<Vec<_>>>())
            .ok_or_else(|| format!("{field}.{key} must be a list of numbers"))
    };
    let long = longrope_uses_long_factors(max_position_embeddings, original);
    let factors = list(if long { "long_factor" } else { "short_factor" })?;
    let stretch =
        number(params, field, "factor")?.unwrap_or(max_position_embeddings as f64 / original);
    let attention_factor = match number(params, field, "attention_factor")? {
        Some(a) => a,
        None if stretch <= 1.0 => 1.0,
        None => (1.0 + stretch.ln() / original.ln()).sqrt(),
    };
    Ok(RopeScaling::LongRope {
        factors,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// YaRN's settings, with transformers' defaults: a factor of max / original positions when
/// none is given, beta_fast 32 and beta_slow 1 when unset or 0, the attention factor from
/// the factor (and mscale / mscale_all_dim when both are set), bounds truncated.
fn yarn(
    params: &Map<String, Value>,
    field: &str,
    max_position_embeddings: usize,
    original: f64,
) -> Result<RopeScaling, String> {
    let number = |key: &str| number(params, field, key);
    let factor = number("factor")?.unwrap_or(max_position_embeddings as f64 / original);
    let attention_factor = match number("attention_factor")? {
        Some(a) => a,
        None => match (number("mscale")?, number("mscale_all_dim")?) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                mscale(factor, m) / mscale(factor, all)
            }
            _ => mscale(factor, 1.0),
        },
    };
    let or = |v: Option<f64>, default: f64| v.filter(|&x| x != 0.0).unwrap_or(default);
    let truncate = match params.get("truncate") {
        None | Some(Value::Null) => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| format!("{field}.truncate must be true or false, got {v}"))?,
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        attention_factor,
        beta_fast: or(number("beta_fast")?, 32.0),
        beta_slow: or(number("beta_slow")?, 1.0),
        truncate,
    })
}

#[cfg(test)]
mod tests;
