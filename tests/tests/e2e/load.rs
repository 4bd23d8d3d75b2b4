//! Under load: continuous batching gives every request its solo tokens, a KV budget
//! smaller than the load queues requests instead of failing them, clients that leave free
//! what they held, and a saturated router (or key) refuses at once with Retry-After.

use std::time::Duration;

use e2e::{
    metric, post_then_leave, scrape, smollm2, sse_chunks, tiny_model, wait_metric, Cluster, Mode,
};
use serde_json::{json, Value};
use tokio::task::JoinSet;

/// A greedy completion request: prompt `words` words long, `max_tokens` tokens out.
fn request(i: usize, words: usize, max_tokens: usize, stream: bool) -> Value {
    let prompt = format!("request {i}: {}", "the decode node batches ".repeat(words));
    json!({"model": "test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": stream})
}

/// A streamed completion's text and usage.
fn streamed(data: &[String]) -> (String, Value) {
    let chunks = sse_chunks(data);
    let text = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    (text, chunks.last().unwrap()["usage"].clone())
}

/// Sends `bodies` all at once, streamed; returns (text, usage) in order.
async fn concurrently(c: &Cluster, bodies: &[Value]) -> Vec<(String, Value)> {
    let mut set = JoinSet::new();
    for (i, body) in bodies.iter().enumerate() {
        let url = format!("{}/v1/completions", c.url);
        let body = body.clone();
        set.spawn(async move {
            let (status, data) = e2e::post_sse(&url, &body).await;
            assert_eq!(status, 200, "request {i}: {data:?}");
            (i, streamed(&data))
        });
    }
    let mut out = vec![(String::new(), Value::Null); bodies.len()];
    while let Some(r) = set.join_next().await {
        let (i, got) = r.expect("a request task panicked");
        out[i] = got;
    }
    out
}

