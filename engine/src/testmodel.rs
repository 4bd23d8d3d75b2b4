//! Deterministic test models written as Hugging Face folders.
//!
//! A Qwen2 model with fixed-seed random weights, a byte-level BPE tokenizer trained on
//! `data/corpus.txt`, and a ChatML template with tools and thinking. `transformers` loads
//! the same folder, which is how the engine is checked against the reference implementation.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{EngineError, Result};
use text::tokenizer::QWEN2_SPLIT;
use text::TextError;

mod gemma;
mod moe;
mod phi;
pub use gemma::{into_gemma2, into_gemma3, GEMMA_WINDOW};
pub use moe::{into_mixtral, into_qwen2_moe, into_qwen3_moe};
pub use phi::{into_phi3, PHI3_ORIGINAL_CONTEXT};

/// An architecture the generated tiny model takes: Qwen2 as written, every other by its
/// `into_*`. One list for every test that runs each family and for `tandem-model --family`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Family {
    /// Qwen2: q/k/v biases (the model as written).
    Qwen2,
    /// Qwen3: per-head q/k norms, no q/k/v biases, heads twice the plain width.
    Qwen3,
    /// Mistral: no biases, a sliding window of 16 positions in every layer.
    Mistral,
    /// Llama 3.1: no biases, Llama 3's RoPE scaling past a context of 64.
    Llama3,
    /// Qwen3-MoE: Qwen3's attention, 8 experts per layer, 2 per token, normalized.
    Qwen3Moe,
    /// Mixtral: no biases, 8 experts per layer, 2 per token.
    Mixtral,
    /// Qwen2-MoE: q/k/v biases, 8 experts per layer, 2 per token, and a shared expert.
    Qwen2Moe,
    /// Gemma 2: alternating windows of 16, soft caps, Gemma's norms and GeLU.
    Gemma2,
    /// Gemma 3: q/k norms, five sliding layers of six, a local and a global RoPE.
    Gemma3,
    /// Phi-3 (Phi-4-mini's shape): fused q/k/v and gate/up, partial rotary, LongRoPE.
    Phi3,
}

impl Family {
    /// The families beside the generated model's own (Qwen2) that the serving tests run:
    /// every distinctive layout (Llama 3 differs from Qwen2 in its RoPE table alone).
    pub const SERVED: [Family; 8] = [
        Family::Qwen3,
        Family::Mistral,
        Family::Qwen3Moe,
        Family::Mixtral,
        Family::Qwen2Moe,
        Family::Gemma2,
        Family::Gemma3,
        Family::Phi3,
    ];

    /// The family's `model_type`, which also names its folders.
    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Llama3 => "llama3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
        }
    }

    /// Turns the generated model in `dir` (written with `seed`) into this family.
    pub fn turn(self, dir: &Path, seed: u64) -> Result<()> {
        match self {
            Family::Qwen2 => Ok(()),
            Family::Qwen3 => into_qwen3(dir, seed),
            Family::Mistral => into_mistral(dir),
            Family::Llama3 => into_llama3(dir),
            Family::Qwen3Moe => into_qwen3_moe(dir, seed),
            Family::Mixtral => into_mixtral(dir, seed),
            Family::Qwen2Moe => into_qwen2_moe(dir, seed),
            Family::Gemma2 => into_gemma2(dir, seed),
            Family::Gemma3 => into_gemma3(dir, seed),
            Family::Phi3 => into_phi3(dir),
        }
    }
}

/// Seed of the committed reference models.
pub const DEFAULT_SEED: u64 = 20_261_122;

const CORPUS: &str = include_str!("../data/corpus.txt");
/// The ChatML template the generated models carry.
pub const CHATML_TEMPLATE: &str = text::CHATML_TEMPLATE;
/// Special tokens, matched whole and dropped by `skip_special_tokens`.
const SPECIAL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Added tokens that stay in the text, as Qwen2.5 and Qwen3 treat them.
const MARKUP: [&str; 4] = ["<tool_call>", "</tool_call>", "<think>", "</think>"];

/// Sizes of generated model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelSize {
    /// About 100 thousand parameters: for tests.
    Tiny,
    /// About 25 million parameters: for benchmarks.
    Small,
    /// About a million parameters, every matrix 256 or more wide: for tests of the
    /// K-quants, whose blocks are 256 weights.
    Wide,
}

