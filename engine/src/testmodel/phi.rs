//! The Phi-3 test model, turned from the generated Qwen2 one.

use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use super::edit_config;
use crate::error::Result;

/// The context Phi-3's LongRoPE was "trained" on: shorter than every reference prompt, so
/// that transformers, which takes the long factors once a sequence is past it, rotates
/// every position as the engine does for its context of 2048.
pub const PHI3_ORIGINAL_CONTEXT: usize = 16;
/// The fraction of each head that rotates, as Phi-4-mini's.
const PARTIAL_ROTARY_FACTOR: f64 = 0.75;
/// LongRoPE's factors for the six rotating pairs of a 16-wide head.
const SHORT_FACTORS: [f64; 6] = [1.0, 1.0, 1.05, 1.1, 1.2, 1.3];
const LONG_FACTORS: [f64; 6] = [1.0, 1.5, 2.5, 4.0, 6.0, 8.0];

/// Turns the Qwen2 folder `dir` (from [`super::write_model`]) into a Phi-3 one in place,
/// shaped as Phi-4-mini is: q, k and v in one matrix (without Qwen2's biases), gate and
/// up in another, three quarters of each head rotated, and LongRoPE past an original
/// context of [`PHI3_ORIGINAL_CONTEXT`].
pub fn into_phi3(dir: &Path) -> Result<()> {
    let path = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&path, &Device::Cpu)?;
    w.retain(|name, _| !name.ends_with("_proj.bias"));
    let layers = w.keys().filter(|k| k.ends_with("q_proj.weight")).count();
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let mut take = |part: &str| w.remove(&format!("{p}.{part}.weight"));
        let (Some(q), Some(k), Some(v), Some(gate), Some(up)) = (
            take("self_attn.q_proj"),
            take("self_attn.k_proj"),
            take("self_attn.v_proj"),
            take("mlp.gate_proj"),
            take("mlp.up_proj"),
        ) else {
            continue;
        };
        w.insert(
            format!("{p}.self_attn.qkv_proj.weight"),
            Tensor::cat(&[q, k, v], 0)?,
        );
        w.insert(
            format!("{p}.mlp.gate_up_proj.weight"),
            Tensor::cat(&[gate, up], 0)?,
        );
    }
    candle_core::safetensors::save(&w, &path)?;
    edit_config(dir, |config| {
        for qwen in ["use_sliding_window", "max_window_layers"] {
            config.remove(qwen);
        }
        config.insert("architectures".into(), json!(["Phi3ForCausalLM"]));
        config.insert("model_type".into(), json!("phi3"));
        config.insert("sliding_window".into(), Value::Null);
        config.insert("partial_rotary_factor".into(), json!(PARTIAL_ROTARY_FACTOR));
        config.insert(
            "original_max_position_embeddings".into(),
            json!(PHI3_ORIGINAL_CONTEXT),
        );
        config.insert(
            "rope_scaling".into(),
            json!({"type": "longrope", "short_factor": SHORT_FACTORS,
                   "long_factor": LONG_FACTORS}),
        );
        // Phi3Config's default padding id (32000) is past this vocabulary.
        let pad = config.get("bos_token_id").cloned().unwrap_or(Value::Null);
        config.insert("pad_token_id".into(), pad);
        config.insert("embd_pdrop".into(), json!(0.0));
        config.insert("resid_pdrop".into(), json!(0.0));
    })
}
