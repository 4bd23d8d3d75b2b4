//! `grammar-neighbours`: what one request's costly grammar does to the requests beside it.
//! A PD cluster serves 16 plain streams in a round, then 15 plain streams beside one
//! request with a costly grammar, alternated round by round; prints the plain streams'
//! time per output token in each and the rise.

use std::path::PathBuf;

use anyhow::Context;
use bench::serve::{chat_body, stream_once};
use bench::stats::quantile;
use clap::{Parser, ValueEnum};
use e2e::{Cluster, Mode};
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Costly {
    /// `guided_regex`: one or more of 128 alternatives, each up to 80 free letters around
    /// a word of its own.
    Regex128,
    /// `guided_json`: a 16 KiB `const` string.
    Const16k,
    /// `guided_json`: a 64 KiB `const` string.
    Const64k,
}

impl Costly {
    fn grammar(self) -> Value {
        match self {
            Costly::Regex128 => {
                let alts: Vec<String> = (0..128)
                    .map(|i| format!("[a-z ]{{0,40}}w{i}[a-z ]{{0,40}}"))
                    .collect();
                json!({"guided_regex": format!("({})+", alts.join("|"))})
            }
            Costly::Const16k => json!({"guided_json": {"const": "x".repeat(16 << 10)}}),
            Costly::Const64k => json!({"guided_json": {"const": "x".repeat(64 << 10)}}),
        }
    }
}

#[derive(Debug, Parser)]
#[command(about = "Plain streams' time per token beside a costly grammar")]
struct Args {
    /// Model folder or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The costly grammars to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_values = ["regex128", "const16k", "const64k"])]
    costly: Vec<Costly>,
    /// Sequences of the grammar request (`n`).
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Rounds of each variant, alternated.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Where to write the JSON results.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One round: 16 plain streams, or 15 beside `costly`; the plain streams' median TPOT (ms).
async fn round(
    url: &str,
    costly: Option<Costly>,
    n: usize,
    max_tokens: usize,
) -> anyhow::Result<f64> {
    let client = reqwest::Client::new();
    let plain = 16 - usize::from(costly.is_some());
    let mut streams = Vec::new();
    for i in 0..plain {
        let (client, url) = (client.clone(), url.to_string());
        let body = chat_body("test", 64, max_tokens, i);
        streams.push(tokio::spawn(async move {
            stream_once(&client, &url, &body).await
        }));
    }
    let grammar = costly.map(|c| {
        let mut body = json!({"model": "test", "prompt": "My favourite thing is",
            "max_tokens": max_tokens, "ignore_eos": true, "temperature": 1.0, "seed": 7, "n": n});
        body.as_object_mut()
            .expect("an object")
            .extend(c.grammar().as_object().expect("an object").clone());
        let (client, url) = (client.clone(), format!("{url}/v1/completions"));
        tokio::spawn(async move {
            let answer = client.post(url).json(&body).send().await?;
            Ok::<u16, reqwest::Error>(answer.status().as_u16())
        })
    });
    let mut tpot = Vec::new();
    for s in streams {
        tpot.push(s.await?.map_err(anyhow::Error::msg)?.tpot * 1e3);
    }
    if let Some(g) = grammar {
        let status = g.await??;
        anyhow::ensure!(status == 200, "the grammar request was answered {status}");
    }
    Ok(quantile(&tpot, 0.5))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cluster = Cluster::start(Mode::Pd, &args.model, &[]).await;
    round(&cluster.url, None, 1, 4).await.context("warm-up")?;
    println!("model: {}", args.model.display());
    println!(
        "| beside | plain TPOT p50, 16 plain (ms) | plain TPOT p50, 15 + grammar (ms) | rise |"
    );
    println!("| --- | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    for &costly in &args.costly {
        let (mut alone, mut beside) = (Vec::new(), Vec::new());
        for _ in 0..args.rounds {
            alone.push(round(&cluster.url, None, 1, args.max_tokens).await?);
            let tpot = round(&cluster.url, Some(costly), args.n, args.max_tokens).await?;
            beside.push(tpot);
        }
        let (a, b) = (quantile(&alone, 0.5), quantile(&beside, 0.5));
        let rise = 100.0 * (b - a) / a;
        println!("| {costly:?} | {a:.2} | {b:.2} | {rise:+.1}% |");
        rows.push(json!({"costly": format!("{costly:?}"), "plain_tpot_ms": a,
            "beside_tpot_ms": b, "rise_percent": rise, "rounds_alone": alone,
            "rounds_beside": beside}));
    }
    if let Some(path) = args.json {
        let doc = json!({"model": args.model, "max_tokens": args.max_tokens, "n": args.n,
            "rounds": args.rounds, "results": rows});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
