//! Which layers attend only to a sliding window of recent positions, decided from a
//! `config.json` as each architecture's transformers configuration class decides it.

use serde_json::{Map, Value};

use super::Architecture;

/// `MistralConfig`'s, `Qwen2Config`'s and `Qwen3Config`'s window when the field is absent.
const DEFAULT_WINDOW: u64 = 4096;
/// `Qwen2Config`'s and `Qwen3Config`'s first sliding layer when the field is absent.
const DEFAULT_MAX_WINDOW_LAYERS: u64 = 28;

/// Each of `layers` layers' window (`None`: the whole context) for architecture `arch`:
/// - Mistral and Mixtral: every layer, `sliding_window` (4096 when absent, none when
///   null); `layer_types` is refused, as transformers' Mistral does not read it.
/// - Qwen3-MoE: every layer, `sliding_window` only with `use_sliding_window`;
///   transformers' Qwen3-MoE reads neither `layer_types` (refused) nor `max_window_layers`.
/// - Qwen2 and Qwen3: `sliding_window` only with `use_sliding_window`, in the layers
///   `layer_types` names `sliding_attention`, by default those from `max_window_layers` on.
/// - Qwen2-MoE: no window; `use_sliding_window` is refused (its layer pattern is not
///   run), as are `layer_types` that name a sliding layer.
/// - Gemma 2 and Gemma 3: `sliding_window` (4096 when absent) in the layers `layer_types`
///   names `sliding_attention`, by default all but every second (Gemma 2) or every
///   `sliding_window_pattern`-th (Gemma 3, 6 when absent) layer.
/// - Phi-3: every layer, `sliding_window` (none when absent or null).
/// - Llama has no window; a config that asks for one is refused rather than run whole.
pub(super) fn attention_windows(
    arch: Architecture,
    raw: &Map<String, Value>,
    layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    let window = match arch {
        Architecture::Gemma2 | Architecture::Gemma3 => return gemma_windows(arch, raw, layers),
        Architecture::Phi3
        | Architecture::Mistral
        | Architecture::Mixtral
        | Architecture::Qwen3Moe => return every_layer(arch, raw, layers),
        Architecture::Qwen2 | Architecture::Qwen3 if flag(raw, "use_sliding_window")? => {
            window_field(raw)?
        }
        Architecture::Qwen2Moe if flag(raw, "use_sliding_window")? => {
            return Err("use_sliding_window true is not supported for qwen2_moe".into())
        }
        _ => None,
    };
    let sliding = match raw.get("layer_types").filter(|v| !v.is_null()) {
        Some(types) => layer_types(types, layers)?,
        None => {
            let first = match raw.get("max_window_layers") {
                None | Some(Value::Null) => DEFAULT_MAX_WINDOW_LAYERS,
                Some(v) => v
                    .as_u64()
                    .ok_or_else(|| format!("max_window_layers must be a count, got {v}"))?,
            };
            (0..layers)
                .map(|i| window.is_some() && i as u64 >= first)
                .collect()
        }
    };
    if arch == Architecture::Llama && flag(raw, "use_sliding_window")? {
        return Err("use_sliding_window true is not supported: Llama has no window".into());
    }
    per_layer(window, sliding, || {
        if arch == Architecture::Llama {
            "layer_types names sliding_attention layers, which Llama does not have".into()
        } else {
            "layer_types names sliding_attention layers but use_sliding_window sets no window"
                .into()
        }
    })
}

/// The architectures whose every layer has the one window (or none): Phi-3's when
/// `sliding_window` is given, Qwen3-MoE's with `use_sliding_window`, Mistral's and
/// Mixtral's always. None of their transformers classes reads `layer_types`.
fn every_layer(
    arch: Architecture,
    raw: &Map<String, Value>,
    layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    if raw.contains_key("layer_types") {
        return Err(format!(
            "layer_types is not read by transformers' {arch}, so a config that sets it is \
             not one it runs"
        ));
    }
    let window = match arch {
        Architecture::Phi3 if !raw.contains_key("sliding_window") => None,
        Architecture::Qwen3Moe if !flag(raw, "use_sliding_window")? => None,
        _ => window_field(raw)?,
    };
    Ok(vec![window; layers])
}