struct Dims {
    vocab_target: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    max_positions: usize,
    /// Tied heads make random models repeat their input token; the tiny model unties its
    /// head so greedy output varies, and the small one keeps the tied path covered.
    tied: bool,
}

impl ModelSize {
    /// The positions the model's context holds (`max_position_embeddings`).
    pub fn max_positions(self) -> usize {
        self.dims().max_positions
    }

    fn dims(self) -> Dims {
        match self {
            Self::Tiny => Dims {
                vocab_target: 512,
                hidden: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                intermediate: 128,
                max_positions: 2048,
                tied: false,
            },
            Self::Small => Dims {
                vocab_target: 2048,
                hidden: 512,
                layers: 8,
                heads: 8,
                kv_heads: 2,
                intermediate: 1536,
                max_positions: 4096,
                tied: true,
            },
            Self::Wide => Dims {
                vocab_target: 512,
                hidden: 256,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                intermediate: 256,
                max_positions: 2048,
                tied: false,
            },
        }
    }
}

/// Trains the byte-level BPE tokenizer on the bundled corpus.
fn train_tokenizer(vocab_target: usize) -> Result<tokenizers::Tokenizer> {
    let err = |e: tokenizers::Error| EngineError::from(TextError::Tokenizer(e.to_string()));
    let mut tk = tokenizers::Tokenizer::new(BPE::default());
    let split = Split::new(
        SplitPattern::Regex(QWEN2_SPLIT.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(err)?;
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
    ]))));
    tk.with_decoder(Some(ByteLevel::new(false, false, false)));
    let special: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_target)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(special.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    // Chat markup in the corpus is learned as text; the added tokens below take precedence.
    tk.train(&mut trainer, CORPUS.lines().map(|l| format!("{l}\n")))
        .map_err(err)?;
    tk.add_special_tokens(special).map_err(err)?;
    let markup: Vec<AddedToken> = MARKUP
        .iter()
        .map(|s| AddedToken::from(*s, false).normalized(false))
        .collect();
    tk.add_tokens(markup).map_err(err)?;
    Ok(tk)
}

/// SplitMix64 → Box–Muller normal samples; stable across platforms and versions.
struct Normal(crate::sampling::SplitMix64);

