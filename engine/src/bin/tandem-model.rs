//! Writes a generated test model as a Hugging Face folder.

use std::path::PathBuf;

use clap::Parser;
use engine::testmodel::{write_model, ModelSize};

#[derive(Debug, Parser)]
#[command(about = "Write a deterministic Qwen2 test model as a Hugging Face folder")]
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
    println!("{}", cfg.out.display());
    Ok(())
}
