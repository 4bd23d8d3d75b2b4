//! Mixture-of-experts test models, turned from the generated dense ones: each layer's MLP
//! is replaced by experts and a router.

use std::path::Path;

use candle_core::Device;
use serde_json::{json, Map, Value};

use super::{without_biases, Normal};
use crate::error::Result;

/// Experts per layer of the generated mixtures, and how many each token runs.
pub const EXPERTS: usize = 8;
pub const EXPERTS_PER_TOKEN: usize = 2;
/// How much wider than a plain projection's the router's weights are spread: its logits
/// then differ by more than rounding between the second and third choice, so that the
/// engine and another implementation route every token alike.
const ROUTER_GAIN: f32 = 3.0;

/// Turns the Qwen2 folder `dir` (from [`super::write_model`]) into a Qwen3-MoE one in
/// place, shaped as Qwen3-30B-A3B is: the Qwen3 attention of [`super::into_qwen3`], and in
/// every layer [`EXPERTS`] experts half the dense width, of which each token runs
/// [`EXPERTS_PER_TOKEN`] with their weights normalized (`norm_topk_prob`).
pub fn into_qwen3_moe(dir: &Path, seed: u64) -> Result<()> {
    super::into_qwen3(dir, seed)?;
    let names = |i: usize, e: usize| {
        ["gate_proj", "up_proj", "down_proj"]
            .map(|p| format!("model.layers.{i}.mlp.experts.{e}.{p}.weight"))
    };
    let router = |i: usize| format!("model.layers.{i}.mlp.gate.weight");
    edit_config(dir, |config, dense| {
        config.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
        config.insert("model_type".into(), json!("qwen3_moe"));
        config.insert("num_experts".into(), json!(EXPERTS));
        config.insert("num_experts_per_tok".into(), json!(EXPERTS_PER_TOKEN));
        config.insert("moe_intermediate_size".into(), json!(dense / 2));
        config.insert("norm_topk_prob".into(), json!(true));
        config.insert("decoder_sparse_step".into(), json!(1));
        config.insert("mlp_only_layers".into(), json!([]));
        // Qwen3-MoE's own fields; transformers' Qwen3-MoE does not read max_window_layers.
        config.remove("max_window_layers");
        dense / 2
    })
    .and_then(|width| with_experts(dir, seed, width, names, router))
}

/// Turns the Qwen2 folder `dir` (from [`super::write_model`]) into a Qwen2-MoE one in
/// place, shaped as Qwen1.5-MoE-A2.7B is: Qwen2's attention with its q/k/v biases, and in
/// every layer [`EXPERTS`] experts half the dense width, [`EXPERTS_PER_TOKEN`] run per
/// token with their softmax weights as they are, and a shared expert of the dense width
/// behind a sigmoid gate.
pub fn into_qwen2_moe(dir: &Path, seed: u64) -> Result<()> {
    let width = edit_config(dir, |config, dense| {
        config.insert("architectures".into(), json!(["Qwen2MoeForCausalLM"]));
        config.insert("model_type".into(), json!("qwen2_moe"));
        config.insert("num_experts".into(), json!(EXPERTS));
        config.insert("num_experts_per_tok".into(), json!(EXPERTS_PER_TOKEN));
        config.insert("moe_intermediate_size".into(), json!(dense / 2));
        config.insert("shared_expert_intermediate_size".into(), json!(dense));
        config.insert("norm_topk_prob".into(), json!(false));
        config.insert("decoder_sparse_step".into(), json!(1));
        config.insert("mlp_only_layers".into(), json!([]));
        config.insert("qkv_bias".into(), json!(true));
        dense / 2
    })?;
    let block = |i: usize| format!("model.layers.{i}.mlp");
    let names = move |i: usize, e: usize| {
        ["gate_proj", "up_proj", "down_proj"]
            .map(|p| format!("{}.experts.{e}.{p}.weight", block(i)))
    };
    with_experts(dir, seed, width, names, |i| {
        format!("{}.gate.weight", block(i))
    })?;
    with_shared_expert(dir, seed, 2 * width, block)
}

