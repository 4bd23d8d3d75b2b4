//! Hostile peers and broken clients for the soak (`soak --hostile`), kept up for the whole
//! steady run beside the real load: on each decode node's port, KV transfers with forged
//! tickets, connections that send the preface and then nothing, and senders that drip one
//! byte a second; on the router, requests whose body never comes and streams whose client
//! stops reading; and every abuse recipe of docs/security.md (`recipes`), each of which must
//! get its documented answer. The soak's own checks (every real request answered, nothing
//! held, memory back near its baseline) then say whether any of it cost the cluster.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::v1::KvHeader;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// Connections of each kind kept open at once.
const IDLE_KV: usize = 16;
const SLOW_KV: usize = 4;
const NO_BODY: usize = 16;
const STALLED: usize = 2;
/// How long a stalled client reads nothing: past the router's `--client-stall-timeout-ms`
/// (30 s by default).
const STALL_HOLD: Duration = Duration::from_secs(40);
/// How long any hostile connection may stay open before the far end closes it: past every
/// deadline of the node or router it tests.
const CLOSE_LIMIT: Duration = Duration::from_secs(90);

/// What the hostile peers did and how each ended.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostileReport {
    /// Forged KV transfers: refused with PERMISSION_DENIED, acknowledged (a breach), or
    /// ended otherwise.
    pub kv_forged_refused: u64,
    pub kv_forged_accepted: u64,
    pub kv_forged_other: u64,
    /// Silent and dripping KV connections the node closed, and the longest any lasted (s).
    pub kv_idle_closed: u64,
    pub kv_slow_closed: u64,
    pub kv_longest_open_s: f64,
    /// Bodiless requests, by the status the router answered (0: closed without one).
    pub no_body_statuses: BTreeMap<u16, u64>,
    /// Streams whose client stopped reading: ended by the router (cut) or complete, and
    /// the statuses of those the router did not take (none expected).
    pub stalled_cut: u64,
    pub stalled_complete: u64,
    pub stalled_refused: BTreeMap<u16, u64>,
    /// Connections of any kind still open after [`CLOSE_LIMIT`], and connect failures
    /// (a node being killed and restarted).
    pub never_closed: u64,
    pub unreachable: u64,
    /// What each abuse recipe got.
    pub recipes: BTreeMap<String, crate::recipes::Answers>,
}

impl HostileReport {
    /// The router's answers to the hostile requests, by `<endpoint>/<status>`, as the
    /// soak counts its own clients'.
    pub fn router_saw(&self) -> BTreeMap<String, u64> {
        let mut saw = BTreeMap::new();
        for (status, n) in self.no_body_statuses.iter().chain(&self.stalled_refused) {
            if *status != 0 {
                *saw.entry(format!("completions/{status}")).or_default() += n;
            }
        }
        let streams = self.stalled_cut + self.stalled_complete;
        if streams > 0 {
            *saw.entry("completions/200".to_string()).or_default() += streams;
        }
        for a in self.recipes.values() {
            let Some(endpoint) = a.counted_as else {
                continue;
            };
            for (status, n) in a.statuses.iter().filter(|(s, _)| **s != 0) {
                *saw.entry(format!("{endpoint}/{status}")).or_default() += n;
            }
        }
        saw
    }

    /// The checks the soak adds: `(name, passed, detail)`; `excused` says whether an answer
    /// at that second of the soak came while a node was down.
    pub fn checks(&self, excused: impl Fn(f64) -> bool) -> Vec<(String, bool, String)> {
        let recipes = self.recipes.iter().map(|(name, a)| {
            (
                format!("hostile: {name} answered {}", a.want),
                a.as_documented(&excused),
                format!("{:?} (status: count)", a.statuses),
            )
        });
        let timed_out = self.no_body_statuses.get(&408).copied().unwrap_or(0);
        let no_body: u64 = self.no_body_statuses.values().sum();
        vec![
            (
                "hostile: forged KV tickets refused".into(),
                self.kv_forged_accepted == 0 && self.kv_forged_refused > 0,
                format!(
                    "{} refused, {} accepted, {} ended otherwise",
                    self.kv_forged_refused, self.kv_forged_accepted, self.kv_forged_other
                ),
            ),
            (
                "hostile: silent and dripping KV peers cut".into(),
                self.kv_idle_closed > 0 && self.kv_slow_closed > 0,
                format!(
                    "{} silent and {} dripping closed by the node, the longest after {:.1} s",
                    self.kv_idle_closed, self.kv_slow_closed, self.kv_longest_open_s
                ),
            ),
            (
                "hostile: bodiless requests answered 408".into(),
                no_body > 0 && timed_out == no_body,
                format!("{:?} (status: count)", self.no_body_statuses),
            ),
            (
                "hostile: stalled streams cut by the router".into(),
                self.stalled_cut > 0 && self.stalled_refused.is_empty(),
                format!(
                    "{} cut by the router, {} complete, refused {:?}",
                    self.stalled_cut, self.stalled_complete, self.stalled_refused
                ),
            ),
            (
                "hostile: every connection closed by the far end".into(),
                self.never_closed == 0,
                format!(
                    "{} still open after {CLOSE_LIMIT:?}; {} connects failed (kills)",
                    self.never_closed, self.unreachable
                ),
            ),
        ]
        .into_iter()
        .chain(recipes)
        .collect()
    }
}

