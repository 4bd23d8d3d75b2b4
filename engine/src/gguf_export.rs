//! Converts a Hugging Face Qwen2/Llama folder into a GGUF file, quantizing its matrices.
//!
//! The generated test models use it to exercise the GGUF path (and its quantized kernels)
//! with weights whose full-precision answer is known.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;

use crate::error::{EngineError, Result};
use crate::model::gguf_name_of;
use text::config::Architecture;
use text::ModelConfig;

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| EngineError::invalid_model(path, e.to_string()))
}

/// Writes `out` from the folder `dir`; 2-D weights become `quant`, vectors stay f32.
pub fn export_gguf(dir: &Path, out: &Path, quant: GgmlDType) -> Result<()> {
    let cfg = ModelConfig::from_hf_file(&dir.join("config.json"))?;
    if cfg.architecture != Architecture::Qwen2 {
        return Err(EngineError::invalid_model(
            dir,
            "GGUF export handles qwen2 folders (llama would need llama.cpp's q/k permutation)",
        ));
    }
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut q = Vec::new();
    for name in names {
        let gname = gguf_name_of(name)
            .ok_or_else(|| EngineError::invalid_model(dir, format!("unexpected tensor {name}")))?;
        let t = tensors[name].to_dtype(candle_core::DType::F32)?;
        let dtype = if t.rank() == 2 { quant } else { GgmlDType::F32 };
        q.push((gname, QTensor::quantize(&t, dtype)?));
    }

    let tok = read_json(&dir.join("tokenizer.json"))?;
    let tk_cfg = read_json(&dir.join("tokenizer_config.json"))?;
    let vocab = tok["model"]["vocab"]
        .as_object()
        .ok_or_else(|| EngineError::invalid_model(dir, "tokenizer.json has no BPE vocab"))?;
    let added = tok["added_tokens"].as_array().cloned().unwrap_or_default();
    let size = vocab
        .values()
        .chain(added.iter().map(|a| &a["id"]))
        .filter_map(|v| v.as_u64())
        .max()
        .map_or(0, |m| m as usize + 1);
    let mut tokens = vec![String::new(); size];
    let mut types = vec![1i32; size];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap_or(0) as usize] = t.clone();
    }
    for a in &added {
        let id = a["id"].as_u64().unwrap_or(0) as usize;
        tokens[id] = a["content"].as_str().unwrap_or_default().to_string();
        types[id] = if a["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
    }
    let merges: Vec<Value> = tok["model"]["merges"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|m| match m {
            serde_json::Value::Array(pair) => Value::String(
                pair.iter()
                    .filter_map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            other => Value::String(other.as_str().unwrap_or_default().to_string()),
        })
        .collect();
    let id_of = |key: &str| {
        tk_cfg[key]
            .as_str()
            .and_then(|t| tokens.iter().position(|x| x == t))
            .map(|i| i as u32)
    };
    let eos = id_of("eos_token")
        .or(cfg.eos_token_ids.first().copied())
        .unwrap_or(0);
    let pad = id_of("pad_token").unwrap_or(eos);

    let u32v = |v: usize| Value::U32(v as u32);
    let mut md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("qwen2".into())),
        ("general.name", Value::String("tandem-generated".into())),
        ("qwen2.context_length", u32v(cfg.max_position_embeddings)),
        ("qwen2.embedding_length", u32v(cfg.hidden_size)),
        ("qwen2.block_count", u32v(cfg.num_hidden_layers)),
        ("qwen2.feed_forward_length", u32v(cfg.intermediate_size)),
        ("qwen2.attention.head_count", u32v(cfg.num_attention_heads)),
        (
            "qwen2.attention.head_count_kv",
            u32v(cfg.num_key_value_heads),
        ),
        (
            "qwen2.attention.layer_norm_rms_epsilon",
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        ("qwen2.rope.freq_base", Value::F32(cfg.rope_theta as f32)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.iter().cloned().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges", Value::Array(merges)),
        ("tokenizer.ggml.eos_token_id", Value::U32(eos)),
        ("tokenizer.ggml.padding_token_id", Value::U32(pad)),
    ];
    if let Some(t) = tk_cfg["chat_template"].as_str() {
        md.push(("tokenizer.chat_template", Value::String(t.to_string())));
    }
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(out).map_err(|e| EngineError::io(out, e))?;
    gguf_file::write(&mut file, &md_refs, &t_refs)?;
    Ok(())
}
