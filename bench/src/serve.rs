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

/// The q-quantile (0..=1) of `xs` by nearest rank; 0 for an empty slice.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&xs, 0.5), 5.0);
        assert_eq!(quantile(&xs, 0.9), 9.0);
        assert_eq!(quantile(&xs, 0.99), 10.0);
        assert_eq!(quantile(&xs, 0.0), 1.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