impl Normal {
    fn uniform(&mut self) -> f64 {
        ((self.0.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn sample(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    fn tensor(&mut self, shape: &[usize], mean: f32, std: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| mean + std * self.sample()).collect();
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }
}

/// Writes a complete Hugging Face folder for `size` into `dir`.
pub fn write_model(dir: &Path, size: ModelSize, dtype: DType, seed: u64) -> Result<()> {
    let d = size.dims();
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let tk = train_tokenizer(d.vocab_target)?;
    let vocab = tk.get_vocab_size(true);
    let id = |t: &str| tk.token_to_id(t).expect("special token was added");
    let (eos, pad) = (id("<|im_end|>"), id("<|endoftext|>"));
    let tk_path = dir.join("tokenizer.json");
    tk.save(&tk_path, true)
        .map_err(|e| EngineError::from(TextError::Tokenizer(e.to_string())))?;

    let head_dim = d.hidden / d.heads;
    let mut rng = Normal(crate::sampling::SplitMix64::new(seed));
    let mut w: HashMap<String, Tensor> = HashMap::new();
    // Unit-scale embeddings (and head, when untied) make the logits peaked, so greedy
    // decoding is not decided by rounding noise when compared against another implementation.
    w.insert(
        "model.embed_tokens.weight".into(),
        rng.tensor(&[vocab, d.hidden], 0.0, 1.0)?,
    );
    let proj = |rng: &mut Normal, out: usize, inp: usize| {
        rng.tensor(&[out, inp], 0.0, (1.0 / inp as f32).sqrt())
    };
    for i in 0..d.layers {
        let p = format!("model.layers.{i}");
        let q_out = d.heads * head_dim;
        let kv_out = d.kv_heads * head_dim;
        w.insert(
            format!("{p}.input_layernorm.weight"),
            rng.tensor(&[d.hidden], 1.0, 0.1)?,
        );
        w.insert(
            format!("{p}.self_attn.q_proj.weight"),
            proj(&mut rng, q_out, d.hidden)?,
        );
        w.insert(
            format!("{p}.self_attn.q_proj.bias"),
            rng.tensor(&[q_out], 0.0, 0.1)?,
        );
        w.insert(
            format!("{p}.self_attn.k_proj.weight"),
            proj(&mut rng, kv_out, d.hidden)?,
        );
        w.insert(
            format!("{p}.self_attn.k_proj.bias"),
            rng.tensor(&[kv_out], 0.0, 0.1)?,
        );
        w.insert(
            format!("{p}.self_attn.v_proj.weight"),
            proj(&mut rng, kv_out, d.hidden)?,
        );
        w.insert(
            format!("{p}.self_attn.v_proj.bias"),
            rng.tensor(&[kv_out], 0.0, 0.1)?,
        );
        w.insert(
            format!("{p}.self_attn.o_proj.weight"),
            proj(&mut rng, d.hidden, q_out)?,
        );
        w.insert(
            format!("{p}.post_attention_layernorm.weight"),
            rng.tensor(&[d.hidden], 1.0, 0.1)?,
        );
        w.insert(
            format!("{p}.mlp.gate_proj.weight"),
            proj(&mut rng, d.intermediate, d.hidden)?,
        );
        w.insert(
            format!("{p}.mlp.up_proj.weight"),
            proj(&mut rng, d.intermediate, d.hidden)?,
        );
        w.insert(
            format!("{p}.mlp.down_proj.weight"),
            proj(&mut rng, d.hidden, d.intermediate)?,
        );
    }
    w.insert(
        "model.norm.weight".into(),
        rng.tensor(&[d.hidden], 1.0, 0.1)?,
    );
    if !d.tied {
        w.insert(
            "lm_head.weight".into(),
            rng.tensor(&[vocab, d.hidden], 0.0, 1.0)?,
        );
    }
    let w = w
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let st_path = dir.join("model.safetensors");
    candle_core::safetensors::save(&w, &st_path)?;

    let dtype_name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let config = json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": d.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": d.tied,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": d.layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
        "bos_token_id": pad,
        "eos_token_id": [eos, pad],
        "torch_dtype": dtype_name,
    });
    let mut added = serde_json::Map::new();
    for (t, special) in SPECIAL
        .iter()
        .map(|t| (t, true))
        .chain(MARKUP.iter().map(|t| (t, false)))
    {
        added.insert(
            id(t).to_string(),
            json!({"content": t, "lstrip": false, "normalized": false, "rstrip": false,
                   "single_word": false, "special": special}),
        );
    }
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "model_max_length": d.max_positions,
        "clean_up_tokenization_spaces": false,
        "errors": "replace",
        "split_special_tokens": false,
        "chat_template": CHATML_TEMPLATE,
    });
    let generation_config =
        json!({"bos_token_id": pad, "eos_token_id": [eos, pad], "do_sample": false});
    for (name, value) in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).expect("json values serialize");
        std::fs::write(&path, text + "\n").map_err(|e| EngineError::io(&path, e))?;
    }
    Ok(())
}