/// Turns the Qwen2 folder `dir` (from [`super::write_model`]) into a Mixtral one in
/// place: no biases, no window (as Mixtral 8x7B's config has it), and in every layer
/// [`EXPERTS`] experts of the dense width, [`EXPERTS_PER_TOKEN`] run per token.
pub fn into_mixtral(dir: &Path, seed: u64) -> Result<()> {
    without_biases(dir, |config| {
        config.insert("architectures".into(), json!(["MixtralForCausalLM"]));
        config.insert("model_type".into(), json!("mixtral"));
        config.insert("sliding_window".into(), Value::Null);
        config.insert("num_local_experts".into(), json!(EXPERTS));
        config.insert("num_experts_per_tok".into(), json!(EXPERTS_PER_TOKEN));
        config.insert("router_jitter_noise".into(), json!(0.0));
    })?;
    let width = edit_config(dir, |_, dense| dense)?;
    let names = |i: usize, e: usize| {
        ["w1", "w3", "w2"]
            .map(|p| format!("model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight"))
    };
    let router = |i: usize| format!("model.layers.{i}.block_sparse_moe.gate.weight");
    with_experts(dir, seed, width, names, router)
}

/// Rewrites `dir`'s config.json with `edit`, which is given the dense MLP width and
/// returns the experts' width.
fn edit_config(
    dir: &Path,
    edit: impl FnOnce(&mut Map<String, Value>, usize) -> usize,
) -> Result<usize> {
    super::edit_config(dir, |config| {
        let dense = config["intermediate_size"].as_u64().unwrap_or_default() as usize;
        edit(config, dense)
    })
}

/// Replaces every layer's dense MLP with [`EXPERTS`] experts `width` wide, named by
/// `names(layer, expert)` (gate, up, down), and a router named `router(layer)`.
fn with_experts(
    dir: &Path,
    seed: u64,
    width: usize,
    names: impl Fn(usize, usize) -> [String; 3],
    router: impl Fn(usize) -> String,
) -> Result<()> {
    let path = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let dtype = w["model.embed_tokens.weight"].dtype();
    let hidden = w["model.norm.weight"].dim(0)?;
    let layers = w
        .keys()
        .filter(|k| k.ends_with("mlp.down_proj.weight"))
        .count();
    w.retain(|name, _| !name.contains(".mlp."));
    let mut rng = Normal(crate::sampling::SplitMix64::new(seed ^ 0x004d_6f45));
    for i in 0..layers {
        let std = ROUTER_GAIN / (hidden as f32).sqrt();
        let gate = rng.tensor(&[EXPERTS, hidden], 0.0, std)?;
        w.insert(router(i), gate.to_dtype(dtype)?);
        for e in 0..EXPERTS {
            let [gate, up, down] = names(i, e);
            for (name, shape) in [
                (gate, [width, hidden]),
                (up, [width, hidden]),
                (down, [hidden, width]),
            ] {
                let t = rng.tensor(&shape, 0.0, (1.0 / shape[1] as f32).sqrt())?;
                w.insert(name, t.to_dtype(dtype)?);
            }
        }
    }
    candle_core::safetensors::save(&w, &path)?;
    Ok(())
}

/// Gives every layer of `dir` a shared expert `width` wide and its gate, under the module
/// `block(layer)` names.
fn with_shared_expert(
    dir: &Path,
    seed: u64,
    width: usize,
    block: impl Fn(usize) -> String,
) -> Result<()> {
    let path = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let dtype = w["model.embed_tokens.weight"].dtype();
    let hidden = w["model.norm.weight"].dim(0)?;
    let layers = w.keys().filter(|k| k.ends_with(".gate.weight")).count();
    let mut rng = Normal(crate::sampling::SplitMix64::new(seed ^ 0x0053_6845));
    for i in 0..layers {
        let b = block(i);
        let gate = rng.tensor(&[1, hidden], 0.0, (1.0 / hidden as f32).sqrt())?;
        w.insert(
            format!("{b}.shared_expert_gate.weight"),
            gate.to_dtype(dtype)?,
        );
        for (part, shape) in [
            ("gate", [width, hidden]),
            ("up", [width, hidden]),
            ("down", [hidden, width]),
        ] {
            let t = rng.tensor(&shape, 0.0, (1.0 / shape[1] as f32).sqrt())?;
            w.insert(
                format!("{b}.shared_expert.{part}_proj.weight"),
                t.to_dtype(dtype)?,
            );
        }
    }
    candle_core::safetensors::save(&w, &path)?;
    Ok(())
}
