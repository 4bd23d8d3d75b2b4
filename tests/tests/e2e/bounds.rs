//! Every configurable bound of the router at its edge: the last size or count accepted and
//! the first refused, with the refusal's status and error shape, and the slot given back.

use std::time::Duration;

use e2e::{metric, smollm2, sse_chunks, tiny_model, wait_metric, Cluster, Mode, SseStream};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on every wait here: a freed slot showing, an answer arriving, a stream ending.
const WAIT: Duration = Duration::from_secs(20);

/// A short completion request.
fn hello() -> Value {
    json!({"model": "test", "prompt": "hello", "max_tokens": 2, "temperature": 0})
}

/// `hello()` written out and padded with JSON whitespace to exactly `len` bytes.
fn body_of(len: usize) -> String {
    let mut body = hello().to_string();
    assert!(body.len() <= len, "{len} bytes cannot hold {body}");
    body.push_str(&" ".repeat(len - body.len()));
    body
}

/// Sends raw bytes on a fresh connection and reads until the server closes it; the
/// response's status, or `None` when the connection ended without one (closed or reset).
async fn raw(url: &str, request: &[u8]) -> Option<u16> {
    let host = url.trim_start_matches("http://");
    let mut sock = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    // The server may answer and close before it has read everything: not a failure here.
    let _ = sock.write_all(request).await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = sock.read(&mut buf).await {
            answer.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(read.is_ok(), "no end of the answer within {WAIT:?}");
    let head = String::from_utf8_lossy(&answer);
    head.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// A POST of `body` with Content-Length.
fn post_sized(path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A POST of `body` in chunks of 100 bytes, without Content-Length, as a client that
/// does not say how much it sends.
fn post_chunked(path: &str, body: &str) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    for piece in body.as_bytes().chunks(100) {
        req.push_str(&format!("{:x}\r\n", piece.len()));
        req.push_str(std::str::from_utf8(piece).expect("ASCII"));
        req.push_str("\r\n");
    }
    req.push_str("0\r\n\r\n");
    req.into_bytes()
}

#[tokio::test]
async fn a_body_of_max_body_bytes_is_served_and_one_byte_more_gets_413() {
    const LIMIT: usize = 1000;
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--max-body-bytes", "1000"]).await;
    let client = reqwest::Client::new();
    let send = |body: String| {
        client
            .post(format!("{}/v1/completions", c.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let at = send(body_of(LIMIT)).await.unwrap();
    assert_eq!(at.status(), 200, "{}", at.text().await.unwrap());

    let over = send(body_of(LIMIT + 1)).await.unwrap();
    assert_eq!(over.status(), 413);
    let v: Value = over.json().await.expect("413 has a JSON body");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("1000 bytes"), "names the limit: {v}");

    // Without Content-Length the limit holds as the bytes arrive.
    let path = "/v1/completions";
    let at = raw(&c.url, &post_chunked(path, &body_of(LIMIT))).await;
    assert_eq!(at, Some(200), "a chunked body of exactly the limit");
    let over = raw(&c.url, &post_chunked(path, &body_of(LIMIT + 1))).await;
    assert_eq!(over, Some(413), "a chunked body one byte over");
    let at = raw(&c.url, &post_sized(path, &body_of(LIMIT))).await;
    assert_eq!(at, Some(200), "the raw request is well formed");
}

/// A stream that stays open while its client does not read: 16 choices of 2000 tokens
/// with 20 alternatives each come to about 50 MB of events, far more than the socket
/// buffers between router and client hold, so the router waits on the client.
fn held_request() -> Value {
    json!({"model": "test", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2000, "ignore_eos": true, "temperature": 1, "seed": 7, "n": 16,
        "logprobs": true, "top_logprobs": 20, "stream": true})
}

/// Opens a held stream and reads its first event, so it has surely started.
async fn open_held(c: &Cluster) -> SseStream {
    let url = format!("{}/v1/chat/completions", c.url);
    let (status, mut stream) = SseStream::open(&url, &held_request()).await;
    assert_eq!(status, 200, "a stream within the limit is accepted");
    let first = stream.next_data().await.expect("a first event");
    let first: Value = serde_json::from_str(&first).expect("a JSON chunk");
    assert!(first["choices"].is_array(), "a token chunk: {first}");
    stream
}

#[tokio::test]
async fn streams_past_max_streams_are_refused_until_one_ends() {
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &["--max-streams", "2", "--max-iter-times", "2000"],
    )
    .await;
    let addr = c.ops.clone();
    let open = |want: f64| wait_metric(&addr, "router_streams_open", "", want, WAIT);

    // A stream that finishes gives its slot back.
    let mut short = held_request();
    short["max_tokens"] = json!(3);
    short["n"] = json!(1);
    let (status, data) = c.post_sse("/v1/chat/completions", &short).await;
    assert_eq!(status, 200, "{data:?}");
    assert!(sse_chunks(&data).last().unwrap()["usage"].is_object());
    open(0.0).await;

    let held_a = open_held(&c).await;
    let held_b = open_held(&c).await;
    open(2.0).await;

    let refused = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.url))
        .json(&held_request())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503, "a third stream is refused");
    assert_eq!(refused.headers()["retry-after"], "1");
    let v: Value = refused.json().await.expect("an error object, not a stream");
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("2 open streams"), "{v}");
    let page = c.router_metrics().await;
    assert_eq!(
        metric(&page, "router_streams_refused_total", ""),
        Some(1.0),
        "{page}"
    );

    // Requests that are not streamed do not count against the limit.
    let (status, v) = c.post("/v1/completions", &hello()).await;
    assert_eq!(status, 200, "{v}");
    let page = c.router_metrics().await;
    assert_eq!(
        metric(&page, "router_streams_open", ""),
        Some(2.0),
        "{page}"
    );

    // A client that leaves gives its slot back, and the next stream gets it.
    drop(held_a);
    open(1.0).await;
    let held_c = open_held(&c).await;
    open(2.0).await;
    drop((held_b, held_c));
    open(0.0).await;
}

