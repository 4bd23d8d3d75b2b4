//! Requests to a router as a client makes them: JSON, server-sent events, and a client
//! that leaves mid-answer.

use super::*;

/// Sends a JSON POST, bounded to two minutes.
pub(crate) async fn send(url: &str, body: &Value) -> reqwest::Response {
    send_with(&reqwest::Client::new(), url, body).await
}

/// `send` through `client`.
pub(crate) async fn send_with(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(url)
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
}

/// POSTs JSON; returns the status and the JSON body (Null when it is not JSON).
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    read_json(send(url, body).await).await
}

/// The status and JSON body (Null when it is not JSON) of `resp`.
pub(crate) async fn read_json(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("reading the body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// POSTs a streaming request; returns the status and the `data:` payloads, in order.
/// Panics if the body is not valid UTF-8.
pub async fn post_sse(url: &str, body: &Value) -> (u16, Vec<String>) {
    let mut resp = send(url, body).await;
    let status = resp.status().as_u16();
    let mut bytes = Vec::new();
    while let Some(chunk) = resp.chunk().await.expect("reading the stream") {
        bytes.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(bytes).expect("the SSE body is valid UTF-8");
    let data = text
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_string)
        .collect();
    (status, data)
}

/// A streamed response read one SSE event at a time, for tests that act mid-stream.
pub struct SseStream {
    resp: reqwest::Response,
    buf: Vec<u8>,
    ended: bool,
}

impl SseStream {
    /// POSTs a streaming request to `url`; returns the status and the unread stream.
    pub async fn open(url: &str, body: &Value) -> (u16, Self) {
        let resp = send(url, body).await;
        let status = resp.status().as_u16();
        let stream = Self {
            resp,
            buf: Vec::new(),
            ended: false,
        };
        (status, stream)
    }

    /// The next event's `data:` payload; `None` once the stream has ended. Panics if the
    /// connection breaks or an event is not UTF-8.
    pub async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..end + 2).take(end).collect();
                let event = String::from_utf8(event).expect("an SSE event is valid UTF-8");
                match event.strip_prefix("data: ") {
                    Some(data) => return Some(data.to_string()),
                    // A comment or keep-alive: no payload.
                    None => continue,
                }
            }
            if self.ended {
                return None;
            }
            match self.resp.chunk().await.expect("reading the stream") {
                Some(chunk) => self.buf.extend_from_slice(&chunk),
                None => self.ended = true,
            }
        }
    }

    /// Every payload left, up to the end of the stream.
    pub async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(data) = self.next_data().await {
            out.push(data);
        }
        out
    }
}

/// The JSON chunks of a stream's `data:` payloads; panics unless it ends with `[DONE]` and
/// every other payload is JSON.
pub fn sse_chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// The text a streamed chat answer's first choice sent as content, chunk after chunk
/// (chunks without content, such as the role's and the finish's, add nothing).
pub fn chat_stream_content(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|ch| ch["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// Sends a JSON POST on a raw connection and returns it unread: dropping it closes the
/// socket, as a client that goes away does (an HTTP client library may keep the socket
/// open after its request future is dropped).
pub async fn post_then_leave(base_url: &str, path: &str, body: &Value) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let host = base_url.trim_start_matches("http://");
    let mut sock = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body.as_bytes()).await.unwrap();
    sock
}
