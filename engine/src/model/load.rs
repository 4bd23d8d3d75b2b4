//! Loading a model: the tensor names of each format, the layers read from them, and the
//! checks that the files hold exactly the model the engine runs.

use std::path::Path;

use candle_core::Device;

use super::ffn::{Ffn, Mlp};
use super::{Layer, Model, QkNorm, RopeTables};
use crate::embedding::Embedding;
use crate::error::{EngineError, Result};
use crate::kv_cache::KvDtype;
use crate::progress::LoadStep;
use crate::rope::Frequencies;
use crate::weights::{DenseMatrices, Linear, Stacked, WeightSource};
use candle_core::Tensor;
use text::config::{Activation, Architecture};
use text::ModelConfig;

mod experts;

/// Layer names in the two formats.
struct Names {
    embed: &'static str,
    norm: &'static str,
    lm_head: &'static str,
    layer: fn(usize, &str) -> String,
}

const HF_NAMES: Names = Names {
    embed: "model.embed_tokens.weight",
    norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    layer: |i, part| {
        let hf = match part {
            "attn_norm" => "input_layernorm",
            "mlp_norm" => "post_attention_layernorm",
            "q" => "self_attn.q_proj",
            "k" => "self_attn.k_proj",
            "v" => "self_attn.v_proj",
            "o" => "self_attn.o_proj",
            "q_norm" => "self_attn.q_norm",
            "k_norm" => "self_attn.k_norm",
            "gate" => "mlp.gate_proj",
            "up" => "mlp.up_proj",
            "qkv" => "self_attn.qkv_proj",
            "gate_up" => "mlp.gate_up_proj",
            _ => "mlp.down_proj",
        };
        format!("model.layers.{i}.{hf}")
    },
};

/// Gemma's folders: its `post_attention_layernorm` norms the attention's output, and
/// the feed-forward's input and output have norms of their own.
const GEMMA_HF_NAMES: Names = Names {
    layer: |i, part| match part {
        "post_attn_norm" => format!("model.layers.{i}.post_attention_layernorm"),
        "mlp_norm" => format!("model.layers.{i}.pre_feedforward_layernorm"),
        "post_ffn_norm" => format!("model.layers.{i}.post_feedforward_layernorm"),
        _ => (HF_NAMES.layer)(i, part),
    },
    ..HF_NAMES
};

const GGUF_NAMES: Names = Names {
    embed: "token_embd.weight",
    norm: "output_norm.weight",
    lm_head: "output.weight",
    layer: |i, part| {
        let g = match part {
            "attn_norm" => "attn_norm",
            "mlp_norm" => "ffn_norm",
            "post_attn_norm" => "post_attention_norm",
            "post_ffn_norm" => "post_ffw_norm",
            "q" => "attn_q",
            "k" => "attn_k",
            "v" => "attn_v",
            "o" => "attn_output",
            "q_norm" => "attn_q_norm",
            "k_norm" => "attn_k_norm",
            "gate" => "ffn_gate",
            "up" => "ffn_up",
            "qkv" => "attn_qkv",
            // llama.cpp's converter writes Phi-3's fused gate and up as `ffn_up`.
            "gate_up" => "ffn_up",
            _ => "ffn_down",
        };
        format!("blk.{i}.{g}")
    },
};

/// The parts of a layer, as `Names::layer` knows them.
const LAYER_PARTS: [&str; 11] = [
    "attn_norm",
    "mlp_norm",
    "q",
    "k",
    "v",
    "o",
    "q_norm",
    "k_norm",
    "gate",
    "up",
    "down",
];

/// The GGUF name of a Hugging Face tensor name, from the tables the loader reads by.
pub(crate) fn gguf_name_of(hf: &str) -> Option<String> {
    let whole = [
        (HF_NAMES.embed, GGUF_NAMES.embed),
        (HF_NAMES.norm, GGUF_NAMES.norm),
        (HF_NAMES.lm_head, GGUF_NAMES.lm_head),
    ];
    if let Some((_, g)) = whole.iter().find(|(h, _)| *h == hf) {
        return Some(g.to_string());
    }
    let (module, kind) = hf.rsplit_once('.')?;
    let layer: usize = hf
        .strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()?;
    LAYER_PARTS
        .iter()
        .find(|part| (HF_NAMES.layer)(layer, part) == module)
        .map(|part| format!("{}.{kind}", (GGUF_NAMES.layer)(layer, part)))
}

