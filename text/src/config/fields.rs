//! Every field a `config.json` of a supported architecture may carry, and what the engine
//! does with it: reads it, leaves it as transformers leaves it at inference, or runs only
//! one value of it and refuses the others. A field in none of these is refused, so that no
//! setting of a model is skipped without a word.

use serde_json::{Map, Value};

/// What the engine does with one field of a config.json.
#[derive(Debug, Clone, Copy)]
pub enum FieldUse {
    /// Read into the hyper-parameters (and refused there if its value is not run).
    Used,
    /// Not part of what the model computes at inference, in transformers either; the
    /// text says why.
    Ignored(&'static str),
    /// Runs only at the value the text names; any other is refused.
    Only(&'static str, fn(&Value) -> bool),
}

fn is_false(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(false))
}

fn absent(_: &Value) -> bool {
    false
}

const USED: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
];

const IGNORED: &[(&str, &str)] = &[
    ("attention_dropout", "dropout is off at inference"),
    ("embd_pdrop", "dropout is off at inference"),
    ("resid_pdrop", "dropout is off at inference"),
    ("initializer_range", "it initializes weights for training"),
    ("use_cache", "a switch of transformers' own generation loop"),
    (
        "cache_implementation",
        "a switch of transformers' own generation loop",
    ),
    (
        "pad_token_id",
        "padding is not part of what the model computes",
    ),
    (
        "pretraining_tp",
        "it splits products into slices that sum to the same",
    ),
    ("chunk_size_feed_forward", "the same product in chunks"),
    (
        "dtype",
        "the weights carry their own; the engine computes in f32",
    ),
    (
        "torch_dtype",
        "the weights carry their own; the engine computes in f32",
    ),
    ("transformers_version", "a note of the writer"),
    ("_name_or_path", "a note of the writer"),
    ("id2label", "labels of classification heads"),
    ("label2id", "labels of classification heads"),
    ("problem_type", "for classification heads"),
    ("output_attentions", "what transformers returns"),
    ("output_hidden_states", "what transformers returns"),
    ("return_dict", "what transformers returns"),
    // SmolLM2's config carries nanotron's notes, which transformers does not read.
    (
        "is_llama_config",
        "nanotron's note; transformers does not read it",
    ),
    (
        "rope_interleaved",
        "nanotron's note; transformers does not read it",
    ),
    ("transformers.js_config", "settings of transformers.js"),
    (
        "auto_map",
        "classes of remote code; transformers' own class runs the model",
    ),
    (
        "_sliding_window_pattern",
        "Gemma 3's note of its pattern; transformers reads layer_types",
    ),
    ("router_aux_loss_coef", "a training loss of the router"),
    (
        "output_router_logits",
        "what transformers returns (for the training loss)",
    ),
    (
        "router_jitter_noise",
        "transformers applies it only while training",
    ),
];

/// What the engine does with field `key` of a config.json, `None` for a field it does not
/// know.
pub fn field_use(key: &str) -> Option<FieldUse> {
    if USED.contains(&key)
        || super::moe::MOE_FIELDS.contains(&key)
        || super::gemma::GEMMA_FIELDS.contains(&key)
    {
        return Some(FieldUse::Used);
    }
    if let Some((_, why)) = IGNORED.iter().find(|(k, _)| *k == key) {
        return Some(FieldUse::Ignored(why));
    }
    Some(match key {
        "qkv_bias" => FieldUse::Only("true (Qwen2-MoE's q/k/v biases)", |v| {
            matches!(v, Value::Null | Value::Bool(true))
        }),
        "attention_bias" => FieldUse::Only("false (Llama's projections without biases)", is_false),
        "mlp_bias" => FieldUse::Only("false", is_false),
        // Phi-4-mini's notes for its remote code, at the values that leave the model
        // transformers' own Phi3 runs.
        "lm_head_bias" => FieldUse::Only("false", is_false),
        "interpolate_factor" => FieldUse::Only("1", |v| v.as_f64() == Some(1.0)),
        "full_attn_mod" => FieldUse::Only("1", |v| v.as_f64() == Some(1.0)),
        "is_encoder_decoder" => FieldUse::Only("false", is_false),
        "quantization_config" => FieldUse::Only(
            "absent: pre-quantized safetensors (GPTQ, AWQ, FP8) are not read; use a GGUF file",
            absent,
        ),
        _ => return None,
    })
}

/// Refuses a config.json with a field the engine does not know or a value it does not run.
pub(super) fn check(raw: &Map<String, Value>) -> Result<(), String> {
    for (key, value) in raw {
        match field_use(key) {
            None => {
                return Err(format!(
                    "field {key:?} is not one this engine knows, so it cannot tell whether the \
                     model needs it"
                ))
            }
            Some(FieldUse::Only(runs, ok)) if !ok(value) => {
                return Err(format!(
                    "{key} {value} is not supported; the engine runs {runs}"
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn checked(v: Value) -> Result<(), String> {
        check(v.as_object().unwrap())
    }

    #[test]
    fn values_the_engine_does_not_run_are_refused_by_name() {
        assert!(checked(json!({"attention_bias": false, "mlp_bias": null})).is_ok());
        let refused = checked(json!({"attention_bias": true})).unwrap_err();
        assert!(
            refused.starts_with("attention_bias true is not supported"),
            "{refused}"
        );
        let quantized = checked(json!({"quantization_config": {"quant_method": "gptq"}}));
        assert!(quantized.unwrap_err().contains("GGUF"));
        assert_eq!(
            checked(json!({"sparse_attention": 1})),
            Err(
                "field \"sparse_attention\" is not one this engine knows, so it cannot tell \
                 whether the model needs it"
                    .into()
            )
        );
    }
}
