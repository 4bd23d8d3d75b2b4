//! A decode node's memory against its KV budget: for each budget, a cluster of two prefill
//! nodes, one decode node with that `--kv-cache-mb` and a router (workers found through a
//! real etcd) serves a burst of concurrent long prompts, and the decode node's peak resident
//! memory during the burst is set against what it held idle (after one request, so that
//! what serving needs beside the KV is resident) plus the budget.
//!
//! ```sh
//! target/release/kv-memory --model models/smollm2-135m-instruct-q4_1.gguf \
//!     --budgets 100,200,400 --json bench/results/kv-memory.json
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use e2e::{metric, Fleet, Role};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(name = "kv-memory")]
struct Args {
    /// Model folder or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The decode node's KV budgets to try, in MiB, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "100,200,400")]
    budgets: Vec<u64>,
    /// Concurrent requests in the burst.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Words in each prompt (about 1.35 SmolLM2 tokens a word).
    #[arg(long, default_value_t = 700)]
    words: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A prompt of `words` words that no other request starts like.
fn prompt(i: usize, words: usize) -> String {
    const WORDS: [&str; 8] = [
        "river", "stone", "lantern", "orchard", "harbor", "meadow", "signal", "copper",
    ];
    let body: Vec<&str> = (0..words).map(|k| WORDS[(k * 5 + i) % 8]).collect();
    format!("Request {i}. Summarise: {}", body.join(" "))
}

/// One budget's run: the decode node's idle and peak resident memory, and the requests.
async fn run(a: &Args, budget_mb: u64) -> anyhow::Result<Value> {
    let mut f = Fleet::start(&a.model, &[]).await;
    f.add_prefill(&[]);
    f.add_prefill(&[]);
    let budget = budget_mb.to_string();
    f.add_decode(&["--kv-cache-mb", &budget]);
    f.wait_workers(
        Role::Prefill,
        "ready",
        2,
        std::time::Duration::from_secs(120),
    )
    .await;
    f.wait_workers(
        Role::Decode,
        "ready",
        1,
        std::time::Duration::from_secs(120),
    )
    .await;
    let body = |i: usize| {
        json!({"model": "test", "prompt": prompt(i, a.words), "max_tokens": a.max_tokens,
            "ignore_eos": true})
    };
    let (status, v) = f.post("/v1/completions", &body(10_000)).await;
    anyhow::ensure!(status == 200, "the warm-up request failed: {v}");
    let d = &f.decode[0];
    let idle = d.proc.memory().rss;
    d.proc.reset_peak_memory();
    let started = Instant::now();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", f.url);
    let burst: Vec<_> = (0..a.concurrency)
        .map(|i| {
            let (client, url, body) = (client.clone(), url.clone(), body(i));
            tokio::spawn(async move {
                let r = client.post(url).json(&body).send().await?;
                anyhow::Ok(r.status().as_u16())
            })
        })
        .collect();
    let mut ok = 0;
    for r in burst {
        if r.await?? == 200 {
            ok += 1;
        }
    }
    let took = started.elapsed().as_secs_f64();
    let peak = d.proc.memory().peak;
    let page = d.metrics().await;
    let delayed = metric(&page, "decode_delayed_requests_total", "").unwrap_or(0.0);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let grew = mib(peak.saturating_sub(idle));
    let row = json!({
        "budget_mib": budget_mb,
        "idle_mib": mib(idle),
        "peak_mib": mib(peak),
        "grew_mib": grew,
        "grew_over_budget": grew / budget_mb as f64,
        "within_target": grew <= budget_mb as f64 * 1.15,
        "requests_ok": ok,
        "requests": a.concurrency,
        "delayed": delayed,
        "seconds": took,
    });
    println!(
        "budget {budget_mb:>4} MiB: idle {:>6.1} MiB, peak {:>6.1} MiB, grew {grew:>6.1} MiB ({:.0}% of the budget), {ok}/{} ok, {delayed} waited for KV, {took:.1} s",
        mib(idle),
        mib(peak),
        100.0 * grew / budget_mb as f64,
        a.concurrency
    );
    Ok(row)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut rows = Vec::new();
    for &b in &a.budgets {
        rows.push(
            run(&a, b)
                .await
                .with_context(|| format!("budget {b} MiB"))?,
        );
    }
    if let Some(path) = &a.json {
        let out = json!({
            "model": a.model.display().to_string(),
            "concurrency": a.concurrency,
            "words": a.words,
            "max_tokens": a.max_tokens,
            "runs": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}
