//! Drives an OpenAI-style streaming API at one or more load levels (Poisson rates or
//! closed-loop clients) and reports TTFT, inter-token latency, TPOT, end-to-end latency,
//! throughput and goodput per level, as a table and as JSON (`bench/plot.py` draws it).

use std::path::PathBuf;

use anyhow::Context;
use bench::load::{run, summarize, Api, Arrivals, Level, Mix, Shape, Slo, Summary};
use clap::Parser;
use serde_json::json;

/// Load levels against one server.
#[derive(Debug, Parser)]
#[command(name = "loadgen")]
struct Args {
    /// Base URL of the server (its API lives under /v1).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The `model` of each request.
    #[arg(long)]
    model: String,
    #[arg(long, value_enum, default_value_t = Api::Chat)]
    api: Api,
    /// Open loop: Poisson arrival rates in requests/s, comma separated, one level each.
    #[arg(long, value_delimiter = ',', conflicts_with = "concurrency")]
    rates: Vec<f64>,
    /// Closed loop: numbers of clients, comma separated, one level each.
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Requests per level.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Prompt and output lengths.
    #[arg(long, value_enum, default_value_t = Mix::Chat)]
    mix: Mix,
    /// Prompt tokens of the `fixed` mix.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Output tokens of the `fixed` mix.
    #[arg(long, default_value_t = 64)]
    output_tokens: usize,
    /// Seed of the request shapes and arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Goodput's TTFT target in ms.
    #[arg(long, default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// Goodput's TPOT target in ms.
    #[arg(long, default_value_t = 100.0)]
    slo_tpot_ms: f64,
    /// Open loop: most requests in flight; later arrivals wait (and the wait counts).
    #[arg(long, default_value_t = 512)]
    max_in_flight: usize,
    /// A new connection for every request: for servers (llama.cpp's) that close a kept-alive
    /// connection just as the client reuses it.
    #[arg(long)]
    fresh_connections: bool,
    /// Write the summaries (and each request's record) here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A label for this run in the JSON (e.g. "pd" or "colocated").
    #[arg(long, default_value = "")]
    label: String,
}

fn row(s: &Summary) -> String {
    let load = match s.arrivals {
        Arrivals::Poisson(r) => format!("{r} req/s"),
        Arrivals::Clients(c) => format!("{c} clients"),
    };
    format!(
        "| {load} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0}% |",
        s.requests,
        s.errors,
        s.ttft_ms.p50,
        s.ttft_ms.p99,
        s.itl_ms.p50,
        s.tpot_ms.p50,
        s.tpot_ms.p99,
        s.latency_ms.p99 / 1e3,
        s.output_tokens_per_s,
        s.throughput_rps,
        s.goodput * 100.0
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let levels: Vec<Arrivals> = if !a.rates.is_empty() {
        a.rates.iter().map(|&r| Arrivals::Poisson(r)).collect()
    } else if !a.concurrency.is_empty() {
        a.concurrency
            .iter()
            .map(|&c| Arrivals::Clients(c))
            .collect()
    } else {
        anyhow::bail!("give --rates or --concurrency");
    };
    let slo = Slo {
        ttft_ms: a.slo_ttft_ms,
        tpot_ms: a.slo_tpot_ms,
    };
    println!(
        "url: {}  mix: {:?}  requests/level: {}  SLO: TTFT ≤ {} ms, TPOT ≤ {} ms",
        a.url, a.mix, a.requests, slo.ttft_ms, slo.tpot_ms
    );
    println!("| load | requests | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | TPOT p50 ms | TPOT p99 ms | E2E p99 s | output tok/s | req/s | goodput |");
    println!(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let mut out = Vec::new();
    for arrivals in levels {
        let level = Level {
            url: a.url.clone(),
            api: a.api,
            model: a.model.clone(),
            arrivals,
            requests: a.requests,
            mix: a.mix,
            fixed: Shape {
                prompt_tokens: a.prompt_tokens,
                output_tokens: a.output_tokens,
            },
            seed: a.seed,
            max_in_flight: a.max_in_flight,
            fresh_connections: a.fresh_connections,
        };
        let (records, wall) = run(&level).await;
        let summary = summarize(arrivals, &records, wall, slo);
        println!("{}", row(&summary));
        if let Some(e) = records.iter().find_map(|r| r.error.as_ref()) {
            eprintln!("first error: {e}");
        }
        out.push(json!({"summary": summary, "records": records}));
    }
    if let Some(path) = &a.json {
        let doc = json!({"label": a.label, "url": a.url, "mix": a.mix, "api": a.api,
            "seed": a.seed, "levels": out});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
