//! Loading a mixture of experts: each expert's MLP and the router, by the names each
//! format gives them.

use candle_core::Device;

use super::mlp;
use crate::error::Result;
use crate::model::ffn::{Mixture, Mlp, SharedExpert};
use crate::weights::{Linear, WeightSource};
use text::config::Architecture;
use text::{ModelConfig, MoeConfig};

/// Layer `i`'s mixture of experts.
pub(super) fn mixture(
    cfg: &ModelConfig,
    moe: &MoeConfig,
    src: &mut WeightSource,
    i: usize,
    device: &Device,
) -> Result<Mixture> {
    let (h, inter) = (cfg.hidden_size, moe.expert_intermediate_size);
    let gguf = src.is_gguf();
    let router = if gguf {
        format!("blk.{i}.ffn_gate_inp.weight")
    } else {
        format!("{}.gate.weight", hf_block(cfg, i))
    };
    let router = src.linear(&router, None, (moe.experts, h), device)?;
    let experts = if gguf {
        gguf_experts(cfg, moe.experts, src, i, (inter, h), device)?
    } else {
        (0..moe.experts)
            .map(|e| {
                let [gate, up, down] = hf_expert(cfg, i, e);
                mlp(src, [&gate, &up, &down], (inter, h), cfg.hidden_act, device)
            })
            .collect::<Result<_>>()?
    };
    let shared = match moe.shared_expert_intermediate_size {
        Some(width) => Some(shared_expert(cfg, src, i, width, device)?),
        None => None,
    };
    Ok(Mixture::new(
        router,
        experts,
        moe.experts_per_token,
        moe.normalize_top_k,
        shared,
    ))
}

/// Layer `i`'s shared expert, `width` wide, and its gate: `[1, hidden]` in a Hugging Face
/// file, `[hidden]` in a GGUF one.
fn shared_expert(
    cfg: &ModelConfig,
    src: &mut WeightSource,
    i: usize,
    width: usize,
    device: &Device,
) -> Result<SharedExpert> {
    let h = cfg.hidden_size;
    let (names, gate) = if src.is_gguf() {
        let names = ["gate", "up", "down"].map(|p| format!("blk.{i}.ffn_{p}_shexp.weight"));
        let gate = src.dense_shaped(&format!("blk.{i}.ffn_gate_inp_shexp.weight"), &[h], device)?;
        (names, Linear::dense(gate.reshape((1, h))?))
    } else {
        let block = hf_block(cfg, i);
        let names =
            ["gate", "up", "down"].map(|p| format!("{block}.shared_expert.{p}_proj.weight"));
        let gate = format!("{block}.shared_expert_gate.weight");
        (names, src.linear(&gate, None, (1, h), device)?)
    };
    let [g, u, d] = &names;
    Ok(SharedExpert {
        gate,
        mlp: mlp(src, [g, u, d], (width, h), cfg.hidden_act, device)?,
    })
}

/// The module of layer `i` that holds the router and the experts in a Hugging Face file.
fn hf_block(cfg: &ModelConfig, i: usize) -> String {
    match cfg.architecture {
        Architecture::Mixtral => format!("model.layers.{i}.block_sparse_moe"),
        _ => format!("model.layers.{i}.mlp"),
    }
}

/// Expert `e`'s gate, up and down weights in a Hugging Face file: Mixtral's `w1`, `w3`
/// and `w2`, Qwen's `*_proj`.
fn hf_expert(cfg: &ModelConfig, i: usize, e: usize) -> [String; 3] {
    let block = hf_block(cfg, i);
    let parts = match cfg.architecture {
        Architecture::Mixtral => ["w1", "w3", "w2"],
        _ => ["gate_proj", "up_proj", "down_proj"],
    };
    parts.map(|p| format!("{block}.experts.{e}.{p}.weight"))
}

/// The experts of layer `i` of a GGUF file, where each of gate, up and down is one
/// tensor of all experts.
fn gguf_experts(
    cfg: &ModelConfig,
    experts: usize,
    src: &mut WeightSource,
    i: usize,
    inter_h: (usize, usize),
    device: &Device,
) -> Result<Vec<Mlp>> {
    let [gate, up, down] = ["gate", "up", "down"].map(|p| format!("blk.{i}.ffn_{p}_exps.weight"));
    Ok(src
        .gguf_experts([&gate, &up, &down], experts, inter_h, device)?
        .into_iter()
        .map(|w| Mlp {
            gate_up: w.gate_up,
            down: w.down,
            act: cfg.hidden_act,
        })
        .collect())
}
