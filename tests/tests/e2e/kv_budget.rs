//! The decode node's KV budget bounds its memory: a burst of long prompts, many more than
//! its budget holds at once, all served, while the node's peak resident memory stays within
//! its budget (and 15 %) of what it held idle. Caches for queued requests used to arrive
//! outside the budget: the same burst then took several times it.

use e2e::{metric, scrape, smollm2, Cluster, Mode};
use serde_json::json;
use std::time::Duration;

/// The decode node's `--kv-cache-mb`: room for two of the prompts below at once.
const BUDGET_MB: u64 = 64;
/// Concurrent requests in the burst: their caches would take several times the budget.
const BURST: usize = 24;
/// Tokens each generates: long enough that the prefill node outruns the decode node.
const MAX_TOKENS: u32 = 64;

/// A prompt of about 450 SmolLM2 tokens that no other request starts like.
fn long_prompt(i: usize) -> String {
    let words = [
        "river", "stone", "lantern", "orchard", "harbor", "meadow", "signal", "copper",
    ];
    let body: Vec<&str> = (0..420).map(|k| words[(k * 5 + i) % words.len()]).collect();
    format!("Request {i}. Summarise: {}", body.join(" "))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_long_prompts_stays_within_the_decode_budget() {
    let budget = BUDGET_MB.to_string();
    let c = Cluster::start_full(Mode::Pd, &smollm2(), &[], &[], &["--kv-cache-mb", &budget]).await;
    let started = c.procs[0].memory().rss;
    // One request first, so that what serving needs beside the KV is resident at idle.
    let (status, v) = c
        .post(
            "/v1/completions",
            &json!({"model": c.model_name, "prompt": long_prompt(999), "max_tokens": 16}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let idle = c.procs[0].memory().rss;
    // Loading the model peaked higher than serving ever needs: only the burst's peak counts.
    c.procs[0].reset_peak_memory();

    let requests = (0..BURST).map(|i| {
        let body = json!({"model": c.model_name, "prompt": long_prompt(i),
            "max_tokens": MAX_TOKENS, "ignore_eos": true});
        let (client, url) = (c.client.clone(), format!("{}/v1/completions", c.url));
        tokio::spawn(async move {
            let r = client
                .post(url)
                .json(&body)
                .send()
                .await
                .expect("a response");
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        })
    });
    let requests: Vec<_> = requests.collect();
    for r in requests {
        let (status, body) = r.await.expect("the request task");
        assert_eq!(status, 200, "{body}\nlogs:\n{}", c.logs());
    }

    let peak = c.procs[0].memory().peak;
    let grew = peak.saturating_sub(idle);
    let allowed = (BUDGET_MB << 20) * 115 / 100;
    eprintln!(
        "decode node: started {} MiB, idle {} MiB, peak {} MiB, grew {} MiB for a {BUDGET_MB} MiB budget",
        started >> 20,
        idle >> 20,
        peak >> 20,
        grew >> 20
    );
    assert!(
        grew <= allowed,
        "the decode node grew {} MiB over idle under the burst, past its {BUDGET_MB} MiB budget and 15 %",
        grew >> 20
    );
    // The budget did the bounding: requests waited for it.
    let page = scrape(&c.decode).await;
    let delayed = metric(&page, "decode_delayed_requests_total", "").unwrap_or(0.0);
    assert!(
        delayed > 0.0,
        "no request waited for KV blocks, so the burst did not test the budget:\n{page}"
    );
}

/// A node whose KV reserve and weights exceed the machine's memory exits at start with
/// both numbers, before reading a weight, instead of being killed later: a decode node
/// by `--kv-cache-mb`, a prefill node by `--max-active-tokens`. A node that starts anyway
/// serves until killed, so the wait for its exit is bounded.
#[tokio::test]
async fn a_reserve_past_the_machines_memory_stops_the_node_at_start() {
    let model = e2e::tiny_model().display().to_string();
    let machine = engine::footprint::machine_memory().expect("a Linux machine's MemTotal");
    // A MiB past the machine: the reserve alone does not fit, whatever the weights weigh
    // (MemTotal rounded down to MiB left the tiny model's 0.4 MB fitting under it).
    let mb = ((machine.bytes >> 20) + 1).to_string();
    for (node, flag, value) in [
        ("tandem-decode", "--kv-cache-mb", mb.as_str()),
        ("tandem-prefill", "--max-active-tokens", "100000000000"),
    ] {
        let listen = format!("127.0.0.1:{}", e2e::free_port());
        let child = tokio::process::Command::new(e2e::bin(node))
            .args(["--model", &model, "--listen", &listen, flag, value])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("running the node");
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{node} started serving past the machine's memory"))
            .expect("the node's output");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{node} started: {stderr}");
        assert!(stderr.contains("does not fit"), "{node}: {stderr}");
        assert!(
            stderr.contains(&engine::footprint::size(machine.bytes)),
            "{node}: {stderr}"
        );
    }
}
