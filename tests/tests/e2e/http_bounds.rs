//! Clients of the router's HTTP port that try to hold its capacity, on raw sockets: bodies
//! announced and never sent, bodies announced or streamed past the limit, connections past
//! the cap, and streaming clients that stop reading. Each is cut at its bound while a real
//! request is served.

use std::time::{Duration, Instant};

use e2e::{metric, tiny_model, wait_metric, Cluster, Mode};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// The router's `--body-timeout-ms` here.
const BODY_MS: u64 = 1_500;
/// How long past a bound a connection may take to be answered and closed.
const SLACK: Duration = Duration::from_secs(5);

fn host(c: &Cluster) -> String {
    c.url.trim_start_matches("http://").to_string()
}

/// A request head for `path` announcing `length` bytes of JSON body.
fn head(host: &str, path: &str, length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
}

/// Everything the router sends on `conn` until it closes it, within `limit`.
async fn answer_then_close(conn: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(limit, conn.read_to_end(&mut out))
        .await
        .unwrap_or_else(|_| panic!("the connection was still open after {limit:?}"))
        .expect("reading the answer");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_announced_and_never_sent_are_cut_at_their_deadline() {
    let body_ms = BODY_MS.to_string();
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--body-timeout-ms", &body_ms]).await;
    let host = host(&c);
    let opened = Instant::now();
    let mut stalled = Vec::new();
    for _ in 0..50 {
        let mut conn = TcpStream::connect(&host).await.expect("connecting");
        conn.write_all(head(&host, "/v1/completions", 1_000_000).as_bytes())
            .await
            .expect("the head");
        stalled.push(conn);
    }
    c.assert_serving("while 50 bodies are awaited").await;
    let limit = opened.elapsed() + Duration::from_millis(BODY_MS) + SLACK;
    for mut conn in stalled {
        let answer = answer_then_close(&mut conn, limit).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(
            answer.contains(&format!(
                "the request body did not arrive within {BODY_MS} ms"
            )),
            "{answer}"
        );
    }
    let page = c.router_metrics().await;
    assert_eq!(
        metric(&page, "router_body_timeouts_total", ""),
        Some(50.0),
        "{page}"
    );
    assert_eq!(metric(&page, "router_requests_in_flight", ""), Some(0.0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_over_the_limit_is_refused_before_it_is_read() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--max-body-bytes", "65536"]).await;
    let host = host(&c);

    // Announced: the answer comes without a byte of the body sent.
    let mut conn = TcpStream::connect(&host).await.expect("connecting");
    conn.write_all(head(&host, "/v1/completions", 100 << 20).as_bytes())
        .await
        .expect("the head");
    let answer = answer_then_close(&mut conn, SLACK).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.contains("the request body is larger than 65536 bytes"),
        "{answer}"
    );

    // Chunked: refused once the bytes that came pass the limit, not at the end of a body
    // that never ends.
    let mut conn = TcpStream::connect(&host).await.expect("connecting");
    conn.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .expect("the head");
    let chunk = format!("4000\r\n{}\r\n", " ".repeat(0x4000));
    let (mut r, mut w) = conn.split();
    let mut sent = 0usize;
    let sender = async {
        // Far more than the limit, for as long as the router reads.
        while sent < 64 << 20 {
            if w.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
            sent += 0x4000;
        }
        std::future::pending::<()>().await
    };
    let mut answer = Vec::new();
    let reader = tokio::time::timeout(SLACK, r.read_to_end(&mut answer));
    tokio::select! {
        got = reader => { got.expect("an answer within the wait").expect("reading"); }
        () = sender => {}
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        sent < 16 << 20,
        "the router read {sent} bytes of a body limited to 64 KiB"
    );
    c.assert_serving("after the large bodies").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_connection_cap_new_clients_wait_and_open_ones_keep_working() {
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &["--max-connections", "4", "--header-timeout-ms", "3000"],
    )
    .await;
    let host = host(&c);
    // The cluster's own client keeps one connection (its readiness checks opened it; a
    // second client here would leave that one holding a place), then three clients
    // connect and send nothing: the four places are taken.
    let kept = &c.client;
    let body = json!({"model": c.model_name, "prompt": "kept", "max_tokens": 2});
    let url = format!("{}/v1/completions", c.url);
    assert_eq!(
        kept.post(&url).json(&body).send().await.unwrap().status(),
        200
    );
    // The idle connections' header deadlines run from their accept, which comes after
    // this instant: none of their places frees before it is 3 s old, however long the
    // steps below take on a loaded machine.
    let idle_since = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(&host).await.expect("connecting"));
    }
    // The kept connection still serves.
    assert_eq!(
        kept.post(&url).json(&body).send().await.unwrap().status(),
        200
    );
    // A new client waits for a place, which the idle ones give up once their header
    // deadline passes.
    let waiting = reqwest::Client::new().post(&url).json(&body).send();
    let status = tokio::time::timeout(Duration::from_secs(3) + SLACK, waiting)
        .await
        .expect("served once a place came free")
        .expect("the request")
        .status();
    let served_after = idle_since.elapsed();
    assert_eq!(status, 200);
    assert!(
        served_after >= Duration::from_secs(3),
        "a fifth connection was served past the cap of 4, {served_after:?} after the \
         idle ones connected, before their header deadline"
    );
    for mut conn in idle {
        answer_then_close(&mut conn, SLACK).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_whose_clients_stop_reading_are_dropped_and_cancelled() {
    // 32 sequences of 2000 tokens per request, each token with 20 alternatives: more
    // than the sockets' buffers hold, and more than the decode node's 8 MiB gRPC stream
    // window, so that each generation is still running when its client's stall is noticed
    // however fast the node computes (with 8 sequences of 1500 tokens it could finish into
    // the window first, and there was then nothing to cancel).
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &[
            "--client-stall-timeout-ms",
            "2000",
            "--max-iter-times",
            "2000",
        ],
    )
    .await;
    let host = host(&c);
    let body = json!({"model": c.model_name, "stream": true, "max_tokens": 2000, "n": 32,
        "ignore_eos": true, "logprobs": true, "top_logprobs": 20,
        "messages": [{"role": "user", "content": "Tell me a very long story."}]})
    .to_string();
    let mut silent = Vec::new();
    for _ in 0..4 {
        let socket = TcpSocket::new_v4().expect("a socket");
        socket
            .set_recv_buffer_size(4096)
            .expect("a small receive buffer");
        let mut conn = socket
            .connect(host.parse().expect("an address"))
            .await
            .expect("connecting");
        conn.write_all(head(&host, "/v1/chat/completions", body.len()).as_bytes())
            .await
            .expect("the head");
        conn.write_all(body.as_bytes()).await.expect("the body");
        // The response's head and a first piece, then nothing more is read.
        let mut first = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(60), conn.read(&mut first))
            .await
            .expect("the stream starts")
            .expect("reading");
        assert!(
            String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&first[..n])
        );
        silent.push(conn);
    }
    let router = c.ops.clone();
    wait_metric(
        &router,
        "router_client_stalls_total",
        "",
        4.0,
        Duration::from_secs(60),
    )
    .await;
    wait_metric(&router, "router_requests_in_flight", "", 0.0, SLACK).await;
    wait_metric(&c.decode, "decode_running_sequences", "", 0.0, SLACK).await;
    let page = e2e::scrape(&c.decode).await;
    let cancelled = metric(&page, "decode_cancellations_total", "").unwrap_or(0.0);
    assert!(
        cancelled >= 4.0,
        "the stalled streams' generations were not cancelled:\n{page}"
    );
    c.assert_serving("after the stalled readers").await;
    drop(silent);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_longer_than_any_allowed_is_refused_before_it_is_tokenized() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    // Three million bytes of text (under the 4 Mi characters a prompt parameter may have):
    // no 2048-token prompt is that long, so the router says so from its length, and never
    // runs the tokenizer over it.
    let prompt = "word ".repeat(600_000);
    let (status, v) = c
        .post(
            "/v1/completions",
            &json!({"model": c.model_name, "prompt": prompt, "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("3000000 bytes, more than"), "{msg}");
    c.assert_serving("after the huge prompt").await;
}