/// Each layer's window from whether it slides; a sliding layer without a window is
/// refused with `why`.
fn per_layer(
    window: Option<usize>,
    sliding: Vec<bool>,
    why: impl FnOnce() -> String,
) -> Result<Vec<Option<usize>>, String> {
    if window.is_none() && sliding.contains(&true) {
        return Err(why());
    }
    Ok(sliding.into_iter().map(|s| window.filter(|_| s)).collect())
}

/// Gemma's windows, as [`attention_windows`] says.
fn gemma_windows(
    arch: Architecture,
    raw: &Map<String, Value>,
    layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    let window = window_field(raw)?;
    let sliding = match raw.get("layer_types").filter(|v| !v.is_null()) {
        Some(types) => layer_types(types, layers)?,
        None => {
            let period = match raw.get("sliding_window_pattern") {
                _ if arch == Architecture::Gemma2 => 2,
                None | Some(Value::Null) => 6,
                Some(v) => v.as_u64().filter(|p| *p > 0).ok_or_else(|| {
                    format!("sliding_window_pattern must be a count of 1 or more, got {v}")
                })?,
            };
            (0..layers as u64).map(|i| (i + 1) % period != 0).collect()
        }
    };
    per_layer(window, sliding, || {
        "sliding_window is null but some layers slide".into()
    })
}

/// `sliding_window`: the default when absent, none when null, else a count of at least 1.
fn window_field(raw: &Map<String, Value>) -> Result<Option<usize>, String> {
    match raw.get("sliding_window") {
        None => Ok(Some(DEFAULT_WINDOW as usize)),
        Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(w) if w >= 1 => Ok(Some(w as usize)),
            _ => Err(format!(
                "sliding_window must be a count of 1 or more, got {v}"
            )),
        },
    }
}

/// A boolean field, false when absent or null.
pub(super) fn flag(raw: &Map<String, Value>, key: &str) -> Result<bool, String> {
    match raw.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| format!("{key} must be true or false, got {v}")),
    }
}

