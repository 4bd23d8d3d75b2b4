//! Cheap requests that used to hurt every other client: each recipe is sent the way an
//! attacker would send it, and the cluster must answer it and go on serving.

use e2e::{metric, tiny_model, Role};
use serde_json::json;

use crate::cluster::{request, start_fleet, text_of, WORKER};

/// Each decode node's KV budget: 64 blocks of 16 positions. A tiny-model sequence of up
/// to 63 positions takes 4 blocks on the node (each layer's K and V are a page of their
/// own), while the router's lower bound counts 1.
const DECODE: &[&str] = &["--kv-blocks", "64", "--kv-block-tokens", "16"];

/// A request of `n` sequences of a short prompt and 8 tokens each.
fn wide(n: usize) -> serde_json::Value {
    json!({"model": "test", "prompt": "hi", "max_tokens": 8, "n": n, "temperature": 1.0})
}

/// A hundred requests no decode node can hold leave every node in rotation: those the
/// router can tell are too large (128 sequences: wider than a node's batch of 32, and 128
/// blocks by its count) get a 400 naming `n` before any worker is called, and those only a
/// node can tell (32 sequences: 32 blocks
/// by the router's count, 128 on the node) are refused by the node, which counts as the
/// request's failure, not the node's. Both used to open the nodes' breakers after three.
#[tokio::test(flavor = "multi_thread")]
async fn requests_too_large_for_any_decode_node_take_no_node_out_of_rotation() {
    let decode = [WORKER, DECODE].concat();
    let f = start_fleet(&[], 1, WORKER, 2, &decode).await;
    for i in 0..100 {
        let n = if i % 2 == 0 { 128 } else { 32 };
        let (status, v) = f.post("/v1/completions", &wide(n)).await;
        assert_eq!(status, 400, "n = {n}: {v}\nlogs:\n{}", f.logs());
        if n == 128 {
            assert_eq!(v["error"]["param"], "n", "{v}");
        }
    }
    let (status, body) = f.ready().await;
    assert_eq!(status, 200, "{body}\nlogs:\n{}", f.logs());
    let page = f.router_metrics().await;
    let breakers: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("router_breaker_open{role=\"decode\""))
        .collect();
    assert_eq!(breakers.len(), 2, "{page}");
    assert!(breakers.iter().all(|l| l.ends_with(" 0")), "{page}");
    let refused = metric(
        &page,
        "router_attempt_failures_total",
        "{culprit=\"request\"}",
    );
    assert_eq!(
        refused,
        Some(50.0),
        "the nodes refused the requests only they could tell were too large:\n{page}"
    );
    assert_eq!(
        metric(
            &page,
            "router_attempt_failures_total",
            "{culprit=\"decode\"}"
        ),
        Some(0.0),
        "{page}"
    );
    text_of(&f, &request(0, 3, 4, false)).await;
    f.wait_workers(Role::Decode, "ready", 2, crate::cluster::SEE)
        .await;
}

/// Just under the router's default `--max-body-bytes` (20 MiB).
const HOSTILE_BYTES: usize = (20 << 20) - 1024;

/// A completion body whose `field` holds `filler`, repeated to make the body
/// [`HOSTILE_BYTES`] long, between `open` and `close`.
fn hostile(head: &str, open: &str, filler: &str, close: &str) -> Vec<u8> {
    let mut body = format!("{head}{open}").into_bytes();
    let room = HOSTILE_BYTES - body.len() - close.len();
    body.extend(
        filler
            .as_bytes()
            .iter()
            .cycle()
            .take(room / filler.len() * filler.len()),
    );
    body.extend(close.as_bytes());
    body
}

/// A 20 MiB body costs the router at most 64 MiB beyond what it holds idle, however its
/// JSON is shaped: values are counted as they are parsed, and so are the values of JSON
/// text inside the request (a tool call's arguments, a schema sent as a string), and the
/// body is read into one buffer and let go once parsed. An array of ten million zeros in a
/// harmless field used to grow the router by 1.8 GiB, and was answered 200. Each body goes
/// to a router of its own: the allocator keeps what one body freed for the next, which
/// would hide the next one's cost.
#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_body_costs_the_router_a_bounded_amount_of_memory() {
    let completion = r#"{"model": "test", "prompt": "hi", "max_tokens": 1, "#;
    let chat = r#"{"model": "test", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""#;
    let cases = [
        (
            "an array of zeros",
            completion,
            hostile(completion, r#""metadata": ["#, "0,", "0]}"),
            413,
        ),
        (
            "one long string",
            completion,
            hostile(completion, r#""user": ""#, "x", r#""}"#),
            200,
        ),
        (
            "deep arrays",
            completion,
            hostile(completion, r#""metadata": "#, "[", ""),
            413,
        ),
        (
            "a schema as text",
            completion,
            hostile(completion, r#""guided_json": "["#, "0,", r#"0]"}"#),
            413,
        ),
        (
            "tool call arguments",
            chat,
            hostile(chat, "[", "0,", r#"0]"}}]}]}"#),
            413,
        ),
    ];
    for (what, head, body, want) in cases {
        let c = e2e::Cluster::start(e2e::Mode::Colocated, &tiny_model(), &[]).await;
        c.assert_serving("at the start").await;
        let router = c.procs.last().expect("the router is the last process");
        let idle = router.memory().rss;
        router.reset_peak_memory();
        let path = if head == chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let resp = c
            .client
            .post(format!("{}{path}", c.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("an answer");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        let grew = router.memory().peak.saturating_sub(idle);
        eprintln!(
            "{what}: {status}, the router grew {} MiB over idle",
            grew >> 20
        );
        assert_eq!(status, want, "{what}: {text}");
        assert!(
            grew <= 64 << 20,
            "{what}: the router grew {} MiB over idle for a 20 MiB body",
            grew >> 20
        );
        c.assert_serving(what).await;
    }
}
