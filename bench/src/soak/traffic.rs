//! The soak's clients: what each request is, how it is sent (raw HTTP, so that a client
//! can leave mid-stream), and how its end is classified.

use super::*;

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A finish_reason (then `[DONE]` when streamed).
    Ok,
    /// An error status with an OpenAI error body, or an error event then `[DONE]`.
    CleanError,
    /// Its client left mid-stream, as planned.
    Dropped,
    /// Neither finished nor failed cleanly: a cut connection, a stream without its end, a
    /// body that is not the API's.
    Broken,
    /// No end within `--request-timeout-s`.
    Hung,
}

impl Outcome {
    pub(super) fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::CleanError => "clean_error",
            Outcome::Dropped => "dropped",
            Outcome::Broken => "broken",
            Outcome::Hung => "hung",
        }
    }
}

/// One request: what it was and how it ended, in seconds from the start of the soak.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub api: Api,
    pub stream: bool,
    /// The client meant to leave after this many SSE events.
    pub leave_after: Option<usize>,
    pub sent_at_s: f64,
    pub ended_at_s: f64,
    /// The HTTP status; 0 when none arrived.
    pub status: u16,
    pub outcome: Outcome,
    pub detail: Option<String>,
}

/// What one request will be.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) api: Api,
    pub(super) stream: bool,
    pub(super) leave_after: Option<usize>,
    pub(super) shape: Shape,
    pub(super) salt: u64,
}

/// Follows a streamed body's `data:` payloads to its end.
#[derive(Debug, Default)]
pub(super) struct SseEnd {
    pub(super) finished: bool,
    pub(super) error: Option<String>,
    pub(super) done: bool,
    /// What broke the stream's shape, if anything did.
    pub(super) odd: Option<String>,
}

impl SseEnd {
    pub(super) fn feed(&mut self, data: &str) {
        if self.done {
            self.odd
                .get_or_insert_with(|| format!("data after [DONE]: {data}"));
            return;
        }
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            self.odd.get_or_insert_with(|| format!("not JSON: {data}"));
            return;
        };
        if v.get("error").is_some_and(Value::is_object) {
            self.error.get_or_insert_with(|| v["error"].to_string());
        }
        let finishes = v["choices"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| !c["finish_reason"].is_null()));
        self.finished |= finishes;
    }

    pub(super) fn end(self) -> (Outcome, Option<String>) {
        match (self.odd, self.error, self.done, self.finished) {
            (Some(odd), ..) => (Outcome::Broken, Some(odd)),
            (None, Some(e), true, _) => (Outcome::CleanError, Some(e)),
            (None, Some(e), false, _) => (
                Outcome::Broken,
                Some(format!("an error event without [DONE]: {e}")),
            ),
            (None, None, true, true) => (Outcome::Ok, None),
            (None, None, true, false) => (
                Outcome::Broken,
                Some("[DONE] without a finish_reason".into()),
            ),
            (None, None, false, _) => (Outcome::Broken, Some("the stream was cut".into())),
        }
    }
}

/// Takes whole SSE events off the front of `buf`, feeding their `data:` payloads to `end`.
pub(super) fn drain_events(buf: &mut Vec<u8>, end: &mut SseEnd) -> usize {
    let mut events = 0;
    while let Some(at) = buf.windows(2).position(|w| w == b"\n\n") {
        let event: Vec<u8> = buf.drain(..at + 2).collect();
        let event = String::from_utf8_lossy(&event);
        if let Some(data) = event.trim().strip_prefix("data:") {
            end.feed(data.trim());
            events += 1;
        }
    }
    events
}

/// How a whole (not streamed) answer ended.
pub(super) fn classify_unary(status: u16, body: &str) -> (Outcome, Option<String>) {
    let v: Value = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(_) => return (Outcome::Broken, Some(format!("HTTP {status}: {body}"))),
    };
    if status == 200 {
        let finished = v["choices"]
            .as_array()
            .is_some_and(|cs| !cs.is_empty() && cs.iter().all(|c| !c["finish_reason"].is_null()));
        if finished {
            (Outcome::Ok, None)
        } else {
            (Outcome::Broken, Some(format!("no finish_reason: {v}")))
        }
    } else if v["error"].is_object() {
        (Outcome::CleanError, Some(format!("HTTP {status}: {v}")))
    } else {
        (Outcome::Broken, Some(format!("HTTP {status}: {v}")))
    }
}