/// Turns the Qwen2 folder `dir` (from [`write_model`]) into a Qwen3 one in place: the q/k/v
/// biases go, each layer gains the per-head RMSNorm weights of its queries and keys, and
/// the heads are twice as wide as `hidden_size / num_attention_heads`, as Qwen3's own
/// checkpoints have them (0.6B: 1024 / 16 = 64, head_dim 128), with new projections of
/// those shapes; the config names Qwen3 with its explicit head size.
pub fn into_qwen3(dir: &Path, seed: u64) -> Result<()> {
    let st_path = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st_path, &Device::Cpu)?;
    let dtype = w["model.embed_tokens.weight"].dtype();
    let config_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| EngineError::io(&config_path, e))?;
    let mut config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| EngineError::invalid_model(&config_path, e.to_string()))?;
    let field = |k: &str| config[k].as_u64().unwrap_or_default() as usize;
    let (layers, hidden) = (field("num_hidden_layers"), field("hidden_size"));
    let (heads, kv_heads) = (field("num_attention_heads"), field("num_key_value_heads"));
    let head_dim = 2 * hidden / heads;
    w.retain(|name, _| !name.ends_with("_proj.bias"));
    let mut rng = Normal(crate::sampling::SplitMix64::new(seed ^ 0x0051_5745_4e33));
    let mut proj = |out: usize, inp: usize| -> Result<Tensor> {
        let t = rng.tensor(&[out, inp], 0.0, (1.0 / inp as f32).sqrt())?;
        Ok(t.to_dtype(dtype)?)
    };
    for i in 0..layers {
        let p = format!("model.layers.{i}.self_attn");
        for (part, shape) in [
            ("q_proj", (heads * head_dim, hidden)),
            ("k_proj", (kv_heads * head_dim, hidden)),
            ("v_proj", (kv_heads * head_dim, hidden)),
            ("o_proj", (hidden, heads * head_dim)),
        ] {
            w.insert(format!("{p}.{part}.weight"), proj(shape.0, shape.1)?);
        }
    }
    for i in 0..layers {
        for part in ["q_norm", "k_norm"] {
            let norm = rng.tensor(&[head_dim], 1.0, 0.1)?.to_dtype(dtype)?;
            w.insert(format!("model.layers.{i}.self_attn.{part}.weight"), norm);
        }
    }
    candle_core::safetensors::save(&w, &st_path)?;
    config["architectures"] = json!(["Qwen3ForCausalLM"]);
    config["model_type"] = json!("qwen3");
    config["head_dim"] = json!(head_dim);
    config["attention_bias"] = json!(false);
    let text = serde_json::to_string_pretty(&config).expect("json values serialize");
    std::fs::write(&config_path, text + "\n").map_err(|e| EngineError::io(&config_path, e))
}

/// The sliding window of [`into_mistral`]'s model: shorter than every reference prompt,
/// so that each one's later rows see only part of it.
pub const MISTRAL_WINDOW: usize = 16;

/// Turns the Qwen2 folder `dir` (from [`write_model`]) into a Mistral one in place: the
/// q/k/v biases go, and every layer attends to the last [`MISTRAL_WINDOW`] positions.
pub fn into_mistral(dir: &Path) -> Result<()> {
    without_biases(dir, |config| {
        config.insert("architectures".into(), json!(["MistralForCausalLM"]));
        config.insert("model_type".into(), json!("mistral"));
        config.insert("sliding_window".into(), json!(MISTRAL_WINDOW));
    })
}

/// The context [`into_llama3`]'s model was "trained" on: shorter than most reference
/// prompts, so that Llama 3's scaled frequencies decide their later positions.
pub const LLAMA3_ORIGINAL_CONTEXT: usize = 64;

/// Turns the Qwen2 folder `dir` (from [`write_model`]) into a Llama 3.1 one in place: the
/// q/k/v biases go, and RoPE is Llama 3's scaling of a base of 50000 by 8 past an original
/// context of [`LLAMA3_ORIGINAL_CONTEXT`].
pub fn into_llama3(dir: &Path) -> Result<()> {
    without_biases(dir, |config| {
        config.insert("architectures".into(), json!(["LlamaForCausalLM"]));
        config.insert("model_type".into(), json!("llama"));
        config.insert("rope_theta".into(), json!(50000.0));
        config.insert(
            "rope_scaling".into(),
            json!({
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
            }),
        );
        // Qwen2's window fields, which neither Llama nor Mistral has.
        config.remove("sliding_window");
    })
}

/// Drops the q/k/v biases of the folder `dir` and rewrites its config.json with `edit`,
/// after removing Qwen2's sliding-window switches.
fn without_biases(
    dir: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<()> {
    let st_path = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st_path, &Device::Cpu)?;
    w.retain(|name, _| !name.ends_with("_proj.bias"));
    candle_core::safetensors::save(&w, &st_path)?;
    edit_config(dir, |config| {
        config.remove("use_sliding_window");
        config.remove("max_window_layers");
        edit(config);
    })
}

/// Rewrites `dir`'s config.json with `edit`, returning what `edit` returns.
fn edit_config<T>(
    dir: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>) -> T,
) -> Result<T> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
    let mut config: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| EngineError::invalid_model(&path, e.to_string()))?;
    let out = edit(&mut config);
    let text = serde_json::to_string_pretty(&config).expect("json values serialize");
    std::fs::write(&path, text + "\n").map_err(|e| EngineError::io(&path, e))?;
    Ok(out)
}