type Shared = Arc<Mutex<HostileReport>>;

fn note(report: &Shared, f: impl FnOnce(&mut HostileReport)) {
    f(&mut report.lock().expect("the report's lock is never poisoned"));
}

/// Runs the hostile peers against the decode nodes at `decode` and the router at `router`
/// (host:port each, the router serving `model`) from `t0` until `until`, then reports.
pub async fn run(
    decode: Vec<String>,
    router: String,
    model: String,
    t0: Instant,
    until: Instant,
) -> HostileReport {
    let report = Shared::default();
    let mut tasks = JoinSet::new();
    {
        let (router, model, report) = (router.clone(), model.clone(), Arc::clone(&report));
        tasks.spawn(async move {
            let answers = crate::recipes::run(&router, &model, t0, until).await;
            note(&report, |r| r.recipes = answers);
        });
    }
    for addr in &decode {
        tasks.spawn(forged_kv(addr.clone(), until, Arc::clone(&report)));
        for _ in 0..IDLE_KV {
            tasks.spawn(quiet_kv(addr.clone(), None, until, Arc::clone(&report)));
        }
        for _ in 0..SLOW_KV {
            let drip = Some(Duration::from_secs(1));
            tasks.spawn(quiet_kv(addr.clone(), drip, until, Arc::clone(&report)));
        }
    }
    for _ in 0..NO_BODY {
        tasks.spawn(no_body(router.clone(), until, Arc::clone(&report)));
    }
    for _ in 0..STALLED {
        let model = model.clone();
        tasks.spawn(stalled(router.clone(), model, until, Arc::clone(&report)));
    }
    while tasks.join_next().await.is_some() {}
    let r = report.lock().expect("the report's lock is never poisoned");
    r.clone()
}