/// The load of one phase: the clients' shared HTTP client, dropped with the phase so that
/// its idle connections do not count on the router.
pub(super) struct Load {
    pub(super) client: reqwest::Client,
    pub(super) base: String,
    pub(super) model: String,
    pub(super) cfg: SoakConfig,
    pub(super) t0: Instant,
}

impl Load {
    pub(super) fn plan(&self, rng: &mut Rng, salt: u64) -> Plan {
        let api = if rng.next_u64().is_multiple_of(2) {
            Api::Chat
        } else {
            Api::Completions
        };
        let leave = rng.unit() * 100.0 <= self.cfg.drop_percent;
        let stream = leave || rng.next_u64().is_multiple_of(2);
        let uniform = |rng: &mut Rng, lo: usize, hi: usize| {
            lo + (rng.next_u64() % (hi.max(lo) - lo + 1) as u64) as usize
        };
        let prompt_tokens = uniform(rng, 8, self.cfg.max_prompt_words);
        let mut output_tokens = uniform(rng, 4, self.cfg.max_output_tokens);
        let leave_after = leave.then(|| {
            output_tokens = 4 * self.cfg.max_output_tokens.max(4);
            uniform(rng, 1, 3)
        });
        Plan {
            api,
            stream,
            leave_after,
            shape: Shape {
                prompt_tokens,
                output_tokens,
            },
            salt,
        }
    }

    pub(super) async fn send(&self, p: Plan) -> RequestRecord {
        let sent_at_s = self.t0.elapsed().as_secs_f64();
        let mut body = load::body(p.api, &self.model, p.shape, p.salt);
        if !p.stream {
            body["stream"] = Value::Bool(false);
            if let Some(o) = body.as_object_mut() {
                o.remove("stream_options");
            }
        }
        let path = load::path(p.api);
        let attempt = async {
            match p.leave_after {
                Some(events) => self.leave_mid_stream(path, &body, events).await,
                None if p.stream => self.streamed(path, &body).await,
                None => self.unary(path, &body).await,
            }
        };
        let limit = Duration::from_secs_f64(self.cfg.request_timeout_s);
        let (status, outcome, detail) = match tokio::time::timeout(limit, attempt).await {
            Ok(r) => r,
            Err(_) => (0, Outcome::Hung, Some(format!("no end within {limit:?}"))),
        };
        RequestRecord {
            api: p.api,
            stream: p.stream,
            leave_after: p.leave_after,
            sent_at_s,
            ended_at_s: self.t0.elapsed().as_secs_f64(),
            status,
            outcome,
            detail,
        }
    }

