//! An open- or closed-loop load generator for any OpenAI-style streaming API: Poisson
//! arrivals at a rate, or a fixed number of clients; prompt and output lengths drawn from a
//! mix; per-request TTFT, inter-token gaps, end-to-end latency; and the summary the bench
//! figures are made of, with goodput as DistServe defines it (the share of requests that
//! meet both a TTFT and a TPOT target).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::stats::quantile;
use engine::sampling::SplitMix64;

/// A small deterministic generator (SplitMix64): the same seed gives the same load.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean `mean` (the gaps of a Poisson process).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.unit().ln()
    }

    /// Log-normal with median `median` and shape `sigma`.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        // Box-Muller.
        let n = (-2.0 * self.unit().ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos();
        median * (sigma * n).exp()
    }
}

/// The distribution of request shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mix {
    /// Chat-like: prompts around 128 tokens (16 to 1024), answers around 96 (8 to 512).
    Chat,
    /// Long prompts: around 1536 tokens (512 to 2000), short answers around 48 (16 to 128).
    LongPrompt,
    /// Short prompts: around 32 tokens (4 to 256), answers around 64 (16 to 256); the
    /// requests conditional disaggregation keeps on the decode node.
    ShortPrompt,
    /// Every request the same: `--prompt-tokens` in, `--output-tokens` out.
    Fixed,
}

/// One request's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shape {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

impl Mix {
    /// Draws a request's shape; `fixed` is the shape of the `Fixed` mix.
    pub fn draw(self, rng: &mut Rng, fixed: Shape) -> Shape {
        let draw = |rng: &mut Rng, median: f64, sigma: f64, lo: usize, hi: usize| {
            (rng.lognormal(median, sigma).round() as usize).clamp(lo, hi)
        };
        match self {
            Mix::Chat => Shape {
                prompt_tokens: draw(rng, 128.0, 0.6, 16, 1024),
                output_tokens: draw(rng, 96.0, 0.5, 8, 512),
            },
            Mix::LongPrompt => Shape {
                prompt_tokens: draw(rng, 1536.0, 0.25, 512, 2000),
                output_tokens: draw(rng, 48.0, 0.4, 16, 128),
            },
            Mix::ShortPrompt => Shape {
                prompt_tokens: draw(rng, 32.0, 0.6, 4, 256),
                output_tokens: draw(rng, 64.0, 0.4, 16, 256),
            },
            Mix::Fixed => fixed,
        }
    }
}

/// Words that the byte-level BPE tokenizers we serve (SmolLM2's, Qwen's, the generated
/// ones) each encode as one token after a space, so a prompt of n of them is close to n
/// tokens; the exact count comes back in `usage`.
const WORDS: [&str; 16] = [
    "the", "cache", "token", "model", "data", "time", "way", "day", "man", "world", "life", "hand",
    "part", "place", "case", "point",
];

/// A prompt of about `tokens` tokens, different for each `salt` from its second word on,
/// so that no two requests share a prefix block by accident.
pub fn prompt(tokens: usize, salt: u64) -> String {
    let mut rng = Rng::new(salt);
    let mut words = vec![format!("Request {salt}:")];
    words.extend(
        (0..tokens.saturating_sub(2)).map(|_| WORDS[(rng.next_u64() % 16) as usize].into()),
    );
    words.join(" ")
}

/// Which API is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `/v1/chat/completions`, the prompt as one user message.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// A streamed request body of `shape` that asks for exactly its output tokens.
pub fn body(api: Api, model: &str, shape: Shape, salt: u64) -> Value {
    let text = prompt(shape.prompt_tokens, salt);
    let mut body = json!({"model": model, "stream": true, "max_tokens": shape.output_tokens,
        "ignore_eos": true, "temperature": 0,
        // Peers that follow vLLM's API honour these rather than ignore_eos.
        "min_tokens": shape.output_tokens,
        "stream_options": {"include_usage": true}});
    match api {
        Api::Chat => body["messages"] = json!([{"role": "user", "content": text}]),
        Api::Completions => body["prompt"] = json!(text),
    }
    body
}

/// The path of `api` under a base URL.
pub fn path(api: Api) -> &'static str {
    match api {
        Api::Chat => "/v1/chat/completions",
        Api::Completions => "/v1/completions",
    }
}