impl Model {
    /// Loads a Hugging Face folder (`config.json` + safetensors) or a `.gguf` file.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let cfg = if path.is_dir() {
            ModelConfig::from_hf_file(&path.join("config.json"))?
        } else {
            ModelConfig::from_gguf(&text::gguf::Metadata::open(path)?, path)?
        };
        Self::load_with(path, cfg, device)
    }

    /// Loads the weights at `path` for hyper-parameters already read from it (as
    /// `text::load` reads them with the tokenizer), so that they are read once.
    pub fn load_with(path: &Path, cfg: ModelConfig, device: &Device) -> Result<Self> {
        let matrices = DenseMatrices::for_device(device);
        Self::load_reporting(path, cfg, device, matrices, &mut |_| {})
    }

    /// [`Model::load_with`], a folder's matrices held as `matrices` say, calling `report`
    /// after each layer built.
    pub fn load_reporting(
        path: &Path,
        cfg: ModelConfig,
        device: &Device,
        matrices: DenseMatrices,
        report: &mut dyn FnMut(LoadStep),
    ) -> Result<Self> {
        if matrices == DenseMatrices::InPlace && !device.is_cpu() {
            return Err(EngineError::DeviceUnavailable {
                device: format!("{:?}", device.location()),
                reason: "a folder's matrices are used in place by the CPU alone".into(),
            });
        }
        let mut src = if path.is_dir() {
            WeightSource::open_hf_folder(path, matrices)?
        } else {
            WeightSource::open_gguf(path)?
        };
        Self::load_source(cfg, &mut src, device, report)
    }

    /// The model whose weights `src` holds (opened from a folder or a GGUF file).
    pub(crate) fn load_source(
        cfg: ModelConfig,
        src: &mut WeightSource,
        device: &Device,
        report: &mut dyn FnMut(LoadStep),
    ) -> Result<Self> {
        let names = match src {
            WeightSource::Gguf { .. } => &GGUF_NAMES,
            WeightSource::SafeTensors { .. } if cfg.gemma.is_some() => &GEMMA_HF_NAMES,
            WeightSource::SafeTensors { .. } => &HF_NAMES,
        };
        Self::from_source(cfg, src, names, device, report)
    }

    fn from_source(
        cfg: ModelConfig,
        src: &mut WeightSource,
        names: &Names,
        device: &Device,
        report: &mut dyn FnMut(LoadStep),
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let embed = src.embedding(names.embed, (cfg.vocab_size, h), device)?;
        let count = cfg.num_hidden_layers;
        let layers = (0..count)
            .map(|i| {
                let built = layer(&cfg, src, names, i, device)?;
                report(LoadStep::LayerBuilt {
                    done: i + 1,
                    layers: count,
                });
                Ok(built)
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = norm_weight(&cfg, src, names.norm, h, device)?;
        let head_name = if !cfg.tie_word_embeddings && src.contains(names.lm_head) {
            names.lm_head
        } else {
            names.embed
        };
        // A folder's tied head multiplies by the embedding table itself: reading it again
        // would hold a second f32 copy of a bf16 table.
        let (lm_head, embed_is_head) = match &embed {
            Embedding::Dense(table) if head_name == names.embed => {
                (Linear::dense(table.clone()), true)
            }
            _ => {
                let head = src.linear(head_name, None, (cfg.vocab_size, h), device)?;
                // A table used in place is the head's own pages, held once.
                let shared = head_name == names.embed && head.in_place();
                (head, shared)
            }
        };
        let divisors = rope_divisors(&cfg, src, device)?;
        refuse_unread(&cfg, src, names)?;
        let (rope, sliding_rope) = rope_tables(&cfg, divisors.as_deref(), device)?;
        Ok(Self {
            cfg,
            device: device.clone(),
            embed,
            layers,
            norm,
            lm_head,
            embed_is_head,
            rope,
            sliding_rope,
            kv_dtype: KvDtype::default(),
        })
    }
}

/// Layer `i`'s weights.
fn layer(
    cfg: &ModelConfig,
    src: &mut WeightSource,
    names: &Names,
    i: usize,
    device: &Device,
) -> Result<Layer> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let w = |part: &str| format!("{}.weight", (names.layer)(i, part));
    let mut norm = |part: &str, dim: usize| norm_weight(cfg, src, &w(part), dim, device);
    let attn_norm = norm("attn_norm", h)?;
    let qk_norm = if cfg.has_qk_norm() {
        Some(QkNorm {
            q: norm("q_norm", hd)?,
            k: norm("k_norm", hd)?,
        })
    } else {
        None
    };
    let mlp_norm = norm("mlp_norm", h)?;
    let (post_attn_norm, post_ffn_norm) = if cfg.gemma.is_some() {
        (
            Some(norm("post_attn_norm", h)?),
            Some(norm("post_ffn_norm", h)?),
        )
    } else {
        (None, None)
    };
    let q_out = cfg.num_attention_heads * hd;
    Ok(Layer {
        attn_norm,
        qkv: qkv(cfg, src, names, i, device)?,
        qk_norm,
        o: src.linear(&w("o"), None, (h, q_out), device)?,
        post_attn_norm,
        mlp_norm,
        post_ffn_norm,
        ffn: feed_forward(cfg, src, names, i, device)?,
    })
}