/// A connection to `addr`, None (counted, after a pause) when nothing listens there (a
/// node killed for the soak). A `small` one has a receive buffer of a few KiB, as a client
/// on a slow link has: what it does not read backs up into the router quickly.
async fn connect(addr: &str, small: bool, report: &Shared) -> Option<TcpStream> {
    let dial = async {
        let addr = tokio::net::lookup_host(addr)
            .await?
            .next()
            .ok_or(std::io::ErrorKind::NotFound)?;
        let socket = match addr {
            std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        if small {
            socket.set_recv_buffer_size(4096)?;
        }
        socket.connect(addr).await
    };
    match dial.await {
        Ok(s) => Some(s),
        Err(_) => {
            note(report, |r| r.unreachable += 1);
            // Try again shortly rather than in a tight loop.
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
    }
}

/// KV transfers whose header carries a ticket the node never issued, one after another.
async fn forged_kv(addr: String, until: Instant, report: Shared) {
    let mut n = 0u64;
    while Instant::now() < until {
        let Some(mut s) = connect(&addr, false, &report).await else {
            continue;
        };
        n += 1;
        let header = KvHeader {
            request_id: format!("hostile-{n}"),
            tokens: vec![1, 2, 3],
            max_tokens: 9,
            ticket: (0..32).map(|i| (n as u8).wrapping_mul(31) ^ i).collect(),
            ..KvHeader::default()
        };
        let sent = async {
            s.write_all(kvwire::PREFACE).await?;
            kvwire::write_item(&mut s, &kvwire::Item::Header(header)).await
        };
        if sent.await.is_err() {
            note(&report, |r| r.kv_forged_other += 1);
            continue;
        }
        match tokio::time::timeout(CLOSE_LIMIT, kvwire::read_reply(&mut s)).await {
            Ok(Err(kvwire::WireError::Refused(st)))
                if st.code() == tonic::Code::PermissionDenied =>
            {
                note(&report, |r| r.kv_forged_refused += 1)
            }
            Ok(Ok(_)) => note(&report, |r| r.kv_forged_accepted += 1),
            Ok(Err(_)) => note(&report, |r| r.kv_forged_other += 1),
            Err(_) => note(&report, |r| r.never_closed += 1),
        }
        // A forger at a few attempts a second, not a flood of connects on two cores.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Connections that send the KV preface and then nothing (`drip` None) or one byte of a
/// header every `drip`, until the node closes them.
async fn quiet_kv(addr: String, drip: Option<Duration>, until: Instant, report: Shared) {
    while Instant::now() < until {
        let Some(mut s) = connect(&addr, false, &report).await else {
            continue;
        };
        let opened = Instant::now();
        if s.write_all(kvwire::PREFACE).await.is_err() {
            continue;
        }
        let closed = async {
            let mut byte = [0u8; 1];
            loop {
                let read = match drip {
                    None => s.read(&mut byte).await,
                    Some(every) => match tokio::time::timeout(every, s.read(&mut byte)).await {
                        Ok(r) => r,
                        Err(_) => match s.write_all(&[0]).await {
                            Ok(()) => continue,
                            Err(_) => return,
                        },
                    },
                };
                if !matches!(read, Ok(n) if n > 0) {
                    return;
                }
            }
        };
        if tokio::time::timeout(CLOSE_LIMIT, closed).await.is_err() {
            note(&report, |r| r.never_closed += 1);
            continue;
        }
        let lasted = opened.elapsed().as_secs_f64();
        note(&report, |r| {
            match drip {
                None => r.kv_idle_closed += 1,
                Some(_) => r.kv_slow_closed += 1,
            }
            r.kv_longest_open_s = r.kv_longest_open_s.max(lasted);
        });
    }
}

/// The status of the response whose head starts `bytes`, or 0.
fn status_of(bytes: &[u8]) -> u16 {
    std::str::from_utf8(bytes.get(9..12).unwrap_or_default())
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Requests that announce a megabyte of body and send none.
async fn no_body(router: String, until: Instant, report: Shared) {
    let head = "POST /v1/completions HTTP/1.1\r\nHost: tandem\r\n\
        Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n";
    while Instant::now() < until {
        let Some(mut s) = connect(&router, false, &report).await else {
            continue;
        };
        if s.write_all(head.as_bytes()).await.is_err() {
            continue;
        }
        let mut answer = Vec::new();
        match tokio::time::timeout(CLOSE_LIMIT, s.read_to_end(&mut answer)).await {
            Ok(_) => {
                let status = status_of(&answer);
                note(&report, |r| {
                    *r.no_body_statuses.entry(status).or_default() += 1
                });
            }
            Err(_) => note(&report, |r| r.never_closed += 1),
        }
    }
}

/// Streams with a lot to say whose client reads the response head and then nothing for
/// [`STALL_HOLD`], then reads what is left.
async fn stalled(router: String, model: String, until: Instant, report: Shared) {
    // 32 sequences (a decode node's default batch, the most one request may have) of 512
    // tokens with five alternatives each: several megabytes of events, more than the socket
    // buffers (which grow to 4 MiB on Linux) hold once the client stops reading.
    let body = serde_json::json!({"model": model, "prompt": "tell me everything",
        "max_tokens": 512, "n": 32, "logprobs": 5, "ignore_eos": true, "stream": true})
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    while Instant::now() < until {
        let Some(mut s) = connect(&router, true, &report).await else {
            continue;
        };
        if s.write_all(request.as_bytes()).await.is_err() {
            continue;
        }
        let mut first = [0u8; 12];
        if s.read_exact(&mut first).await.is_err() || status_of(&first) != 200 {
            note(&report, |r| {
                *r.stalled_refused.entry(status_of(&first)).or_default() += 1
            });
            continue;
        }
        // The client stops reading here; the router may let it go meanwhile.
        tokio::time::sleep(STALL_HOLD).await;
        let mut rest = Vec::new();
        match tokio::time::timeout(CLOSE_LIMIT, s.read_to_end(&mut rest)).await {
            Ok(_) => {
                let complete = rest.windows(12).any(|w| w == b"data: [DONE]");
                note(&report, |r| match complete {
                    true => r.stalled_complete += 1,
                    false => r.stalled_cut += 1,
                });
            }
            Err(_) => note(&report, |r| r.never_closed += 1),
        }
    }
}
