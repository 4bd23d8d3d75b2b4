//! `mask-bench`: what structured outputs cost a decode step. The same batch decodes at
//! temperature 1 with sampling alone and with every sequence masked by a JSON schema,
//! alternated round by round; prints the median step times and the mask's share.

use std::path::PathBuf;

use anyhow::Context;
use bench::mask::Batch;
use clap::Parser;
use e2e::person_schema;
use engine::grammar::{Grammar, Vocab};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(about = "The cost of grammar masks per decode step")]
struct Config {
    /// Model folder or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<usize>,
    /// Prompt tokens each sequence starts with.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Decode steps per round.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Rounds of each variant, alternated.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Where to write the JSON results.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> anyhow::Result<()> {
    runtime::fit_compute_threads();
    let cfg = Config::parse();
    let loaded = engine::load(&cfg.model, &candle_core::Device::Cpu)
        .with_context(|| format!("loading {}", cfg.model.display()))?;
    let eos = &loaded.model.config().eos_token_ids;
    let vocab = Vocab::new(&loaded.tokenizer, eos)?;
    let grammar = Grammar::JsonSchema {
        schema: person_schema(),
        strict: true,
    };
    let fresh = vocab.compile(&grammar, eos)?;
    println!("model: {}", cfg.model.display());
    println!("| batch | step, sampling only (ms) | step, masked (ms) | mask cost |");
    println!("| ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    for &b in &cfg.batches {
        let mut batch = Batch::new(&loaded.model, b, cfg.context, fresh.clone())?;
        // One round of each first, so that neither pays for the first pages touched.
        batch.steps(&loaded.model, cfg.steps, false)?;
        batch.steps(&loaded.model, cfg.steps, true)?;
        let (mut plain, mut masked) = (Vec::new(), Vec::new());
        for _ in 0..cfg.rounds {
            plain.push(batch.steps(&loaded.model, cfg.steps, false)?);
            masked.push(batch.steps(&loaded.model, cfg.steps, true)?);
        }
        let (p, m) = (median(plain) * 1e3, median(masked) * 1e3);
        let cost = 100.0 * (m - p) / p;
        println!("| {b} | {p:.2} | {m:.2} | {cost:+.1}% |");
        rows.push(json!({"batch": b, "plain_ms": p, "masked_ms": m, "cost_percent": cost}));
    }
    if let Some(path) = cfg.json {
        let doc = json!({"model": cfg.model, "context": cfg.context, "steps": cfg.steps,
                         "rounds": cfg.rounds, "schema": person_schema(), "batches": rows});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
