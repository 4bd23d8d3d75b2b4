//! Writes a generated test model as a Hugging Face folder.

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use clap::Parser;
use engine::gguf_export::export_gguf;
use engine::testmodel::{write_model, Family, ModelSize};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Write a deterministic test model as a Hugging Face folder"
)]
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
    /// Also write `model-<QUANT>.gguf` into the folder (f32, f16, q8_0, q5_0, q4_0, q4_1; q4_k
    /// for the small and wide sizes, whose matrices are multiples of 256 wide).
    #[arg(long, value_parser = parse_quant)]
    gguf: Option<GgmlDType>,
    /// The architecture to write.
    #[arg(long, value_enum, default_value = "qwen2")]
    family: Family,
    /// Seed for the random weights.
    #[arg(long, default_value_t = engine::testmodel::DEFAULT_SEED)]
    seed: u64,
}

fn main() -> anyhow::Result<()> {
    let cfg = Config::parse();
    let dtype = if cfg.bf16 {
        candle_core::DType::BF16
    } else {
        candle_core::DType::F32
    };
    write_model(&cfg.out, cfg.size, dtype, cfg.seed)?;
    cfg.family.turn(&cfg.out, cfg.seed)?;
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
        "q5_0" => GgmlDType::Q5_0,
        "q4_k" => GgmlDType::Q4K,
        other => return Err(format!("unknown quantization {other:?}")),
    })
}
