//! The endurance run: a router, two prefill and two decode nodes found through a real etcd
//! (or a cluster already running), a steady mixed load for a long time with a share of
//! clients leaving mid-stream, one prefill and one decode node killed (-9) and started again
//! during it, and at the end the checks that nothing leaked: every request ended (finished,
//! a clean error, or left by its client), KV held nowhere, and each process's memory,
//! descriptors, threads and tokio tasks back near their values after warm-up. It only drives
//! the cluster and reads its `/metrics`; it never reaches into a process.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{metric, workers_in, Fleet, Proc, Role, Worker};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::load::{self, Api, Rng, Shape};

/// What a soak run does and how much it lets the processes drift.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "soak")]
pub struct SoakConfig {
    /// Seconds of steady load after the warm-up.
    #[arg(long, default_value_t = 3600.0)]
    pub duration_s: f64,
    /// Seconds of load before the baseline is taken, so that pools, caches and allocator
    /// arenas have grown to their working size.
    #[arg(long, default_value_t = 30.0)]
    pub warmup_s: f64,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Mean pause of a client between two requests, in ms (exponential).
    #[arg(long, default_value_t = 100.0)]
    pub think_ms: f64,
    /// Percent of requests whose client leaves mid-stream.
    #[arg(long, default_value_t = 10.0)]
    pub drop_percent: f64,
    /// Most words in a prompt (each about one token); drawn uniformly from 8.
    #[arg(long, default_value_t = 64)]
    pub max_prompt_words: usize,
    /// Most output tokens of a request; drawn uniformly from 4. A client that leaves asks for
    /// four times this, so that it leaves while tokens still come.
    #[arg(long, default_value_t = 32)]
    pub max_output_tokens: usize,
    /// Seconds into the steady run when prefill node 0 is killed (default: 30% of it).
    #[arg(long)]
    pub kill_prefill_at_s: Option<f64>,
    /// Seconds into the steady run when decode node 0 is killed (default: 60% of it).
    #[arg(long)]
    pub kill_decode_at_s: Option<f64>,
    /// Seconds a killed node stays down before it is started again on its address.
    #[arg(long, default_value_t = 5.0)]
    pub restart_after_s: f64,
    /// Seconds after a restarted node is back in the router's rotation during which an
    /// error still counts as the kill's.
    #[arg(long, default_value_t = 5.0)]
    pub kill_grace_s: f64,
    /// Kill nothing.
    #[arg(long)]
    pub no_kills: bool,
    /// Run hostile peers and broken clients beside the load for the whole steady run
    /// (see `hostile`): forged KV tickets, silent and dripping KV connections, bodiless
    /// requests and streams whose client stops reading.
    #[arg(long)]
    pub hostile: bool,
    /// The prefill nodes' prefix cache (`--prefix-cache-mb`): small, so that it fills during
    /// the warm-up and the whole run evicts, and the baseline is taken with it full.
    #[arg(long, default_value_t = 32)]
    pub prefix_cache_mb: u64,
    /// Seconds a request may take before it counts as hung.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout_s: f64,
    /// Seconds the cluster may take to settle after the load (and after the warm-up).
    #[arg(long, default_value_t = 60.0)]
    pub settle_s: f64,
    /// Resident memory may end this many percent above its baseline...
    #[arg(long, default_value_t = 25.0)]
    pub rss_slack_percent: f64,
    /// ...or this many MiB, whichever is more.
    #[arg(long, default_value_t = 64.0)]
    pub rss_slack_mb: f64,
    /// Open file descriptors a process may end with above its baseline.
    #[arg(long, default_value_t = 16)]
    pub fd_slack: u64,
    /// Threads a process may end with above its baseline.
    #[arg(long, default_value_t = 4)]
    pub thread_slack: u64,
    /// Tokio tasks a process may end with above its baseline.
    #[arg(long, default_value_t = 16)]
    pub task_slack: u64,
    /// The model to serve (a Hugging Face folder or a GGUF file); default: the generated
    /// tiny model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Soak a cluster already running behind this router URL instead of starting one
    /// (nothing is killed then).
    #[arg(long)]
    pub url: Option<String>,
    /// With `--url`: the `model` of each request.
    #[arg(long, default_value = "test")]
    pub model_name: String,
    /// With `--url`: the prefill and decode nodes (host:port of their `/metrics`), comma
    /// separated.
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the result here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl SoakConfig {
    fn kills(&self) -> Vec<(Role, f64)> {
        if self.no_kills || self.url.is_some() {
            return Vec::new();
        }
        let mut kills = vec![
            (
                Role::Prefill,
                self.kill_prefill_at_s.unwrap_or(0.3 * self.duration_s),
            ),
            (
                Role::Decode,
                self.kill_decode_at_s.unwrap_or(0.6 * self.duration_s),
            ),
        ];
        kills.sort_by(|a, b| a.1.total_cmp(&b.1));
        kills
    }

    fn tolerance(&self) -> Tolerance {
        Tolerance {
            rss_fraction: self.rss_slack_percent / 100.0,
            rss_bytes: self.rss_slack_mb * 1024.0 * 1024.0,
            fds: self.fd_slack as f64,
            threads: self.thread_slack as f64,
            tasks: self.task_slack as f64,
        }
    }
}

/// Why a soak could not run at all (a failed check is not an error: it is in the report).
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error("{0} does not serve /metrics")]
    Unreachable(String),
    #[error("{0} serves neither prefill nor decode metrics")]
    UnknownRole(String),
    #[error("configuration: {0}")]
    Config(String),
}

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
    fn name(self) -> &'static str {
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
struct Plan {
    api: Api,
    stream: bool,
    leave_after: Option<usize>,
    shape: Shape,
    salt: u64,
}