    pub(super) async fn unary(&self, path: &str, body: &Value) -> (u16, Outcome, Option<String>) {
        let resp = match self
            .client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return (0, Outcome::Broken, Some(e.to_string())),
        };
        let status = resp.status().as_u16();
        match resp.text().await {
            Ok(text) => {
                let (outcome, detail) = classify_unary(status, &text);
                (status, outcome, detail)
            }
            Err(e) => (status, Outcome::Broken, Some(e.to_string())),
        }
    }

    pub(super) async fn streamed(
        &self,
        path: &str,
        body: &Value,
    ) -> (u16, Outcome, Option<String>) {
        let mut resp = match self
            .client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return (0, Outcome::Broken, Some(e.to_string())),
        };
        let status = resp.status().as_u16();
        if status != 200 {
            let text = resp.text().await.unwrap_or_default();
            let (outcome, detail) = classify_unary(status, &text);
            return (status, outcome, detail);
        }
        let mut end = SseEnd::default();
        let mut buf = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    buf.extend_from_slice(&bytes);
                    drain_events(&mut buf, &mut end);
                }
                Ok(None) => break,
                Err(e) => return (status, Outcome::Broken, Some(e.to_string())),
            }
        }
        let (outcome, detail) = end.end();
        (status, outcome, detail)
    }

    /// A streamed request on a raw connection that is closed after `events` SSE events, as
    /// a client that goes away does (an HTTP client library may keep its socket).
    pub(super) async fn leave_mid_stream(
        &self,
        path: &str,
        body: &Value,
        events: usize,
    ) -> (u16, Outcome, Option<String>) {
        let host = self.base.trim_start_matches("http://");
        let mut sock = match tokio::net::TcpStream::connect(host).await {
            Ok(s) => s,
            Err(e) => return (0, Outcome::Broken, Some(format!("connecting: {e}"))),
        };
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let sent = async {
            sock.write_all(head.as_bytes()).await?;
            sock.write_all(body.as_bytes()).await
        };
        if let Err(e) = sent.await {
            return (0, Outcome::Broken, Some(format!("sending: {e}")));
        }
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let mut status = 0;
        let mut seen = 0;
        loop {
            let n = match sock.read(&mut chunk).await {
                Ok(n) => n,
                Err(e) => return (status, Outcome::Broken, Some(format!("reading: {e}"))),
            };
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            let Some(head_end) = find(&buf, b"\r\n\r\n") else {
                continue;
            };
            status = parse_status_line(&buf[..head_end]);
            if status != 200 {
                // An error answer: read it whole (the server closes after it).
                continue;
            }
            let rest = &buf[head_end + 4..];
            seen = count(rest, b"data:");
            if find(rest, b"[DONE]").is_some() {
                // The answer ended before the client meant to leave.
                let failed = find(rest, b"\"error\":{").is_some();
                let outcome = if failed {
                    Outcome::CleanError
                } else {
                    Outcome::Ok
                };
                return (status, outcome, None);
            }
            if seen >= events {
                // Dropping the socket here is the client leaving.
                return (status, Outcome::Dropped, None);
            }
        }
        match find(&buf, b"\r\n\r\n") {
            Some(head_end) if status != 200 => {
                let text = String::from_utf8_lossy(&buf[head_end + 4..]);
                let (outcome, detail) = classify_unary(status, &text);
                (status, outcome, detail)
            }
            _ => (
                status,
                Outcome::Broken,
                Some(format!("closed by the server after {seen} events")),
            ),
        }
    }

    /// One client: requests one after another with a pause between, until `until`.
    pub(super) async fn client(self: Arc<Self>, id: usize, until: Instant) -> Vec<RequestRecord> {
        let mut rng = Rng::new(self.cfg.seed ^ (id as u64 + 1).wrapping_mul(0x9e37_79b9));
        let mut out = Vec::new();
        let mut n = 0u64;
        while Instant::now() < until {
            let salt = self.cfg.seed ^ ((id as u64) << 40) ^ n;
            let plan = self.plan(&mut rng, salt);
            out.push(self.send(plan).await);
            n += 1;
            let pause = Duration::from_secs_f64(rng.exponential(self.cfg.think_ms / 1e3));
            tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now()))).await;
        }
        out
    }
}

pub(super) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub(super) fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

