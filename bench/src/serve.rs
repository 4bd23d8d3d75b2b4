//! A closed-loop load generator for the router's streaming API: C clients, each sending
//! its next request as soon as the last one ends, timing every token as it arrives.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// What one streamed request measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Seconds to the first token.
    pub ttft: f64,
    /// Mean seconds between tokens after the first (0 for a one-token answer).
    pub tpot: f64,
    /// Seconds from sending to the last event.
    pub latency: f64,
    pub tokens: usize,
}

/// Streams one chat request and times it.
pub async fn stream_once(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<Sample, String> {
    let r = crate::load::stream_request(client, &format!("{url}/v1/chat/completions"), body).await;
    if let Some(e) = r.error {
        return Err(e);
    }
    Ok(Sample {
        ttft: r.ttft,
        tpot: r.tpot(),
        latency: r.latency,
        tokens: r.output_tokens,
    })
}

/// A chat request of about `prompt_words` words that always yields `max_tokens` tokens.
pub fn chat_body(model: &str, prompt_words: usize, max_tokens: usize, salt: usize) -> Value {
    let words: Vec<String> = (0..prompt_words)
        .map(|i| {
            ["tandem", "prefill", "decode", "router", "cache", "token"][(i + salt) % 6].to_string()
        })
        .collect();
    json!({"model": model, "stream": true, "max_tokens": max_tokens, "ignore_eos": true,
        "temperature": 0, "messages": [{"role": "user", "content": words.join(" ")}]})
}

/// Runs `requests` requests over `concurrency` clients; returns the samples and wall time.
pub async fn run_level(
    url: &str,
    model: &str,
    concurrency: usize,
    requests: usize,
    prompt_words: usize,
    max_tokens: usize,
) -> Result<(Vec<Sample>, Duration), String> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..concurrency {
        let (client, url, model, next) = (
            client.clone(),
            url.to_string(),
            model.to_string(),
            next.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    return Ok::<_, String>(out);
                }
                let body = chat_body(&model, prompt_words, max_tokens, i);
                out.push(stream_once(&client, &url, &body).await?);
            }
        }));
    }
    let mut samples = Vec::new();
    for c in clients {
        samples.extend(c.await.map_err(|e| e.to_string())??);
    }
    Ok((samples, started.elapsed()))
}