/// Follows a streamed body's `data:` payloads to its end.
#[derive(Debug, Default)]
struct SseEnd {
    finished: bool,
    error: Option<String>,
    done: bool,
    /// What broke the stream's shape, if anything did.
    odd: Option<String>,
}

impl SseEnd {
    fn feed(&mut self, data: &str) {
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

    fn end(self) -> (Outcome, Option<String>) {
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
fn drain_events(buf: &mut Vec<u8>, end: &mut SseEnd) -> usize {
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
fn classify_unary(status: u16, body: &str) -> (Outcome, Option<String>) {
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
struct Load {
    client: reqwest::Client,
    base: String,
    model: String,
    cfg: SoakConfig,
    t0: Instant,
}

impl Load {
    fn plan(&self, rng: &mut Rng, salt: u64) -> Plan {
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

    async fn send(&self, p: Plan) -> RequestRecord {
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

    async fn unary(&self, path: &str, body: &Value) -> (u16, Outcome, Option<String>) {
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

    async fn streamed(&self, path: &str, body: &Value) -> (u16, Outcome, Option<String>) {
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
    async fn leave_mid_stream(
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
    async fn client(self: Arc<Self>, id: usize, until: Instant) -> Vec<RequestRecord> {
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

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

/// The status code of an HTTP/1 response head; 0 when it is not one.
fn parse_status_line(head: &[u8]) -> u16 {
    let head = String::from_utf8_lossy(head);
    head.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// What a process is, as far as its checks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Router,
    Prefill,
    Decode,
}

impl Kind {
    /// Gauges that read zero when the process holds no request.
    fn idle_gauges(self) -> &'static [&'static str] {
        match self {
            Kind::Router => &["router_requests_in_flight"],
            Kind::Prefill => &[
                "prefill_kv_bytes_held",
                "prefill_running_prompts",
                "prefill_queue_depth",
            ],
            Kind::Decode => &[
                "decode_kv_blocks_used",
                "decode_running_sequences",
                "decode_waiting_requests",
                "decode_held_transfers",
            ],
        }
    }

    /// The kind of a worker, from the metrics its page carries.
    fn of_worker(page: &str) -> Option<Self> {
        if metric(page, "decode_kv_blocks_used", "").is_some() {
            Some(Kind::Decode)
        } else if metric(page, "prefill_kv_bytes_held", "").is_some() {
            Some(Kind::Prefill)
        } else {
            None
        }
    }
}

/// The idle gauges of `kind` on `page` that are not zero (or absent), as `name=value`.
fn busy(kind: Kind, page: &str) -> Vec<String> {
    kind.idle_gauges()
        .iter()
        .filter_map(|name| match metric(page, name, "") {
            Some(0.0) => None,
            Some(v) => Some(format!("{name}={v}")),
            None => Some(format!("{name} absent")),
        })
        .collect()
}

/// A process's resource figures from its metrics page.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Resources {
    pub rss_bytes: f64,
    /// Bytes the process keeps by design, up to a configured budget (the prefill node's
    /// prefix cache); resident memory is compared net of them.
    pub cache_bytes: f64,
    pub open_fds: f64,
    pub threads: f64,
    pub tokio_tasks: f64,
}

impl Resources {
    /// The figures on `page`; `None` when one is missing.
    pub fn from_page(page: &str) -> Option<Self> {
        let m = |name| metric(page, name, "");
        Some(Self {
            rss_bytes: m("process_resident_memory_bytes")?,
            cache_bytes: m("prefill_prefix_cache_bytes").unwrap_or(0.0),
            open_fds: m("process_open_fds")?,
            threads: m("process_threads")?,
            tokio_tasks: m("tokio_alive_tasks")?,
        })
    }
}

/// How far each figure may end above its baseline.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tolerance {
    /// Resident memory (net of caches): this share of the baseline or `rss_bytes`,
    /// whichever is more.
    pub rss_fraction: f64,
    pub rss_bytes: f64,
    pub fds: f64,
    pub threads: f64,
    pub tasks: f64,
}

impl Tolerance {
    /// The figures of `now` that are past their limit over `base`, described.
    pub fn exceeded(&self, base: &Resources, now: &Resources) -> Vec<String> {
        let mib = |b: f64| b / (1024.0 * 1024.0);
        let mut out = Vec::new();
        let (base_rss, now_rss) = (
            base.rss_bytes - base.cache_bytes,
            now.rss_bytes - now.cache_bytes,
        );
        let rss_limit = base_rss + (self.rss_fraction * base_rss).max(self.rss_bytes);
        if now_rss > rss_limit {
            out.push(format!(
                "RSS net of caches {:.1} MiB > {:.1} MiB (baseline {:.1})",
                mib(now_rss),
                mib(rss_limit),
                mib(base_rss)
            ));
        }
        for (what, b, n, slack) in [
            ("open fds", base.open_fds, now.open_fds, self.fds),
            ("threads", base.threads, now.threads, self.threads),
            ("tokio tasks", base.tokio_tasks, now.tokio_tasks, self.tasks),
        ] {
            if n > b + slack {
                out.push(format!("{what} {n} > {b} + {slack}"));
            }
        }
        out
    }
}

/// One process the soak watches.
#[derive(Debug, Clone)]
struct Tracked {
    name: String,
    kind: Kind,
    addr: String,
}

/// A node killed and started again.
#[derive(Debug, Clone, Serialize)]
pub struct KillRecord {
    pub process: String,
    pub addr: String,
    /// It held work (a prompt, or sequences) when it was killed.
    pub busy_at_kill: bool,
    pub killed_at_s: f64,
    /// When the router stopped counting it ready; `None` if it never did.
    pub noticed_at_s: Option<f64>,
    pub restarted_at_s: f64,
    /// When the router counted it ready again; `None` if it never did.
    pub back_at_s: Option<f64>,
}

/// One process's figures at the baseline and at the end.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessReport {
    pub name: String,
    pub kind: Kind,
    pub addr: String,
    /// Killed and started again during the run: compared with the baseline of the process
    /// it replaced (same binary, same flags).
    pub restarted: bool,
    pub baseline: Option<Resources>,
    pub end: Option<Resources>,
    /// Idle gauges not at zero at the end.
    pub busy_at_end: Vec<String>,
    pub exceeded: Vec<String>,
}

/// One pass/fail line of the result.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

/// What a soak measured and whether each check passed.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub duration_s: f64,
    pub warmup_s: f64,
    pub clients: usize,
    pub drop_percent: f64,
    pub model: String,
    pub tolerance: Tolerance,
    /// Requests sent, in all and by outcome (warm-up included).
    pub requests: usize,
    pub outcomes: BTreeMap<String, usize>,
    /// By `<api>/<stream|whole>` and then outcome.
    pub by_kind: BTreeMap<String, BTreeMap<String, usize>>,
    /// Requests per second over the steady run.
    pub throughput_rps: f64,
    pub kills: Vec<KillRecord>,
    /// Seconds the cluster took to settle after the warm-up and after the load.
    pub warmup_settled_s: Option<f64>,
    pub settled_s: Option<f64>,
    pub processes: Vec<ProcessReport>,
    /// The router's `router_requests_total` over the soak, by `endpoint/status`, and what
    /// the clients saw, the same way.
    pub router_counted: BTreeMap<String, u64>,
    pub clients_saw: BTreeMap<String, u64>,
    /// Requests that did not end well outside a kill (the first 100).
    pub unexpected: Vec<RequestRecord>,
    /// What the hostile peers did, with `--hostile`.
    pub hostile: Option<crate::hostile::HostileReport>,
    /// Where the processes' logs are.
    pub logs: String,
    pub checks: Vec<Check>,
    pub passed: bool,
}

impl SoakReport {
    /// A short text of the result: counts, kills, each process's figures and each check.
    pub fn summary(&self) -> String {
        let mib = |b: f64| b / (1024.0 * 1024.0);
        let mut s = format!(
            "soak: {} s steady after {} s warm-up, {} clients, {}% leave mid-stream, model {}\n",
            self.duration_s, self.warmup_s, self.clients, self.drop_percent, self.model
        );
        s += "(times in s from the start of the warm-up)\n";
        s += &format!(
            "requests: {} ({:.1}/s steady): {:?}\n",
            self.requests, self.throughput_rps, self.outcomes
        );
        for k in &self.kills {
            s +=
                &format!(
                "kill -9 {}{} at {:.1} s, router noticed at {}, restarted at {:.1} s, back at {}\n",
                k.process,
                if k.busy_at_kill { " (holding work)" } else { " (idle)" },
                k.killed_at_s,
                k.noticed_at_s
                    .map_or("never".into(), |t| format!("{t:.1} s")),
                k.restarted_at_s,
                k.back_at_s.map_or("never".into(), |t| format!("{t:.1} s")),
            );
        }
        if let Some(h) = &self.hostile {
            s += &format!(
                "hostile: {} forged KV tickets refused ({} accepted), {} silent and {} dripping \
                 KV connections cut (longest {:.1} s), bodiless requests {:?}, {} stalled streams \
                 cut and {} complete, {} never closed\n",
                h.kv_forged_refused,
                h.kv_forged_accepted,
                h.kv_idle_closed,
                h.kv_slow_closed,
                h.kv_longest_open_s,
                h.no_body_statuses,
                h.stalled_cut,
                h.stalled_complete,
                h.never_closed,
            );
        }
        s += &format!(
            "settled in {} after the load\n",
            self.settled_s
                .map_or("(never)".into(), |t| format!("{t:.1} s"))
        );
        s +=
            "| process | RSS MiB (net of caches) base → end | open fds | threads | tokio tasks |\n";
        s += "| --- | ---: | ---: | ---: | ---: |\n";
        for p in &self.processes {
            let pair = |f: &dyn Fn(&Resources) -> f64| match (&p.baseline, &p.end) {
                (Some(b), Some(e)) => format!("{:.0} → {:.0}", f(b), f(e)),
                _ => "-".into(),
            };
            s += &format!(
                "| {}{} | {} | {} | {} | {} |\n",
                p.name,
                if p.restarted { " (restarted)" } else { "" },
                match (&p.baseline, &p.end) {
                    (Some(b), Some(e)) => format!(
                        "{:.1} → {:.1}",
                        mib(b.rss_bytes - b.cache_bytes),
                        mib(e.rss_bytes - e.cache_bytes)
                    ),
                    _ => "-".into(),
                },
                pair(&|r| r.open_fds),
                pair(&|r| r.threads),
                pair(&|r| r.tokio_tasks),
            );
        }
        for c in &self.checks {
            let mark = if c.passed { "PASS" } else { "FAIL" };
            s += &format!("{mark} {}: {}\n", c.name, c.detail);
        }
        s
    }
}

/// The processes of the run: started here (and then killed and restarted), or given.
struct Cluster {
    fleet: Option<Fleet>,
    model: PathBuf,
    url: String,
    model_name: String,
    procs: Vec<Tracked>,
    /// Flags every prefill node started here gets, restarts included.
    prefill_args: Vec<String>,
}

/// How long a started or restarted process may take to serve.
const START_LIMIT: Duration = Duration::from_secs(60);
/// How often the cluster is polled while it settles or recovers.
const POLL: Duration = Duration::from_millis(250);
/// How long a kill waits for its node to hold work, and how often it looks.
const BUSY_LIMIT: Duration = Duration::from_secs(10);
const BUSY_POLL: Duration = Duration::from_millis(5);

impl Cluster {
    async fn start(cfg: &SoakConfig, scraper: &reqwest::Client) -> Result<Self, SoakError> {
        let model = cfg.model.clone().unwrap_or_else(e2e::tiny_model);
        if let Some(url) = &cfg.url {
            let url = url.trim_end_matches('/').to_string();
            let mut procs = vec![Tracked {
                name: "router".into(),
                kind: Kind::Router,
                addr: url.trim_start_matches("http://").to_string(),
            }];
            for addr in &cfg.workers {
                let page = scrape(scraper, addr)
                    .await
                    .ok_or_else(|| SoakError::Unreachable(addr.clone()))?;
                let kind =
                    Kind::of_worker(&page).ok_or_else(|| SoakError::UnknownRole(addr.clone()))?;
                let n = procs.iter().filter(|p| p.kind == kind).count();
                let role = if kind == Kind::Prefill {
                    "prefill"
                } else {
                    "decode"
                };
                procs.push(Tracked {
                    name: format!("{role}{n}"),
                    kind,
                    addr: addr.clone(),
                });
            }
            return Ok(Self {
                fleet: None,
                model,
                url,
                model_name: cfg.model_name.clone(),
                procs,
                prefill_args: Vec::new(),
            });
        }
        let mut fleet = Fleet::start(&model, &[]).await;
        let prefill_args = vec![
            "--prefix-cache-mb".to_string(),
            cfg.prefix_cache_mb.to_string(),
        ];
        let prefill_flags: Vec<&str> = prefill_args.iter().map(String::as_str).collect();
        for _ in 0..2 {
            fleet.add_prefill(&prefill_flags);
            fleet.add_decode(&[]);
        }
        fleet
            .wait_workers(Role::Prefill, "ready", 2, START_LIMIT)
            .await;
        fleet
            .wait_workers(Role::Decode, "ready", 2, START_LIMIT)
            .await;
        fleet.wait_ready(START_LIMIT).await;
        let mut procs = vec![Tracked {
            name: "router".into(),
            kind: Kind::Router,
            addr: fleet.url.trim_start_matches("http://").to_string(),
        }];
        for (role, kind) in [(Role::Prefill, Kind::Prefill), (Role::Decode, Kind::Decode)] {
            for (i, w) in fleet.workers(role).iter().enumerate() {
                procs.push(Tracked {
                    name: format!("{}{i}", role.name()),
                    kind,
                    addr: w.addr.clone(),
                });
            }
        }
        Ok(Self {
            url: fleet.url.clone(),
            fleet: Some(fleet),
            model,
            model_name: "test".into(),
            procs,
            prefill_args,
        })
    }

    fn router_addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }

    /// Every process's metrics page now, by name (absent when it did not answer).
    async fn pages(&self, scraper: &reqwest::Client) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for p in &self.procs {
            if let Some(page) = scrape(scraper, &p.addr).await {
                out.insert(p.name.clone(), page);
            }
        }
        out
    }

    /// Polls until no process holds a request and, with a baseline, every process's figures
    /// are within `tol` of it, for at most `limit`; the seconds it took (`None` when time ran
    /// out) and the last pages.
    async fn settle(
        &self,
        scraper: &reqwest::Client,
        baseline: Option<&BTreeMap<String, Resources>>,
        tol: &Tolerance,
        limit: Duration,
    ) -> (Option<f64>, BTreeMap<String, String>) {
        let start = Instant::now();
        loop {
            let pages = self.pages(scraper).await;
            let settled = self.procs.iter().all(|p| {
                let Some(page) = pages.get(&p.name) else {
                    return false;
                };
                let within = baseline.is_none_or(|b| {
                    b.get(&p.name)
                        .zip(Resources::from_page(page))
                        .is_some_and(|(base, now)| tol.exceeded(base, &now).is_empty())
                });
                busy(p.kind, page).is_empty() && within
            });
            if settled {
                return (Some(start.elapsed().as_secs_f64()), pages);
            }
            if start.elapsed() >= limit {
                return (None, pages);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The router's count of ready workers of `role`; `None` when it does not answer.
    async fn ready_workers(&self, scraper: &reqwest::Client, role: Role) -> Option<f64> {
        let page = scrape(scraper, self.router_addr()).await?;
        workers_in(&page, role, "ready")
    }

    /// Polls the router until `holds` accepts its count of ready `role` workers, for at
    /// most `limit`; whether it did.
    async fn wait_ready_count(
        &self,
        scraper: &reqwest::Client,
        role: Role,
        limit: Duration,
        holds: impl Fn(f64) -> bool,
    ) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.ready_workers(scraper, role).await.is_some_and(&holds) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Kills worker 0 of `role` with SIGKILL, waits `down`, starts it again on its
    /// address, and waits for the router to route to it again.
    async fn kill_and_restart(
        &mut self,
        scraper: &reqwest::Client,
        role: Role,
        down: Duration,
        t0: Instant,
    ) -> KillRecord {
        let fleet = self
            .fleet
            .as_ref()
            .expect("kills need a cluster started here");
        let etcd = fleet.etcd.endpoint();
        let addr = fleet.workers(role)[0].addr.clone();
        // Killed while it holds work, when that shows within a few seconds: a kill between
        // two requests would test less.
        let gauge = match role {
            Role::Prefill => "prefill_running_prompts",
            Role::Decode => "decode_running_sequences",
        };
        let busy_deadline = Instant::now() + BUSY_LIMIT;
        let busy_at_kill = loop {
            let page = scrape(scraper, &addr).await;
            if page.is_some_and(|p| metric(&p, gauge, "").is_some_and(|n| n > 0.0)) {
                break true;
            }
            if Instant::now() >= busy_deadline {
                break false;
            }
            tokio::time::sleep(BUSY_POLL).await;
        };
        let fleet = self
            .fleet
            .as_mut()
            .expect("kills need a cluster started here");
        // Stamped before the signal: requests fail as soon as it lands, while `kill` still
        // waits to reap the process.
        let killed = Instant::now();
        let killed_at_s = t0.elapsed().as_secs_f64();
        fleet.workers_mut_of(role)[0].proc.kill();
        let noticed = self
            .wait_ready_count(scraper, role, down.max(Duration::from_secs(30)), |n| {
                n < 2.0
            })
            .await;
        let noticed_at_s = noticed.then(|| t0.elapsed().as_secs_f64());
        tokio::time::sleep((killed + down).saturating_duration_since(Instant::now())).await;
        let restarted_at_s = t0.elapsed().as_secs_f64();
        let model = self.model.display().to_string();
        let mut argv: Vec<String> = [
            "--model",
            &model,
            "--listen",
            &addr,
            "--etcd-endpoints",
            &etcd,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if role == Role::Prefill {
            argv.extend(self.prefill_args.iter().cloned());
        }
        let binary = match role {
            Role::Prefill => "tandem-prefill",
            Role::Decode => "tandem-decode",
        };
        let tag = format!("soak-{}0-restarted-{}", role.name(), e2e::free_port());
        let proc = Proc::spawn(&e2e::bin(binary), &argv, &tag);
        let fleet = self
            .fleet
            .as_mut()
            .expect("kills need a cluster started here");
        fleet.workers_mut_of(role)[0] = Worker {
            role,
            addr: addr.clone(),
            proc,
        };
        let back = self
            .wait_ready_count(scraper, role, START_LIMIT, |n| n >= 2.0)
            .await;
        KillRecord {
            process: format!("{}0", role.name()),
            addr,
            busy_at_kill,
            killed_at_s,
            noticed_at_s,
            restarted_at_s,
            back_at_s: back.then(|| t0.elapsed().as_secs_f64()),
        }
    }

    /// The processes started here that are no longer running, by name.
    fn exited(&mut self) -> Vec<String> {
        let Some(fleet) = self.fleet.as_mut() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if !fleet.router.running() {
            out.push("router".to_string());
        }
        for role in [Role::Prefill, Role::Decode] {
            for (i, w) in fleet.workers_mut_of(role).iter_mut().enumerate() {
                if !w.proc.running() {
                    out.push(format!("{}{i}", role.name()));
                }
            }
        }
        out
    }
}

/// The workers of one role, to replace a killed one.
trait WorkersOf {
    fn workers_mut_of(&mut self, role: Role) -> &mut Vec<Worker>;
}

impl WorkersOf for Fleet {
    fn workers_mut_of(&mut self, role: Role) -> &mut Vec<Worker> {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        }
    }
}

/// `GET http://{addr}/metrics`, bounded; `None` when it does not answer 200.
async fn scrape(client: &reqwest::Client, addr: &str) -> Option<String> {
    let resp = client
        .get(format!("http://{addr}/metrics"))
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .ok()?;
    if resp.status() != 200 {
        return None;
    }
    resp.text().await.ok()
}

/// `router_requests_total` on a router page, by `endpoint/status`.
fn router_requests(page: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("router_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\""))
                .map(|v| v.trim_end_matches('"').to_string())
        };
        if let (Some(endpoint), Some(status), Ok(n)) = (
            label("endpoint"),
            label("status"),
            value.trim().parse::<f64>(),
        ) {
            out.insert(format!("{endpoint}/{status}"), n as u64);
        }
    }
    out
}

/// Runs one phase of load until `until`; every request's record.
async fn drive(load: Load, until: Instant, clients: usize) -> Vec<RequestRecord> {
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

fn check(name: &str, passed: bool, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        passed,
        detail: detail.into(),
    }
}

/// Whether a request's end falls in a kill's window: from the kill until `grace_s` after
/// the node was back (or, if it never came back, without end).
fn in_kill_window(kills: &[KillRecord], at_s: f64, grace_s: f64) -> bool {
    kills
        .iter()
        .any(|k| at_s >= k.killed_at_s && k.back_at_s.is_none_or(|back| at_s <= back + grace_s))
}

/// Runs the soak and checks the cluster afterwards. Failed checks are in the report; an
/// error means the soak could not run.
pub async fn run(cfg: &SoakConfig) -> Result<SoakReport, SoakError> {
    let kills_planned = cfg.kills();
    if let Some(&(role, at)) = kills_planned.iter().find(|(_, at)| *at >= cfg.duration_s) {
        return Err(SoakError::Config(format!(
            "the {} kill at {at} s is not within the {} s run",
            role.name(),
            cfg.duration_s
        )));
    }
    if cfg.url.is_some() && cfg.workers.is_empty() {
        return Err(SoakError::Config("--url needs --workers".into()));
    }
    let tol = cfg.tolerance();
    let scraper = reqwest::Client::new();
    let mut cluster = Cluster::start(cfg, &scraper).await?;
    let settle_limit = Duration::from_secs_f64(cfg.settle_s);
    let t0 = Instant::now();
    let load = || Load {
        client: reqwest::Client::new(),
        base: cluster.url.clone(),
        model: cluster.model_name.clone(),
        cfg: cfg.clone(),
        t0,
    };
    let router_before = scrape(&scraper, cluster.router_addr())
        .await
        .map(|p| router_requests(&p))
        .ok_or_else(|| SoakError::Unreachable(cluster.url.clone()))?;

    let warm_until = Instant::now() + Duration::from_secs_f64(cfg.warmup_s);
    let mut records = drive(load(), warm_until, cfg.clients).await;
    let (warmup_settled_s, pages) = cluster.settle(&scraper, None, &tol, settle_limit).await;
    let baseline: BTreeMap<String, Resources> = pages
        .iter()
        .filter_map(|(name, page)| Some((name.clone(), Resources::from_page(page)?)))
        .collect();

    let steady_start = Instant::now();
    let steady_until = steady_start + Duration::from_secs_f64(cfg.duration_s);
    let steady = tokio::spawn(drive(load(), steady_until, cfg.clients));
    let hostile = cfg.hostile.then(|| {
        let decode = cluster
            .procs
            .iter()
            .filter(|p| p.kind == Kind::Decode)
            .map(|p| p.addr.clone())
            .collect();
        let router = cluster.router_addr().to_string();
        let model = cluster.model_name.clone();
        tokio::spawn(crate::hostile::run(decode, router, model, steady_until))
    });
    let mut kills = Vec::new();
    for (role, at) in &kills_planned {
        tokio::time::sleep_until((steady_start + Duration::from_secs_f64(*at)).into()).await;
        let down = Duration::from_secs_f64(cfg.restart_after_s);
        kills.push(cluster.kill_and_restart(&scraper, *role, down, t0).await);
    }
    let steady_records = steady.await.expect("the load task");
    let hostile = match hostile {
        Some(h) => Some(h.await.expect("the hostile task")),
        None => None,
    };
    let steady_s = steady_start.elapsed().as_secs_f64();
    let steady_count = steady_records.len();
    records.extend(steady_records);

    let (settled_s, pages) = cluster
        .settle(&scraper, Some(&baseline), &tol, settle_limit)
        .await;
    let exited = cluster.exited();
    let restarted: Vec<String> = kills.iter().map(|k| k.process.clone()).collect();

    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_kind: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut clients_saw: BTreeMap<String, u64> = BTreeMap::new();
    let mut unexpected = Vec::new();
    let mut hung_or_broken = 0;
    let mut errors_outside = 0;
    let mut client_errors = 0;
    for r in &records {
        *outcomes.entry(r.outcome.name().into()).or_default() += 1;
        let api = match r.api {
            Api::Chat => "chat",
            Api::Completions => "completions",
        };
        let shape = if r.stream { "stream" } else { "whole" };
        *by_kind
            .entry(format!("{api}/{shape}"))
            .or_default()
            .entry(r.outcome.name().into())
            .or_default() += 1;
        if r.status != 0 {
            *clients_saw
                .entry(format!("{api}/{}", r.status))
                .or_default() += 1;
        }
        let bad = match r.outcome {
            Outcome::Ok | Outcome::Dropped => false,
            Outcome::Broken | Outcome::Hung => {
                hung_or_broken += 1;
                true
            }
            Outcome::CleanError => {
                let client_error = (400..500).contains(&r.status);
                client_errors += usize::from(client_error);
                let expected = in_kill_window(&kills, r.ended_at_s, cfg.kill_grace_s);
                errors_outside += usize::from(!expected && !client_error);
                client_error || !expected
            }
        };
        if bad && unexpected.len() < 100 {
            unexpected.push(r.clone());
        }
    }
    for (k, n) in hostile.iter().flat_map(|h| h.router_saw()) {
        *clients_saw.entry(k).or_default() += n;
    }
    let router_after = pages.get("router").map(|p| router_requests(p.as_str()));
    let router_counted: BTreeMap<String, u64> = router_after
        .unwrap_or_default()
        .into_iter()
        .map(|(k, n)| {
            let before = router_before.get(&k).copied().unwrap_or(0);
            (k, n.saturating_sub(before))
        })
        .filter(|(_, n)| *n > 0)
        .collect();

    let mut processes = Vec::new();
    for p in &cluster.procs {
        let page = pages.get(&p.name);
        let end = page.and_then(|pg| Resources::from_page(pg.as_str()));
        let base = baseline.get(&p.name).copied();
        let exceeded = match (&base, &end) {
            (Some(b), Some(e)) => tol.exceeded(b, e),
            _ => vec!["no figures (the process did not answer /metrics)".into()],
        };
        processes.push(ProcessReport {
            name: p.name.clone(),
            kind: p.kind,
            addr: p.addr.clone(),
            restarted: restarted.contains(&p.name),
            baseline: base,
            end,
            busy_at_end: page.map_or(vec!["no answer".into()], |pg| busy(p.kind, pg)),
            exceeded,
        });
    }

    let dropped = outcomes.get("dropped").copied().unwrap_or(0);
    let ok = outcomes.get("ok").copied().unwrap_or(0);
    let mut checks = vec![
        check(
            "every request ended",
            hung_or_broken == 0,
            format!(
                "{} requests: {hung_or_broken} hung or broken",
                records.len()
            ),
        ),
        check(
            "errors only from the kills",
            errors_outside == 0 && client_errors == 0,
            format!(
                "{} clean errors, {errors_outside} outside a kill's window, {client_errors} 4xx",
                outcomes.get("clean_error").copied().unwrap_or(0)
            ),
        ),
        check(
            "requests served",
            ok > 0 && steady_count > 0,
            format!("{ok} finished"),
        ),
        check(
            "clients left mid-stream",
            dropped > 0 || cfg.drop_percent == 0.0,
            format!(
                "{dropped} of {} ({:.1}%)",
                records.len(),
                100.0 * dropped as f64 / records.len().max(1) as f64
            ),
        ),
        check(
            "the router counted every request",
            router_counted == clients_saw,
            format!("router {router_counted:?}, clients {clients_saw:?}"),
        ),
        check(
            "no process exited",
            exited.is_empty(),
            format!("exited: {exited:?}"),
        ),
        check(
            "settled after the warm-up",
            warmup_settled_s.is_some(),
            format!("within {:?}", settle_limit),
        ),
    ];
    for k in &kills {
        checks.push(check(
            &format!("{} killed and back", k.process),
            k.noticed_at_s.is_some() && k.back_at_s.is_some(),
            format!(
                "killed at {:.1} s, noticed {:?}, back {:?}",
                k.killed_at_s, k.noticed_at_s, k.back_at_s
            ),
        ));
    }
    for (name, passed, detail) in hostile.iter().flat_map(|h| h.checks()) {
        checks.push(check(&name, passed, detail));
    }
    if kills.len() < kills_planned.len() {
        checks.push(check("kills", false, "a planned kill did not happen"));
    }
    for p in &processes {
        checks.push(check(
            &format!("{} holds nothing", p.name),
            p.busy_at_end.is_empty(),
            if p.busy_at_end.is_empty() {
                p.kind.idle_gauges().join(", ") + " at 0"
            } else {
                p.busy_at_end.join(", ")
            },
        ));
        checks.push(check(
            &format!("{} back near its baseline", p.name),
            p.exceeded.is_empty(),
            if p.exceeded.is_empty() {
                "RSS, open fds, threads and tokio tasks within tolerance".into()
            } else {
                p.exceeded.join("; ")
            },
        ));
    }
    for p in processes.iter().filter(|p| p.restarted) {
        let served = pages.get(&p.name).and_then(|pg| match p.kind {
            Kind::Decode => metric(pg, "decode_requests_total", "{outcome=\"admitted\"}"),
            _ => metric(pg, "prefill_requests_total", "{outcome=\"completed\"}"),
        });
        checks.push(check(
            &format!("{} served after its restart", p.name),
            served.is_some_and(|n| n > 0.0),
            served.map_or("no answer".into(), |n| format!("{n} requests")),
        ));
    }
    let passed = checks.iter().all(|c| c.passed);
    Ok(SoakReport {
        duration_s: cfg.duration_s,
        warmup_s: cfg.warmup_s,
        clients: cfg.clients,
        drop_percent: cfg.drop_percent,
        model: cluster.model.display().to_string(),
        tolerance: tol,
        requests: records.len(),
        outcomes,
        by_kind,
        throughput_rps: steady_count as f64 / steady_s.max(f64::EPSILON),
        kills,
        warmup_settled_s,
        settled_s,
        processes,
        router_counted,
        clients_saw,
        unexpected,
        hostile,
        logs: e2e::scratch().display().to_string(),
        checks,
        passed,
    })
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

    fn res(rss_mb: f64, cache_mb: f64, fds: f64, threads: f64, tasks: f64) -> Resources {
        Resources {
            rss_bytes: rss_mb * 1024.0 * 1024.0,
            cache_bytes: cache_mb * 1024.0 * 1024.0,
            open_fds: fds,
            threads,
            tokio_tasks: tasks,
        }
    }

    #[test]
    fn tolerance_bounds_each_figure_above_its_baseline() {
        let tol = Tolerance {
            rss_fraction: 0.25,
            rss_bytes: 64.0 * 1024.0 * 1024.0,
            fds: 16.0,
            threads: 4.0,
            tasks: 16.0,
        };
        let base = res(100.0, 0.0, 30.0, 10.0, 20.0);
        // 64 MiB is more than 25% of 100 MiB, so it is the limit.
        assert!(tol
            .exceeded(&base, &res(163.0, 0.0, 46.0, 14.0, 36.0))
            .is_empty());
        // Lower is always fine.
        assert!(tol
            .exceeded(&base, &res(50.0, 0.0, 5.0, 2.0, 3.0))
            .is_empty());
        let over = tol.exceeded(&base, &res(165.0, 0.0, 47.0, 15.0, 37.0));
        assert_eq!(over.len(), 4, "{over:?}");
        // A cache grown up to its budget is not counted as a leak.
        assert!(tol
            .exceeded(&base, &res(400.0, 300.0, 30.0, 10.0, 20.0))
            .is_empty());
        // Above 256 MiB the share is the larger slack.
        let big = res(1000.0, 0.0, 30.0, 10.0, 20.0);
        assert!(tol
            .exceeded(&big, &res(1240.0, 0.0, 30.0, 10.0, 20.0))
            .is_empty());
        assert_eq!(
            tol.exceeded(&big, &res(1260.0, 0.0, 30.0, 10.0, 20.0))
                .len(),
            1
        );
    }

    #[test]
    fn idle_gauges_must_be_present_and_zero() {
        let page =
            "decode_kv_blocks_used 0\ndecode_running_sequences 2\ndecode_waiting_requests 0\n";
        assert_eq!(
            busy(Kind::Decode, page),
            vec![
                "decode_running_sequences=2".to_string(),
                "decode_held_transfers absent".to_string()
            ]
        );
        assert_eq!(Kind::of_worker(page), Some(Kind::Decode));
        assert_eq!(
            Kind::of_worker("prefill_kv_bytes_held 0\n"),
            Some(Kind::Prefill)
        );
        assert_eq!(Kind::of_worker("router_requests_in_flight 0\n"), None);
    }

    #[test]
    fn router_counts_are_read_by_endpoint_and_status() {
        let page = "# TYPE router_requests_total counter\n\
            router_requests_total{endpoint=\"chat\",status=\"200\"} 12\n\
            router_requests_total{endpoint=\"completions\",status=\"502\"} 1\n\
            router_requests_in_flight 0\n";
        let counts = router_requests(page);
        assert_eq!(counts.get("chat/200"), Some(&12));
        assert_eq!(counts.get("completions/502"), Some(&1));
        assert_eq!(counts.len(), 2);
    }

    #[test]
    fn errors_count_as_the_kills_only_inside_their_windows() {
        let kills = [KillRecord {
            process: "decode0".into(),
            addr: String::new(),
            busy_at_kill: true,
            killed_at_s: 10.0,
            noticed_at_s: Some(10.5),
            restarted_at_s: 15.0,
            back_at_s: Some(16.0),
        }];
        assert!(!in_kill_window(&kills, 9.9, 5.0));
        assert!(in_kill_window(&kills, 10.0, 5.0));
        assert!(in_kill_window(&kills, 21.0, 5.0));
        assert!(!in_kill_window(&kills, 21.1, 5.0));
        let never_back = [KillRecord {
            back_at_s: None,
            ..kills[0].clone()
        }];
        assert!(in_kill_window(&never_back, 1000.0, 5.0));
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

    #[test]
    fn kills_default_inside_the_run_and_can_be_turned_off() {
        use clap::Parser;
        let cfg = SoakConfig::try_parse_from(["soak", "--duration-s", "100"]).unwrap();
        let kills: Vec<(&str, f64)> = cfg.kills().iter().map(|(r, t)| (r.name(), *t)).collect();
        assert_eq!(kills, [("prefill", 30.0), ("decode", 60.0)]);
        let none = SoakConfig::try_parse_from(["soak", "--no-kills"]).unwrap();
        assert!(none.kills().is_empty());
    }
}
