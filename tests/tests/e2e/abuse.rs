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
/// router can tell are too large (128 sequences: 128 blocks by its count) get a 400 naming
/// `n` before any worker is called, and those only a node can tell (32 sequences: 32 blocks
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