/// The text of each body sent alone, one after another.
async fn solo(c: &Cluster, bodies: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for body in bodies {
        let mut one = body.clone();
        one["stream"] = json!(false);
        let (status, v) = c.post("/v1/completions", &one).await;
        assert_eq!(status, 200, "{v}");
        out.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    out
}

/// The largest decode batch a request was part of (`batch_size[0]` is the prefill's).
fn max_decode_batch(usage: &Value) -> u64 {
    usage["batch_size"].as_array().unwrap()[1..]
        .iter()
        .map(|b| b.as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn sixty_four_concurrent_streams_get_their_solo_tokens() {
    let c = Cluster::start_full(
        Mode::Pd,
        &tiny_model(),
        &[],
        &[],
        &["--max-batch-size", "64"],
    )
    .await;
    let bodies: Vec<Value> = (0..64)
        .map(|i| request(i, 1 + i % 7 * 5, [4, 16, 40][i % 3], true))
        .collect();
    let expected = solo(&c, &bodies).await;
    let got = concurrently(&c, &bodies).await;
    let mut batched = 0;
    let mut prefill_batched = 0;
    for (i, ((text, usage), want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(text, want, "request {i} differs from its solo run");
        let max_tokens = bodies[i]["max_tokens"].as_u64().unwrap();
        assert_eq!(usage["completion_tokens"].as_u64(), Some(max_tokens));
        batched = batched.max(max_decode_batch(usage));
        prefill_batched = prefill_batched.max(usage["batch_size"][0].as_u64().unwrap());
    }
    assert!(
        batched >= 8,
        "the decode node batched at most {batched} sequences"
    );
    assert!(
        prefill_batched >= 2,
        "the prefill node never batched prompts"
    );
    let router = c.router_metrics().await;
    for name in [
        "router_time_to_first_token_seconds_count",
        "router_time_per_output_token_seconds_count",
    ] {
        assert_eq!(metric(&router, name, ""), Some(128.0), "{router}");
    }
    let d = c.decode.as_str();
    wait_metric(d, "decode_kv_blocks_used", "", 0.0, Duration::from_secs(10)).await;
    let page = scrape(d).await;
    assert!(metric(&page, "decode_steps_total", "").unwrap() > 0.0);
    assert_eq!(
        metric(&page, "decode_requests_total", "{outcome=\"admitted\"}"),
        Some(128.0),
        "{page}"
    );
}

#[tokio::test]
async fn a_kv_budget_smaller_than_the_load_queues_and_every_request_finishes() {
    // 24 blocks of 16 positions; each request needs 4 (about 10 prompt tokens + 40 out),
    // so at most 6 run at once and the rest wait for blocks.
    let c = Cluster::start_full(
        Mode::Pd,
        &tiny_model(),
        &[],
        &[],
        &["--kv-blocks", "24", "--kv-block-tokens", "16"],
    )
    .await;
    let bodies: Vec<Value> = (0..20).map(|i| request(i, 1, 40, true)).collect();
    let expected = solo(&c, &bodies).await;
    let got = concurrently(&c, &bodies).await;
    let mut largest = 0;
    for (i, ((text, usage), want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(text, want, "request {i}");
        largest = largest.max(max_decode_batch(usage));
    }
    assert!(
        largest <= 6,
        "{largest} sequences ran at once in a budget for 6"
    );
    let d = c.decode.as_str();
    wait_metric(d, "decode_kv_blocks_used", "", 0.0, Duration::from_secs(10)).await;
    let page = scrape(d).await;
    assert_eq!(metric(&page, "decode_kv_blocks_capacity", ""), Some(24.0));
    assert_eq!(metric(&page, "decode_waiting_requests", ""), Some(0.0));
    assert!(
        metric(&page, "decode_delayed_requests_total", "").unwrap() > 0.0,
        "some requests waited for blocks: {page}"
    );

    // More than the whole budget can never run: refused at once by the router, naming the
    // parameter and the reason.
    let (status, v) = c.post("/v1/completions", &request(0, 1, 600, false)).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the largest decode node holds 384 positions"),
        "{v}"
    );
}

#[tokio::test]
async fn clients_that_leave_free_what_they_held_in_every_phase() {
    // SmolLM2, so that each phase lasts long enough to leave in; one sequence at a time,
    // so a second request waits in the decode queue.
    let c = Cluster::start_full(Mode::Pd, &smollm2(), &[], &[], &["--max-batch-size", "1"]).await;
    let d = c.decode.clone();
    let p = c.prefill.clone().expect("a PD cluster");
    let long = |i| request(i, 2, 300, true);

    // Prefilling (and transferring, which runs beside it layer by layer): a long prompt,
    // abandoned while the prefill node computes it.
    let prefilling = post_then_leave(&c.url, "/v1/completions", &request(9, 300, 8, false)).await;
    wait_metric(
        &p,
        "prefill_running_prompts",
        "",
        1.0,
        Duration::from_secs(20),
    )
    .await;
    drop(prefilling);
    let cancelled = "{outcome=\"cancelled\"}";
    wait_metric(
        &p,
        "prefill_requests_total",
        cancelled,
        1.0,
        Duration::from_secs(20),
    )
    .await;
    wait_metric(&p, "prefill_kv_bytes_held", "", 0.0, Duration::from_secs(5)).await;
    wait_metric(&d, "decode_held_transfers", "", 0.0, Duration::from_secs(5)).await;

    // Decoding: read a few chunks, then hang up (below).
    let mut running = reqwest::Client::new()
        .post(format!("{}/v1/completions", c.url))
        .json(&long(0))
        .send()
        .await
        .unwrap();
    assert_eq!(running.status(), 200);
    for _ in 0..3 {
        running.chunk().await.unwrap().expect("a chunk");
    }
    let used = metric(&scrape(&d).await, "decode_kv_blocks_used", "").unwrap();
    assert!(used > 0.0, "the running request holds blocks");

    // Queued: a second request waits behind the first; its client leaves while the first
    // still decodes.
    let queued = post_then_leave(&c.url, "/v1/completions", &long(1)).await;
    wait_metric(
        &d,
        "decode_waiting_requests",
        "",
        1.0,
        Duration::from_secs(20),
    )
    .await;
    drop(queued);
    wait_metric(
        &d,
        "decode_waiting_requests",
        "",
        0.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        metric(&scrape(&d).await, "decode_running_sequences", ""),
        Some(1.0),
        "the first request still decodes"
    );

    drop(running);
    wait_metric(
        &d,
        "decode_kv_blocks_used",
        "",
        0.0,
        Duration::from_secs(10),
    )
    .await;
    wait_metric(
        &d,
        "decode_running_sequences",
        "",
        0.0,
        Duration::from_secs(10),
    )
    .await;
    let page = scrape(&d).await;
    assert_eq!(
        metric(&page, "decode_cancellations_total", ""),
        Some(3.0),
        "the prefilling request (its Generate call waited for its KV), the decoding and the queued one: {page}"
    );
    assert_eq!(
        metric(&page, "decode_finished_sequences_total", ""),
        Some(0.0),
        "neither ran to its end: {page}"
    );
    // Both nodes still serve.
    let (status, _) = c.post("/v1/completions", &request(2, 1, 4, false)).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_key_at_its_in_flight_limit_gets_429_and_its_streams_finish() {
    let file = e2e::scratch().join("busy-keys.txt");
    std::fs::write(&file, "k\nother\n").unwrap();
    let file = file.display().to_string();
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &[
            "--api-key-file",
            &file,
            "--max-in-flight-per-key",
            "2",
            // Long streams, so that they still run while the limit is probed.
            "--max-iter-times",
            "2000",
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let ask_as = |key: &'static str, i: usize, max_tokens: usize, stream: bool| {
        client
            .post(format!("{}/v1/completions", c.url))
            .bearer_auth(key)
            .json(&request(i, 1, max_tokens, stream))
            .send()
    };
    let ask = |i, max_tokens, stream| ask_as("k", i, max_tokens, stream);
    // Two long streams hold the key's two slots.
    let mut held = Vec::new();
    for i in 0..2 {
        let resp = ask(i, 2000, true).await.unwrap();
        assert_eq!(resp.status(), 200);
        held.push(resp);
    }
    // The limit is per key: another key is served meanwhile.
    let other = ask_as("other", 5, 4, false).await.unwrap();
    assert_eq!(other.status(), 200, "{}", other.text().await.unwrap());
    let refused = ask(2, 4, false).await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(
        refused.headers()["retry-after"],
        "1",
        "429 says when to retry"
    );
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");

    // Every accepted stream runs to its end; a finished one gives its slot back at once
    // after its last event, which the client may read first: hence the bounded wait.
    for (i, mut resp) in held.into_iter().enumerate() {
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.unwrap() {
            body.extend_from_slice(&chunk);
        }
        let text = String::from_utf8(body).unwrap();
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "stream {i}: {text}"
        );
        assert!(text.contains("\"finish_reason\":\"length\""), "stream {i}");
        if i == 0 {
            let served = e2e::poll_until(Duration::from_secs(10), || async {
                let status = ask(3, 4, false).await.ok()?.status();
                (status == 200).then_some(())
            })
            .await;
            assert!(
                served.is_some(),
                "the key never got its slot back after a stream finished"
            );
        }
    }
    assert_eq!(ask(4, 4, false).await.unwrap().status(), 200);
}

#[tokio::test]
async fn past_its_in_flight_limit_the_router_refuses_at_once() {
    use tokio::io::AsyncWriteExt;

    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--max-in-flight", "2"]).await;
    let host = c.url.trim_start_matches("http://").to_string();
    // Two requests whose bodies never finish arriving hold both slots (a slot is taken
    // before the body is read) for as long as their connections stay open. Streams would
    // hold them only while they run, and a fast model can finish one before the third
    // request arrives.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut conn = tokio::net::TcpStream::connect(&host).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{"
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        held.push(conn);
    }
    wait_metric(
        &c.ops,
        "router_requests_in_flight",
        "",
        2.0,
        Duration::from_secs(30),
    )
    .await;
    let client = reqwest::Client::new();
    let refused = client
        .post(format!("{}/v1/completions", c.url))
        .json(&request(9, 1, 4, false))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let page = c.router_metrics().await;
    assert_eq!(
        metric(&page, "router_overloaded_total", ""),
        Some(1.0),
        "{page}"
    );
    drop(held);
    wait_metric(
        &c.ops,
        "router_requests_in_flight",
        "",
        0.0,
        Duration::from_secs(30),
    )
    .await;
    // With the slots free again, requests are served.
    let (status, _) = c.post("/v1/completions", &request(10, 1, 4, false)).await;
    assert_eq!(status, 200);
}
