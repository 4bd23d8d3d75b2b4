//! TTFT and time per output token through the router, PD against colocated, in one run.

use std::path::PathBuf;

use anyhow::Context;
use bench::serve::run_level;
use bench::stats::quantile;
use clap::Parser;
use e2e::{Cluster, Mode};
use serde_json::json;

/// Starts a PD cluster and a colocated one in turn on the same model and drives each with
/// closed-loop streaming clients.
#[derive(Debug, Parser)]
struct Args {
    /// Model folder or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Concurrent streams per level, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Requests per level.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Words in each prompt.
    #[arg(long, default_value_t = 64)]
    prompt_words: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Write the results here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut rows = Vec::new();
    println!("model: {}", args.model.display());
    println!(
        "| mode | streams | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | output tok/s |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for mode in [Mode::Pd, Mode::Colocated] {
        let cluster = Cluster::start(mode, &args.model, &[]).await;
        // One request first, so page faults and connection setup stay out of the figures.
        run_level(&cluster.url, "test", 1, 1, args.prompt_words, 4)
            .await
            .map_err(anyhow::Error::msg)
            .context("warm-up")?;
        for &c in &args.concurrency {
            let (samples, wall) = run_level(
                &cluster.url,
                "test",
                c,
                args.requests,
                args.prompt_words,
                args.max_tokens,
            )
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("{mode:?} at {c} streams"))?;
            let ttft: Vec<f64> = samples.iter().map(|s| s.ttft * 1e3).collect();
            let tpot: Vec<f64> = samples.iter().map(|s| s.tpot * 1e3).collect();
            let tokens: usize = samples.iter().map(|s| s.tokens).sum();
            let tps = tokens as f64 / wall.as_secs_f64();
            println!(
                "| {mode:?} | {c} | {:.1} | {:.1} | {:.2} | {:.2} | {tps:.1} |",
                quantile(&ttft, 0.5),
                quantile(&ttft, 0.9),
                quantile(&tpot, 0.5),
                quantile(&tpot, 0.9)
            );
            rows.push(
                json!({"mode": format!("{mode:?}").to_lowercase(), "streams": c,
                "requests": samples.len(), "ttft_ms_p50": quantile(&ttft, 0.5),
                "ttft_ms_p90": quantile(&ttft, 0.9), "tpot_ms_p50": quantile(&tpot, 0.5),
                "tpot_ms_p90": quantile(&tpot, 0.9), "output_tokens_per_s": tps}),
            );
        }
    }
    if let Some(path) = args.json {
        let doc = json!({"model": args.model, "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens, "results": rows});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