/// What one request measured (seconds from when it was sent).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Record {
    /// When it was sent, from the start of the run.
    pub sent_at: f64,
    pub shape: Option<Shape>,
    /// Time to the first chunk with a generated token.
    pub ttft: f64,
    /// Time to the first chunk with visible text (what tools that read only the text, such
    /// as aiperf, call TTFT): later than `ttft` when the first tokens are parts of a
    /// character.
    pub ttft_text: f64,
    /// Gaps between chunks with generated tokens.
    pub gaps: Vec<f64>,
    /// Time to the end of the stream.
    pub latency: f64,
    /// Output tokens: from `usage` when the server sends it, else the text chunks.
    pub output_tokens: usize,
    /// Prompt tokens from `usage` (0 when not sent).
    pub prompt_tokens: usize,
    pub error: Option<String>,
}

impl Record {
    /// Time per output token after the first: (latency to last token - TTFT) / (n - 1).
    pub fn tpot(&self) -> f64 {
        let last = self.ttft + self.gaps.iter().sum::<f64>();
        if self.output_tokens > 1 {
            (last - self.ttft) / (self.output_tokens - 1) as f64
        } else {
            0.0
        }
    }
}

/// True for a chunk with non-empty text in the answer (`text` or `delta.content`).
fn has_text(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| {
            [&c["text"], &c["delta"]["content"]]
                .iter()
                .any(|t| t.as_str().is_some_and(|s| !s.is_empty()))
        })
    })
}

/// True for a chunk that carries a generated token, in either API: a choice that is not
/// the finishing one with a text field (empty when the token is only part of a character),
/// or any choice with text or a tool call. Servers that open a chat stream with a role-only
/// chunk send it with the first token, so it times the first token as well.
fn is_token(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| {
            let d = &c["delta"];
            let text = [&c["text"], &d["content"], &d["reasoning_content"]];
            let nonempty = text
                .iter()
                .any(|t| t.as_str().is_some_and(|s| !s.is_empty()))
                || d["tool_calls"].is_array();
            nonempty || (c["finish_reason"].is_null() && text.iter().any(|t| t.is_string()))
        })
    })
}

/// An error with the errors under it: reqwest's own message ("error sending request")
/// leaves out why.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// Sends one streamed request and times its chunks.
pub async fn stream_request(client: &reqwest::Client, url: &str, body: &Value) -> Record {
    let started = Instant::now();
    let mut r = Record::default();
    let result: Result<(), String> = async {
        let mut resp = client
            .post(url)
            .json(body)
            .send()
            .await
            .map_err(|e| with_causes(&e))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("HTTP {status}: {text}"));
        }
        let mut buf = Vec::new();
        let mut chunks = 0;
        let mut last = None;
        while let Some(bytes) = resp.chunk().await.map_err(|e| e.to_string())? {
            let now = started.elapsed().as_secs_f64();
            buf.extend_from_slice(&bytes);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let event = String::from_utf8_lossy(&event);
                let Some(data) = event.trim().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
                if v.get("error").is_some() {
                    return Err(v["error"].to_string());
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    r.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    r.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                }
                if r.ttft_text == 0.0 && has_text(&v) {
                    r.ttft_text = now;
                }
                if is_token(&v) {
                    match last {
                        None => r.ttft = now,
                        Some(prev) => r.gaps.push(now - prev),
                    }
                    last = Some(now);
                    chunks += 1;
                }
            }
        }
        if last.is_none() {
            return Err("no token arrived".into());
        }
        if r.output_tokens == 0 {
            r.output_tokens = chunks;
        }
        Ok(())
    }
    .await;
    r.latency = started.elapsed().as_secs_f64();
    r.error = result.err();
    r
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrivals {
    /// Open loop: a Poisson process of this many requests per second.
    Poisson(f64),
    /// Closed loop: this many clients, each sending its next request when the last ends.
    Clients(usize),
}

/// One load level to run.
#[derive(Debug, Clone)]
pub struct Level {
    pub url: String,
    pub api: Api,
    pub model: String,
    pub arrivals: Arrivals,
    pub requests: usize,
    pub mix: Mix,
    pub fixed: Shape,
    pub seed: u64,
    /// Open loop only: requests in flight beyond this wait (so a stalled server cannot
    /// make the generator open connections without end); counted in the TTFT.
    pub max_in_flight: usize,
    /// A new connection for every request, none kept alive.
    pub fresh_connections: bool,
}