/// Layer `i`'s q, k and v projections: one matrix for Phi-3, which stores them so.
fn qkv(
    cfg: &ModelConfig,
    src: &mut WeightSource,
    names: &Names,
    i: usize,
    device: &Device,
) -> Result<Stacked> {
    let h = cfg.hidden_size;
    let q_out = cfg.num_attention_heads * cfg.head_dim;
    let kv_out = cfg.num_key_value_heads * cfg.head_dim;
    let n = |part: &str| (names.layer)(i, part);
    let w = |part: &str| format!("{}.weight", n(part));
    if cfg.architecture == Architecture::Phi3 {
        return src.fused(&w("qkv"), &[q_out, kv_out, kv_out], h, device);
    }
    // Qwen2 adds biases to q, k and v, and llama.cpp's llama graph adds them where a GGUF
    // file has them; transformers' other models here have none (`attention_bias` is
    // refused unless false), so a folder that holds them is refused as unread.
    let biases = cfg.reads_qkv_biases(src.is_gguf());
    let b = |part: &str| biases.then(|| format!("{}.bias", n(part)));
    src.stacked(
        &[
            (&w("q"), b("q").as_deref(), q_out),
            (&w("k"), b("k").as_deref(), kv_out),
            (&w("v"), b("v").as_deref(), kv_out),
        ],
        h,
        device,
    )
}

/// Layer `i`'s feed-forward: the mixture where the model has one in this layer, else the
/// gated MLP (its gate and up one matrix for Phi-3).
fn feed_forward(
    cfg: &ModelConfig,
    src: &mut WeightSource,
    names: &Names,
    i: usize,
    device: &Device,
) -> Result<Ffn> {
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let w = |part: &str| format!("{}.weight", (names.layer)(i, part));
    if let Some(moe) = cfg.moe.as_ref().filter(|m| m.sparse_layers[i]) {
        return Ok(Ffn::Mixture(experts::mixture(cfg, moe, src, i, device)?));
    }
    if cfg.architecture == Architecture::Phi3 {
        return Ok(Ffn::Dense(Mlp {
            gate_up: src.fused(&w("gate_up"), &[inter, inter], h, device)?,
            down: src.linear(&w("down"), None, (h, inter), device)?,
            act: cfg.hidden_act,
        }));
    }
    Ok(Ffn::Dense(mlp(
        src,
        [&w("gate"), &w("up"), &w("down")],
        (inter, h),
        cfg.hidden_act,
        device,
    )?))
}

/// An RMSNorm weight of `dim`, with the offset the files store it by
/// ([`ModelConfig::norm_weight_offset`]) added back.
fn norm_weight(
    cfg: &ModelConfig,
    src: &mut WeightSource,
    name: &str,
    dim: usize,
    device: &Device,
) -> Result<Tensor> {
    let w = src.dense_shaped(name, &[dim], device)?;
    let offset = cfg.norm_weight_offset(src.is_gguf());
    if offset == 0.0 {
        return Ok(w);
    }
    Ok((w + offset)?)
}