#[tokio::test]
async fn a_stream_that_fails_gives_its_slot_back() {
    // SmolLM2, whose 32000 held tokens take a minute on two cores: the tiny model made them
    // within the timeout on a fast machine, and the stream ended on its own.
    let c = Cluster::start(
        Mode::Pd,
        &smollm2(),
        &[
            "--max-streams",
            "1",
            "--max-iter-times",
            "2000",
            // The held stream cannot end on its own before this cuts it with an error.
            "--request-timeout-ms",
            "3000",
        ],
    )
    .await;
    let addr = c.ops.clone();
    let mut held = open_held(&c).await;
    let url = format!("{}/v1/chat/completions", c.url);
    let (status, _) = SseStream::open(&url, &held_request()).await;
    assert_eq!(status, 503, "the one slot is taken");

    let rest = tokio::time::timeout(WAIT, held.rest())
        .await
        .unwrap_or_else(|_| panic!("the stream did not end within {WAIT:?}"));
    let chunks = sse_chunks(&rest);
    let last = chunks.last().expect("events before [DONE]");
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("3000 ms"),
        "ends with the timeout's error: {last}"
    );
    wait_metric(&addr, "router_streams_open", "", 0.0, WAIT).await;
    // The slot is free again.
    open_held(&c).await;
}

/// A GET of /v1/models with `headers` (each `name: value`) after Host.
fn get_with(headers: &[String]) -> Vec<u8> {
    let mut req = String::from("GET /v1/models HTTP/1.1\r\nHost: t\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("Connection: close\r\n\r\n");
    req.into_bytes()
}

/// A request whose whole head (request line, headers, blank line) is `len` bytes, with
/// its bulk in one header.
fn head_of(len: usize) -> Vec<u8> {
    let bare = get_with(&["x-pad: ".to_string()]).len();
    assert!(bare <= len, "{len} bytes cannot hold a request");
    get_with(&[format!("x-pad: {}", "a".repeat(len - bare))])
}

#[tokio::test]
async fn headers_past_max_header_bytes_or_100_fields_are_refused() {
    const LIMIT: usize = 16 * 1024;
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--max-header-bytes", "16384"]).await;
    // The limit counts the whole head: request line, headers and the blank line.
    let at = head_of(LIMIT);
    assert_eq!(
        raw(&c.url, &at).await,
        Some(200),
        "a head of exactly the limit"
    );
    let over = head_of(LIMIT + 1);
    let refused = raw(&c.url, &over).await;
    assert!(
        matches!(refused, None | Some(431)),
        "a head one byte over gets 431 or a closed connection, got {refused:?}"
    );

    // Host, Connection and the rest make the fields; 100 pass, 101 do not.
    let fields = |n: usize| -> Vec<String> { (0..n - 2).map(|i| format!("x-h{i}: 1")).collect() };
    assert_eq!(raw(&c.url, &get_with(&fields(100))).await, Some(200));
    let refused = raw(&c.url, &get_with(&fields(101))).await;
    assert!(
        matches!(refused, None | Some(431)),
        "101 header fields get 431 or a closed connection, got {refused:?}"
    );
    // The router still serves after refusing.
    assert_eq!(raw(&c.url, &get_with(&[])).await, Some(200));
}