/// Runs a level; returns every request's record (in send order) and the wall time.
pub async fn run(level: &Level) -> (Vec<Record>, Duration) {
    let idle = if level.fresh_connections { 0 } else { 1024 };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(idle)
        .build()
        .expect("an HTTP client");
    let url = format!("{}{}", level.url.trim_end_matches('/'), path(level.api));
    let mut rng = Rng::new(level.seed);
    let shapes: Vec<Shape> = (0..level.requests)
        .map(|_| level.mix.draw(&mut rng, level.fixed))
        .collect();
    let started = Instant::now();
    let mut tasks = Vec::new();
    match level.arrivals {
        Arrivals::Poisson(rate) => {
            let gate = Arc::new(Semaphore::new(level.max_in_flight.max(1)));
            let mut at = 0.0;
            for (i, shape) in shapes.into_iter().enumerate() {
                if i > 0 {
                    at += rng.exponential(1.0 / rate);
                }
                tokio::time::sleep_until((started + Duration::from_secs_f64(at)).into()).await;
                let (client, url, gate) = (client.clone(), url.clone(), Arc::clone(&gate));
                let body = body(level.api, &level.model, shape, level.seed ^ i as u64);
                tasks.push(tokio::spawn(async move {
                    let sent_at = started.elapsed().as_secs_f64();
                    let _slot = gate.acquire_owned().await.expect("the gate stays open");
                    let mut r = stream_request(&client, &url, &body).await;
                    // Time spent waiting for a slot is the server's delay too.
                    let queued = started.elapsed().as_secs_f64() - sent_at - r.latency;
                    r.ttft += queued;
                    if r.ttft_text > 0.0 {
                        r.ttft_text += queued;
                    }
                    r.latency += queued;
                    r.sent_at = sent_at;
                    r.shape = Some(shape);
                    vec![r]
                }));
            }
        }
        Arrivals::Clients(n) => {
            let shapes = Arc::new(shapes);
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            for _ in 0..n.max(1) {
                let (client, url, shapes, next) = (
                    client.clone(),
                    url.clone(),
                    Arc::clone(&shapes),
                    Arc::clone(&next),
                );
                let (api, model, seed) = (level.api, level.model.clone(), level.seed);
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&shape) = shapes.get(i) else {
                            return out;
                        };
                        let sent_at = started.elapsed().as_secs_f64();
                        let body = body(api, &model, shape, seed ^ i as u64);
                        let mut r = stream_request(&client, &url, &body).await;
                        r.sent_at = sent_at;
                        r.shape = Some(shape);
                        out.push(r);
                    }
                }));
            }
        }
    }
    let mut records = Vec::new();
    for t in tasks {
        records.extend(t.await.expect("a request task"));
    }
    records.sort_by(|a, b| a.sent_at.total_cmp(&b.sent_at));
    (records, started.elapsed())
}

/// p50, p90 and p99 of a set of values, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    /// The percentiles of `secs`, in milliseconds.
    pub fn of(secs: &[f64]) -> Self {
        let ms = |q| quantile(secs, q) * 1e3;
        Self {
            p50: ms(0.5),
            p90: ms(0.9),
            p99: ms(0.99),
        }
    }
}

/// Service-level targets for goodput.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// What a level measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub arrivals: Arrivals,
    pub requests: usize,
    pub errors: usize,
    pub wall_s: f64,
    /// Requests finished per second.
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    /// Time to the first visible text (see `Record::ttft_text`), over the requests that
    /// had any.
    pub ttft_text_ms: Percentiles,
    /// Every gap between text chunks, over all requests.
    pub itl_ms: Percentiles,
    /// Each request's first gap. Under PD it spans the decode node taking the request
    /// into its batch, which stalls every running sequence.
    pub first_itl_ms: Percentiles,
    /// Per request: the time after the first token over the tokens after it.
    pub tpot_ms: Percentiles,
    pub latency_ms: Percentiles,
    pub slo: Slo,
    /// Share of all requests (failures count as misses) that met both targets.
    pub goodput: f64,
    /// Requests per second that met both targets.
    pub goodput_rps: f64,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
}