/// The status code of an HTTP/1 response head; 0 when it is not one.
pub(super) fn parse_status_line(head: &[u8]) -> u16 {
    let head = String::from_utf8_lossy(head);
    head.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Runs one phase of load until `until`; every request's record.
pub(super) async fn drive(load: Load, until: Instant, clients: usize) -> Vec<RequestRecord> {
    let load = Arc::new(load);
    let mut tasks = JoinSet::new();
    for id in 0..clients.max(1) {
        tasks.spawn(Arc::clone(&load).client(id, until));
    }
    let mut records = Vec::new();
    while let Some(done) = tasks.join_next().await {
        records.extend(done.expect("a client task"));
    }
    records
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(payloads: &[&str]) -> (Outcome, Option<String>) {
        let mut buf: Vec<u8> = payloads
            .iter()
            .flat_map(|p| format!("data: {p}\n\n").into_bytes())
            .collect();
        let mut end = SseEnd::default();
        assert_eq!(drain_events(&mut buf, &mut end), payloads.len());
        assert!(buf.is_empty());
        end.end()
    }

    #[test]
    fn a_stream_ends_ok_only_with_a_finish_and_done() {
        let token = r#"{"choices":[{"index":0,"text":"a","finish_reason":null}]}"#;
        let finish = r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#;
        let error = r#"{"error":{"message":"decode node failed","type":"server_error"}}"#;
        assert_eq!(sse(&[token, finish, "[DONE]"]).0, Outcome::Ok);
        assert_eq!(sse(&[token, error, "[DONE]"]).0, Outcome::CleanError);
        assert_eq!(sse(&[token, error]).0, Outcome::Broken);
        assert_eq!(sse(&[token, "[DONE]"]).0, Outcome::Broken);
        assert_eq!(sse(&[token, finish]).0, Outcome::Broken);
        assert_eq!(
            sse(&[token, "{not json", finish, "[DONE]"]).0,
            Outcome::Broken
        );
        assert_eq!(sse(&[finish, "[DONE]", token]).0, Outcome::Broken);
    }

    #[test]
    fn a_partial_event_waits_for_its_end() {
        let mut buf = b"data: [DONE]\n".to_vec();
        let mut end = SseEnd::default();
        assert_eq!(drain_events(&mut buf, &mut end), 0);
        buf.extend_from_slice(b"\n: keep-alive\n\n");
        assert_eq!(drain_events(&mut buf, &mut end), 1);
        assert!(end.done);
    }

    #[test]
    fn whole_answers_are_classified() {
        let ok = r#"{"choices":[{"text":"x","finish_reason":"stop"}]}"#;
        assert_eq!(classify_unary(200, ok).0, Outcome::Ok);
        let unfinished = r#"{"choices":[{"text":"x","finish_reason":null}]}"#;
        assert_eq!(classify_unary(200, unfinished).0, Outcome::Broken);
        let err = r#"{"error":{"message":"no decode node","code":"service_unavailable"}}"#;
        assert_eq!(classify_unary(503, err).0, Outcome::CleanError);
        assert_eq!(classify_unary(502, "bad gateway").0, Outcome::Broken);
        assert_eq!(classify_unary(500, "{}").0, Outcome::Broken);
    }

    #[test]
    fn the_status_line_is_read() {
        assert_eq!(parse_status_line(b"HTTP/1.1 503 Service Unavailable"), 503);
        assert_eq!(parse_status_line(b"garbage"), 0);
    }

    #[test]
    fn plans_mix_apis_streams_and_leavers() {
        use clap::Parser;
        let cfg = SoakConfig::try_parse_from(["soak", "--drop-percent", "10"]).unwrap();
        let load = Load {
            client: reqwest::Client::new(),
            base: String::new(),
            model: "test".into(),
            cfg,
            t0: Instant::now(),
        };
        let mut rng = Rng::new(5);
        let plans: Vec<Plan> = (0..2000).map(|i| load.plan(&mut rng, i)).collect();
        let leavers = plans.iter().filter(|p| p.leave_after.is_some()).count();
        assert!((150..250).contains(&leavers), "{leavers} of 2000 leave");
        assert!(plans
            .iter()
            .filter(|p| p.leave_after.is_some())
            .all(|p| p.stream && p.shape.output_tokens == 128));
        let streamed = plans.iter().filter(|p| p.stream).count();
        assert!((1000..1200).contains(&streamed), "{streamed} streamed");
        let chat = plans.iter().filter(|p| p.api == Api::Chat).count();
        assert!((900..1100).contains(&chat), "{chat} chat");
        assert!(plans
            .iter()
            .all(|p| (8..=64).contains(&p.shape.prompt_tokens)));
        assert!(plans
            .iter()
            .filter(|p| p.leave_after.is_none())
            .all(|p| (4..=32).contains(&p.shape.output_tokens)));
    }
}