/// The rotary tables of every layer, and of the sliding-window layers where they rotate
/// by a RoPE of their own.
fn rope_tables(
    cfg: &ModelConfig,
    divisors: Option<&[f32]>,
    device: &Device,
) -> Result<(RopeTables, Option<RopeTables>)> {
    let positions = cfg.max_position_embeddings;
    let tables = |f: Frequencies| -> Result<RopeTables> {
        let (cos, sin) = f.tables(positions, device)?;
        Ok(RopeTables { cos, sin })
    };
    let sliding = cfg.gemma.as_ref().and_then(|g| g.sliding_rope.as_ref());
    let sliding = match sliding {
        Some(r) => Some(tables(Frequencies::of_rope(
            r.theta,
            &r.scaling,
            cfg.rotary_dim,
            None,
        ))?),
        None => None,
    };
    Ok((tables(Frequencies::of(cfg, divisors))?, sliding))
}

/// A gated MLP from its gate, up and down weights, `inter` wide over `h` inputs.
pub(super) fn mlp(
    src: &mut WeightSource,
    [gate, up, down]: [&str; 3],
    (inter, h): (usize, usize),
    act: Activation,
    device: &Device,
) -> Result<Mlp> {
    Ok(Mlp {
        gate_up: src.stacked(&[(gate, None, inter), (up, None, inter)], h, device)?,
        down: src.linear(down, None, (h, inter), device)?,
        act,
    })
}

/// Refuses a model whose files hold a tensor the engine never read: a part of the model
/// it does not implement would otherwise be skipped without a word. Two are left unread on
/// purpose, as transformers leaves them: the rotary `inv_freq` buffers older checkpoints
/// saved (the engine computes them from the config), and the output head of a model whose
/// config ties it to the embeddings.
fn refuse_unread(cfg: &ModelConfig, src: &WeightSource, names: &Names) -> Result<()> {
    let skipped = |n: &String| {
        n.ends_with(".rotary_emb.inv_freq") || (cfg.tie_word_embeddings && n == names.lm_head)
    };
    let unread: Vec<String> = src.unread().into_iter().filter(|n| !skipped(n)).collect();
    if unread.is_empty() {
        return Ok(());
    }
    let shown = unread[..unread.len().min(5)].join(", ");
    Err(EngineError::invalid_model(
        src.path(),
        format!(
            "{} tensor(s) of the file are not used by this engine's {} model, so it cannot run \
             the model the file holds: {shown}",
            unread.len(),
            cfg.architecture
        ),
    ))
}

/// The per-frequency divisors of a GGUF file's RoPE tensors: a llama file's `rope_freqs`
/// (how llama.cpp's converter writes Llama 3's scaling), or a Phi-3 file's LongRoPE
/// factors, the long ones when the served context is past the original one (as llama.cpp
/// takes them for its context). Only those graphs of llama.cpp apply them, so another
/// architecture carrying one is refused rather than run without it.
fn rope_divisors(
    cfg: &ModelConfig,
    src: &mut WeightSource,
    device: &Device,
) -> Result<Option<Vec<f32>>> {
    const FREQS: &str = "rope_freqs.weight";
    const LONG: &str = "rope_factors_long.weight";
    const SHORT: &str = "rope_factors_short.weight";
    let pairs = [cfg.rotary_dim / 2];
    let refused = |src: &WeightSource, name: &str| {
        EngineError::invalid_model(
            src.path(),
            format!(
                "{name} is not supported for architecture {}",
                cfg.architecture
            ),
        )
    };
    if src.contains(FREQS) {
        if cfg.architecture != Architecture::Llama {
            return Err(refused(src, FREQS));
        }
        return Ok(Some(src.dense_shaped(FREQS, &pairs, device)?.to_vec1()?));
    }
    if !src.contains(LONG) && !src.contains(SHORT) {
        return Ok(None);
    }
    let text::RopeScaling::LongRope {
        original_max_position_embeddings: original,
        ..
    } = cfg.rope_scaling
    else {
        return Err(refused(src, LONG));
    };
    let long = src.dense_shaped(LONG, &pairs, device)?;
    let short = src.dense_shaped(SHORT, &pairs, device)?;
    let chosen = if text::longrope_uses_long_factors(cfg.max_position_embeddings, original) {
        long
    } else {
        short
    };
    Ok(Some(chosen.to_vec1()?))
}
