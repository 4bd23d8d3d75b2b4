//! Gemma test models, turned from the generated Qwen2 one: its tokenizer and template are
//! kept, its weights made anew in Gemma's layout with every distinctive part switched on.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{json, Map, Value};

use super::{edit_config, Normal};
use crate::error::Result;

/// The sliding window of the Gemma models: shorter than every reference prompt.
pub const GEMMA_WINDOW: usize = 16;
/// Heads twice the plain width, as Gemma's are wider than `hidden_size / heads`.
const HEAD_DIM_FACTOR: usize = 2;
/// A `query_pre_attn_scalar` other than the head size, so that reading it matters.
const QUERY_PRE_ATTN_SCALAR: usize = 24;
/// Soft caps tight enough to change what the tiny models compute.
const ATTN_SOFTCAP: f64 = 2.0;
const FINAL_SOFTCAP: f64 = 30.0;
/// The standard deviation of the embeddings, times `sqrt(hidden)`: small enough that the
/// scaled embedding does not drown the layers' sums, or through the tied head a random
/// model repeats its input token.
const EMBED_GAIN: f32 = 0.4;
/// The final norm's mean weight offset: it multiplies the logits by about 17, so that the
/// greedy choice is not a near-tie and the final soft cap bends them.
const FINAL_NORM_OFFSET: f32 = 16.0;

/// Turns the Qwen2 folder `dir` (from [`super::write_model`]) into a Gemma 2 one in
/// place: its layers alternate a window of [`GEMMA_WINDOW`] and the whole context,
/// attention scores and logits are soft-capped, and queries are scaled by a
/// `query_pre_attn_scalar` other than the head size.
pub fn into_gemma2(dir: &Path, seed: u64) -> Result<()> {
    into_gemma(dir, seed, 2, false, |config| {
        config.insert("architectures".into(), json!(["Gemma2ForCausalLM"]));
        config.insert("model_type".into(), json!("gemma2"));
        config.insert("attn_logit_softcapping".into(), json!(ATTN_SOFTCAP));
        config.insert("final_logit_softcapping".into(), json!(FINAL_SOFTCAP));
        config.insert("rope_theta".into(), json!(10_000.0));
    })
}

/// Turns the Qwen2 folder `dir` into a Gemma 3 one in place, shaped as Gemma 3 4B's
/// text model is: per-head q/k norms, five sliding layers of six, the global layer
/// rotated by a base of 1e6 scaled linearly by 8 and the sliding ones by 1e4, and (unlike
/// Gemma 3's own checkpoints, to cover it) the logits soft-capped.
pub fn into_gemma3(dir: &Path, seed: u64) -> Result<()> {
    into_gemma(dir, seed, 6, true, |config| {
        config.insert("architectures".into(), json!(["Gemma3ForCausalLM"]));
        config.insert("model_type".into(), json!("gemma3_text"));
        config.insert("attn_logit_softcapping".into(), Value::Null);
        config.insert("final_logit_softcapping".into(), json!(FINAL_SOFTCAP));
        config.insert("rope_theta".into(), json!(1_000_000.0));
        config.insert("rope_local_base_freq".into(), json!(10_000.0));
        config.insert(
            "rope_scaling".into(),
            json!({"rope_type": "linear", "factor": 8.0}),
        );
        config.insert("sliding_window_pattern".into(), json!(6));
    })
}

/// Rewrites `dir` as a Gemma of `layers` layers (with q/k norms if `qk_norm`), its config
/// finished by `edit`.
fn into_gemma(
    dir: &Path,
    seed: u64,
    layers: usize,
    qk_norm: bool,
    edit: impl FnOnce(&mut Map<String, Value>),
) -> Result<()> {
    let dims = edit_config(dir, |config| {
        let field = |k: &str| config[k].as_u64().unwrap_or_default() as usize;
        let dims = GemmaDims {
            vocab: field("vocab_size"),
            hidden: field("hidden_size"),
            inter: field("intermediate_size"),
            heads: field("num_attention_heads"),
            kv_heads: field("num_key_value_heads"),
            head_dim: HEAD_DIM_FACTOR * field("hidden_size") / field("num_attention_heads"),
            layers,
        };
        for qwen in [
            "hidden_act",
            "use_sliding_window",
            "max_window_layers",
            "rope_theta",
        ] {
            config.remove(qwen);
        }
        config.insert("num_hidden_layers".into(), json!(layers));
        config.insert("head_dim".into(), json!(dims.head_dim));
        config.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
        config.insert("query_pre_attn_scalar".into(), json!(QUERY_PRE_ATTN_SCALAR));
        config.insert("sliding_window".into(), json!(GEMMA_WINDOW));
        config.insert("tie_word_embeddings".into(), json!(true));
        config.insert("attention_bias".into(), json!(false));
        edit(config);
        dims
    })?;
    let path = dir.join("model.safetensors");
    let dtype = candle_core::safetensors::load(&path, &Device::Cpu)?["model.norm.weight"].dtype();
    let w = dims.weights(seed, qk_norm)?;
    let w = w
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    candle_core::safetensors::save(&w, &path)?;
    Ok(())
}

/// The shapes of a generated Gemma.
struct GemmaDims {
    vocab: usize,
    hidden: usize,
    inter: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
}

impl GemmaDims {
    /// Every weight, the norms as Gemma stores them (offsets from 1).
    fn weights(&self, seed: u64, qk_norm: bool) -> Result<HashMap<String, Tensor>> {
        let (h, hd) = (self.hidden, self.head_dim);
        let mut rng = Normal(crate::sampling::SplitMix64::new(seed ^ 0x0047_656d));
        let mut w = HashMap::new();
        let std = EMBED_GAIN / (h as f32).sqrt();
        w.insert(
            "model.embed_tokens.weight".to_string(),
            rng.tensor(&[self.vocab, h], 0.0, std)?,
        );
        let norm = rng.tensor(&[h], FINAL_NORM_OFFSET, 0.1)?;
        w.insert("model.norm.weight".into(), norm);
        let proj = |rng: &mut Normal, out: usize, inp: usize| {
            rng.tensor(&[out, inp], 0.0, (1.0 / inp as f32).sqrt())
        };
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            for norm in [
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ] {
                w.insert(format!("{p}.{norm}.weight"), rng.tensor(&[h], 0.0, 0.1)?);
            }
            if qk_norm {
                for norm in ["q_norm", "k_norm"] {
                    let t = rng.tensor(&[hd], 0.0, 0.1)?;
                    w.insert(format!("{p}.self_attn.{norm}.weight"), t);
                }
            }
            for (name, out, inp) in [
                ("self_attn.q_proj", self.heads * hd, h),
                ("self_attn.k_proj", self.kv_heads * hd, h),
                ("self_attn.v_proj", self.kv_heads * hd, h),
                ("self_attn.o_proj", h, self.heads * hd),
                ("mlp.gate_proj", self.inter, h),
                ("mlp.up_proj", self.inter, h),
                ("mlp.down_proj", h, self.inter),
            ] {
                w.insert(format!("{p}.{name}.weight"), proj(&mut rng, out, inp)?);
            }
        }
        Ok(w)
    }
}
