//! Stream migration: a decode node killed or stopped under streams. Each of its streams
//! moves to another decode node (a prefill node computes the prompt and the tokens so far)
//! and ends with exactly the text of an uninterrupted run, greedy and seeded; with
//! `--stream-migration false` they end with an error instead.

use e2e::{metric, sse_chunks, Fleet, SseStream};
use serde_json::{json, Value};

use super::cluster::*;

/// Tokens per stream: enough that every stream is still running when its node is hit.
const TOKENS: usize = 600;

/// Stream `i` of a test: greedy or sampled with a seed of its own, two of each in turn, so
/// that each decode node gets both kinds when the router alternates between them; every
/// fourth one sampled within a grammar, which its next decode node continues.
fn body(i: usize, stream: bool) -> Value {
    let mut b = request(i, 2, TOKENS, stream);
    if i / 2 % 2 == 1 {
        b["temperature"] = json!(1.0);
        b["seed"] = json!(1000 + i);
    }
    if constrained(i) {
        b["guided_regex"] = json!(LOWERCASE);
    }
    b
}

/// The grammar of the constrained streams: with `ignore_eos` it never ends them early.
const LOWERCASE: &str = "[a-z ]+";

fn constrained(i: usize) -> bool {
    i % 4 == 3
}

/// Opens `n` streams and reads two chunks of each, so that all of them are decoding.
async fn open_streams(f: &Fleet, n: usize) -> Vec<(Vec<String>, SseStream)> {
    let url = format!("{}/v1/completions", f.url);
    let mut open = Vec::new();
    for i in 0..n {
        let (status, stream) = SseStream::open(&url, &body(i, true)).await;
        assert_eq!(status, 200);
        open.push((Vec::new(), stream));
    }
    for (data, stream) in &mut open {
        for _ in 0..2 {
            data.push(stream.next_data().await.expect("a first chunk"));
        }
    }
    open
}

/// The decode node running the most sequences.
async fn busiest(f: &Fleet) -> usize {
    let mut running = Vec::new();
    for w in &f.decode {
        running.push(w.metric("decode_running_sequences", "").await);
    }
    assert!(running.iter().any(|&r| r > 0.0), "no stream is running");
    (0..running.len())
        .max_by(|&a, &b| running[a].total_cmp(&running[b]))
        .expect("two decode nodes")
}

/// Reads each stream to its end; returns all of each one's data.
async fn finish_all(f: &Fleet, open: Vec<(Vec<String>, SseStream)>) -> Vec<Vec<String>> {
    let mut all = Vec::new();
    for (mut data, mut stream) in open {
        let rest = tokio::time::timeout(SEE * 3, stream.rest()).await;
        data.extend(rest.unwrap_or_else(|_| panic!("a stream hung; logs:\n{}", f.logs())));
        all.push(data);
    }
    all
}

/// Every stream's usage is the uninterrupted run's: all of its tokens, counted once.
fn assert_whole_usage(open_data: &[String]) {
    let chunks = sse_chunks(open_data);
    let usage = chunks
        .iter()
        .rev()
        .find_map(|c| c.get("usage"))
        .expect("a usage chunk");
    assert_eq!(usage["completion_tokens"], TOKENS, "{usage}");
}

/// Kills the busier of two decode nodes under 16 streams (behind a router with
/// `router_args`, and `prefills` prefill nodes); every stream must end as if uninterrupted.
async fn sixteen_streams_outlive_a_kill9(router_args: &[&str], prefills: usize) {
    let router = with(LONG_ROUTER, router_args);
    let f = start_fleet(&router, prefills, WORKER, 2, WORKER).await;
    // The uninterrupted run: the same sixteen requests at once, unary.
    let url = format!("{}/v1/completions", f.url);
    let runs: Vec<_> = (0..16)
        .map(|i| {
            let (url, body) = (url.clone(), body(i, false));
            tokio::spawn(async move { e2e::post(&url, &body).await })
        })
        .collect();
    let mut expected = Vec::new();
    for run in runs {
        let (status, v) = run.await.unwrap();
        assert_eq!(status, 200, "{v}");
        expected.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    // Sampling decides the seeded streams' text: a resumed stream that drew from the
    // wrong step would show.
    let mut greedy = body(2, false);
    greedy["temperature"] = json!(0);
    assert_ne!(text_of(&f, &greedy).await, expected[2]);
    let open = open_streams(&f, 16).await;
    let hit = busiest(&f).await;
    f.decode[hit].proc.signal("KILL");
    for (i, data) in finish_all(&f, open).await.iter().enumerate() {
        assert_eq!(streamed_text(data), expected[i], "stream {i}");
        assert_whole_usage(data);
        let lowercase = |c: char| c.is_ascii_lowercase() || c == ' ';
        if constrained(i) {
            assert!(expected[i].chars().all(lowercase), "{:?}", expected[i]);
        }
    }
    let page = f.router_metrics().await;
    let moved = metric(&page, "router_stream_migrations_total", "").unwrap_or(0.0);
    assert!(moved >= 1.0, "no stream moved:\n{page}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sixteen_streams_outlive_a_kill9_of_their_decode_node_with_the_same_text() {
    sixteen_streams_outlive_a_kill9(&[], 1).await;
}

/// Colocated, the next decode node computes the prompt and the tokens so far itself.
#[tokio::test(flavor = "multi_thread")]
async fn colocated_streams_outlive_a_kill9_of_their_worker_with_the_same_text() {
    sixteen_streams_outlive_a_kill9(&["--mode", "colocated"], 0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_on_a_stopped_decode_node_moves_and_the_node_frees_it_once_woken() {
    // The lease outlasts the test: only the connection's pings can notice the pause.
    let decode_args = ["--lease-ttl-s", "120", "--drain-grace-s", "10"];
    let f = start_fleet(LONG_ROUTER, 1, WORKER, 2, &decode_args).await;
    let expected = text_of(&f, &body(2, false)).await;
    let url = format!("{}/v1/completions", f.url);
    let (status, mut stream) = SseStream::open(&url, &body(2, true)).await;
    assert_eq!(status, 200);
    // The first token is the prefill node's: the second is the first the decode node ran,
    // so its gauge counts the sequence by then.
    let mut read = Vec::new();
    for _ in 0..2 {
        read.push(stream.next_data().await.expect("a first chunk"));
    }
    let hit = busiest(&f).await;
    f.decode[hit].proc.signal("STOP");
    let data = finish_all(&f, vec![(read, stream)]).await;
    assert_eq!(streamed_text(&data[0]), expected);
    assert_whole_usage(&data[0]);
    // Woken up, the node finds its caller gone and frees the sequence's blocks.
    f.decode[hit].proc.signal("CONT");
    decode_holds_nothing(&f.decode[hit]).await;
    prefill_holds_nothing(&f.prefill[0]).await;
}
