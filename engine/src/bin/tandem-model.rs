//! Writes a generated test model as a Hugging Face folder.

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use clap::Parser;
use engine::gguf_export::export_gguf;
use engine::testmodel::{write_model, ModelSize};

#[derive(Debug, Parser)]
#[command(about = "Write a deterministic test model as a Hugging Face folder")]
struct Config {
    /// Folder to write (created if missing).
    #[arg(long, env = "TANDEM_MODEL_OUT")]
    out: PathBuf,
    /// Which size to write.
    #[arg(long, value_enum, default_value = "tiny")]
    size: ModelSize,
    /// Store weights as bf16 instead of f32.
    #[arg(long)]
    bf16: bool,
    /// Also write `model-<QUANT>.gguf` into the folder (f32, f16, q8_0, q4_0, q4_1).
    #[arg(long, value_parser = parse_quant)]
    gguf: Option<GgmlDType>,
    /// The architecture to write.
    #[arg(long, value_enum, default_value = "qwen2")]
    family: Family,
    /// Seed for the random weights.
    #[arg(long, default_value_t = engine::testmodel::DEFAULT_SEED)]
    seed: u64,
}

/// The architectures a generated model can take.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Family {
    /// Qwen2: q/k/v biases.
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

fn main() -> anyhow::Result<()> {
    let cfg = Config::parse();
    let dtype = if cfg.bf16 {
        candle_core::DType::BF16
    } else {
        candle_core::DType::F32
    };
    write_model(&cfg.out, cfg.size, dtype, cfg.seed)?;
    match cfg.family {
        Family::Qwen2 => {}
        Family::Qwen3 => engine::testmodel::into_qwen3(&cfg.out, cfg.seed)?,
        Family::Mistral => engine::testmodel::into_mistral(&cfg.out)?,
        Family::Llama3 => engine::testmodel::into_llama3(&cfg.out)?,
        Family::Qwen3Moe => engine::testmodel::into_qwen3_moe(&cfg.out, cfg.seed)?,
        Family::Mixtral => engine::testmodel::into_mixtral(&cfg.out, cfg.seed)?,
        Family::Qwen2Moe => engine::testmodel::into_qwen2_moe(&cfg.out, cfg.seed)?,
        Family::Gemma2 => engine::testmodel::into_gemma2(&cfg.out, cfg.seed)?,
        Family::Gemma3 => engine::testmodel::into_gemma3(&cfg.out, cfg.seed)?,
        Family::Phi3 => engine::testmodel::into_phi3(&cfg.out)?,
    }
    println!("{}", cfg.out.display());
    if let Some(quant) = cfg.gguf {
        let path = cfg.out.join(format!("model-{quant:?}.gguf").to_lowercase());
        export_gguf(&cfg.out, &path, quant)?;
        println!("{}", path.display());
    }
    Ok(())
}

fn parse_quant(s: &str) -> Result<GgmlDType, String> {
    Ok(match s {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        other => return Err(format!("unknown quantization {other:?}")),
    })
}