/// Whether each layer slides, from a `layer_types` list of one entry per layer.
fn layer_types(types: &Value, layers: usize) -> Result<Vec<bool>, String> {
    let list = types
        .as_array()
        .filter(|l| l.len() == layers)
        .ok_or_else(|| format!("layer_types must list the {layers} layers, got {types}"))?;
    list.iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(format!(
                "layer_types entry {t} is not supported (full_attention and \
                 sliding_attention are)"
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn windows(arch: Architecture, v: Value, layers: usize) -> Result<Vec<Option<usize>>, String> {
        attention_windows(arch, v.as_object().unwrap(), layers)
    }

    #[test]
    fn mistral_slides_every_layer_by_its_window_or_the_default() {
        assert_eq!(
            windows(Architecture::Mistral, json!({"sliding_window": 8}), 2),
            Ok(vec![Some(8); 2])
        );
        assert_eq!(
            windows(Architecture::Mistral, json!({}), 1),
            Ok(vec![Some(4096)])
        );
        assert_eq!(
            windows(Architecture::Mistral, json!({"sliding_window": null}), 1),
            Ok(vec![None])
        );
        assert!(windows(
            Architecture::Mistral,
            json!({"layer_types": ["full_attention"]}),
            1
        )
        .is_err());
        assert!(windows(Architecture::Mistral, json!({"sliding_window": 0}), 1).is_err());
        assert_eq!(
            windows(Architecture::Mixtral, json!({}), 1),
            Ok(vec![Some(4096)])
        );
    }

    #[test]
    fn qwen3_moe_slides_every_layer_only_with_use_sliding_window() {
        let off = json!({"sliding_window": 8, "max_window_layers": 1});
        assert_eq!(windows(Architecture::Qwen3Moe, off, 2), Ok(vec![None; 2]));
        let on = json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1});
        assert_eq!(windows(Architecture::Qwen3Moe, on, 2), Ok(vec![Some(8); 2]));
        let listed = json!({"layer_types": ["full_attention", "full_attention"]});
        assert!(windows(Architecture::Qwen3Moe, listed, 2).is_err());
    }

    #[test]
    fn qwen_slides_only_with_use_sliding_window_from_max_window_layers() {
        let off = json!({"sliding_window": 8, "max_window_layers": 1});
        assert_eq!(windows(Architecture::Qwen2, off, 3), Ok(vec![None; 3]));
        let on = json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1});
        assert_eq!(
            windows(Architecture::Qwen3, on, 3),
            Ok(vec![None, Some(8), Some(8)])
        );
        let listed = json!({"use_sliding_window": true, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"]});
        assert_eq!(
            windows(Architecture::Qwen2, listed, 2),
            Ok(vec![Some(8), None])
        );
        let windowless = json!({"layer_types": ["sliding_attention"]});
        assert!(windows(Architecture::Qwen2, windowless, 1).is_err());
        let short = json!({"use_sliding_window": true, "layer_types": ["full_attention"]});
        assert!(windows(Architecture::Qwen2, short, 2).is_err());
    }

    #[test]
    fn qwen2_moe_refuses_its_window() {
        assert_eq!(
            windows(Architecture::Qwen2Moe, json!({"sliding_window": 8}), 2),
            Ok(vec![None; 2])
        );
        let on = json!({"use_sliding_window": true, "sliding_window": 8});
        assert!(windows(Architecture::Qwen2Moe, on, 2).is_err());
    }

    #[test]
    fn gemma_slides_all_but_every_periodth_layer_unless_layer_types_say() {
        let w = json!({"sliding_window": 8});
        assert_eq!(
            windows(Architecture::Gemma2, w.clone(), 3),
            Ok(vec![Some(8), None, Some(8)])
        );
        let mut gemma3 = windows(Architecture::Gemma3, w, 7).unwrap();
        assert_eq!(
            gemma3.drain(4..).collect::<Vec<_>>(),
            [Some(8), None, Some(8)]
        );
        let period = json!({"sliding_window_pattern": 2});
        assert_eq!(
            windows(Architecture::Gemma3, period, 2),
            Ok(vec![Some(4096), None])
        );
        let listed = json!({"sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"]});
        assert_eq!(
            windows(Architecture::Gemma3, listed, 2),
            Ok(vec![None, Some(8)])
        );
        assert!(windows(Architecture::Gemma2, json!({"sliding_window": null}), 1).is_err());
        assert!(windows(
            Architecture::Gemma3,
            json!({"sliding_window_pattern": 0}),
            1
        )
        .is_err());
    }

    #[test]
    fn phi3_slides_every_layer_only_with_a_window() {
        assert_eq!(windows(Architecture::Phi3, json!({}), 2), Ok(vec![None; 2]));
        assert_eq!(
            windows(Architecture::Phi3, json!({"sliding_window": 8}), 2),
            Ok(vec![Some(8); 2])
        );
        assert!(windows(
            Architecture::Phi3,
            json!({"layer_types": ["full_attention"]}),
            1
        )
        .is_err());
    }

    #[test]
    fn llama_refuses_a_window() {
        assert_eq!(
            windows(Architecture::Llama, json!({"sliding_window": 8}), 1),
            Ok(vec![None])
        );
        assert!(windows(Architecture::Llama, json!({"use_sliding_window": true}), 1).is_err());
        assert!(windows(
            Architecture::Llama,
            json!({"layer_types": ["sliding_attention"]}),
            1
        )
        .is_err());
    }
}