/// The summary of a level's records.
pub fn summarize(arrivals: Arrivals, records: &[Record], wall: Duration, slo: Slo) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.error.is_none()).collect();
    let col = |f: &dyn Fn(&Record) -> f64| ok.iter().map(|r| f(r)).collect::<Vec<f64>>();
    let gaps: Vec<f64> = ok.iter().flat_map(|r| r.gaps.iter().copied()).collect();
    let good = ok
        .iter()
        .filter(|r| r.ttft * 1e3 <= slo.ttft_ms && r.tpot() * 1e3 <= slo.tpot_ms)
        .count();
    let wall_s = wall.as_secs_f64().max(f64::EPSILON);
    let n = ok.len().max(1) as f64;
    let output: usize = ok.iter().map(|r| r.output_tokens).sum();
    Summary {
        arrivals,
        requests: records.len(),
        errors: records.len() - ok.len(),
        wall_s,
        throughput_rps: ok.len() as f64 / wall_s,
        output_tokens_per_s: output as f64 / wall_s,
        ttft_ms: Percentiles::of(&col(&|r| r.ttft)),
        ttft_text_ms: Percentiles::of(
            &ok.iter()
                .map(|r| r.ttft_text)
                .filter(|t| *t > 0.0)
                .collect::<Vec<f64>>(),
        ),
        itl_ms: Percentiles::of(&gaps),
        first_itl_ms: Percentiles::of(
            &ok.iter()
                .filter_map(|r| r.gaps.first().copied())
                .collect::<Vec<f64>>(),
        ),
        tpot_ms: Percentiles::of(&col(&|r| r.tpot())),
        latency_ms: Percentiles::of(&col(&|r| r.latency)),
        slo,
        goodput: good as f64 / records.len().max(1) as f64,
        goodput_rps: good as f64 / wall_s,
        mean_prompt_tokens: ok.iter().map(|r| r.prompt_tokens).sum::<usize>() as f64 / n,
        mean_output_tokens: output as f64 / n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_deterministic_and_poisson_gaps_have_their_mean() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert_eq!(a.next_u64(), b.next_u64());
        let n = 20_000;
        let mean = (0..n).map(|_| a.exponential(0.25)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "mean gap {mean}");
        let mut med: Vec<f64> = (0..n).map(|_| a.lognormal(100.0, 0.5)).collect();
        med.sort_by(f64::total_cmp);
        assert!((med[n / 2] - 100.0).abs() < 3.0, "median {}", med[n / 2]);
    }

    #[test]
    fn mixes_stay_within_their_bounds() {
        let mut rng = Rng::new(1);
        let fixed = Shape {
            prompt_tokens: 5,
            output_tokens: 6,
        };
        for _ in 0..1000 {
            let s = Mix::Chat.draw(&mut rng, fixed);
            assert!((16..=1024).contains(&s.prompt_tokens) && (8..=512).contains(&s.output_tokens));
            let s = Mix::LongPrompt.draw(&mut rng, fixed);
            assert!((512..=2000).contains(&s.prompt_tokens), "{s:?}");
            let s = Mix::ShortPrompt.draw(&mut rng, fixed);
            assert!((4..=256).contains(&s.prompt_tokens) && (16..=256).contains(&s.output_tokens));
        }
        assert_eq!(Mix::Fixed.draw(&mut rng, fixed), fixed);
    }

    #[test]
    fn prompts_have_the_asked_words_and_differ_from_the_start() {
        let p = prompt(50, 3);
        assert_eq!(p.split(' ').count(), 50);
        let head = |s: &str| s.split(' ').take(2).collect::<Vec<_>>().join(" ");
        assert_ne!(head(&p), head(&prompt(50, 4)));
    }

    fn record(ttft: f64, gaps: &[f64], error: bool) -> Record {
        Record {
            ttft,
            gaps: gaps.to_vec(),
            latency: ttft + gaps.iter().sum::<f64>(),
            output_tokens: gaps.len() + 1,
            error: error.then(|| "boom".into()),
            ..Default::default()
        }
    }

    #[test]
    fn goodput_counts_requests_meeting_both_targets_and_failures_as_misses() {
        let records = [
            record(0.1, &[0.02, 0.02], false), // meets both
            record(0.5, &[0.02, 0.02], false), // TTFT too long
            record(0.1, &[0.05, 0.05], false), // TPOT too long
            record(0.1, &[0.01], true),        // failed
        ];
        let slo = Slo {
            ttft_ms: 200.0,
            tpot_ms: 30.0,
        };
        let s = summarize(Arrivals::Clients(1), &records, Duration::from_secs(2), slo);
        assert_eq!(s.errors, 1);
        assert_eq!(s.goodput, 0.25);
        assert_eq!(s.goodput_rps, 0.5);
        assert_eq!(s.output_tokens_per_s, 4.5);
        assert!((records[2].tpot() - 0.05).abs() < 1e-12);
        assert_eq!(s.itl_ms.p99, 50.0);
        // One first gap per successful request: 20, 20 and 50 ms.
        assert_eq!(s.first_itl_ms.p50, 20.0);
        assert_eq!(s.first_itl_ms.p99, 50.0);
    }
}
