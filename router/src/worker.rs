//! One prefill or decode worker as the router sees it: its channel, its last probe, its
//! circuit breaker, what the router has placed on it and which prompt prefixes it holds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use discovery::Role;
use proto::v1::decode_client::DecodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{HealthReply, HealthRequest, WorkerLoad};
use runtime::Channel;

use crate::error::RouterError;

/// Where a worker stands with the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// In rotation.
    Ready,
    /// Not answering its health call (or not yet): never routed to.
    Unhealthy,
    /// Its circuit breaker is open after repeated failures; probed back in after a cooldown.
    Open,
    /// Serves another model, KV layout or engine version than the router's.
    Incompatible,
    /// Told to stop: finishing what it holds, taking nothing new.
    Draining,
}

impl State {
    /// Every state, in the order metrics print them.
    pub const ALL: [State; 5] = [
        State::Ready,
        State::Unhealthy,
        State::Open,
        State::Incompatible,
        State::Draining,
    ];

    /// The state's name in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Ready => "ready",
            State::Unhealthy => "unhealthy",
            State::Open => "open",
            State::Incompatible => "incompatible",
            State::Draining => "draining",
        }
    }
}

/// What a worker must serve for this router to pair it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub model: String,
    pub layout: discovery::Layout,
    pub engine_version: String,
}

impl Expected {
    /// Why a worker that serves `model` on engine `engine_version` with KV caches of
    /// `layout` (none: it did not say) cannot be paired, or None when it can.
    pub fn mismatch(
        &self,
        model: &str,
        engine_version: &str,
        layout: Option<&discovery::Layout>,
    ) -> Option<String> {
        if model != self.model {
            Some(format!("model {model:?} (router: {})", self.model))
        } else if engine_version != self.engine_version {
            Some(format!(
                "engine {engine_version:?} (router: {})",
                self.engine_version
            ))
        } else if layout != Some(&self.layout) {
            Some(format!("KV layout {layout:?} (router: {:?})", self.layout))
        } else {
            None
        }
    }
}

/// How workers are reached and when they are taken out of rotation.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// How workers are dialed (timeout, TLS, message size).
    pub dialer: runtime::Dialer,
    /// Consecutive failed requests that open a worker's breaker.
    pub breaker_failures: u32,
    /// How long a breaker first stays open; doubled on each failure after, up to a minute.
    pub breaker_cooldown: Duration,
}

/// The longest a breaker stays open.
const MAX_COOLDOWN: Duration = Duration::from_secs(60);
/// Prompt-prefix hashes remembered per prefill worker for affinity.
const PREFIX_MEMORY: usize = 16_384;
/// Tokens per prompt block hashed for prefix affinity (the prefill nodes' cache block).
pub const AFFINITY_BLOCK: usize = 16;

/// One worker: a lazily connected channel, what the last probe saw, its breaker and the
/// load this router has placed on it.
#[derive(Debug)]
pub struct Worker {
    pub addr: String,
    /// What metrics call it: its registration's name, or its role and place in a static
    /// list; never its address, which is the cluster's map.
    pub name: String,
    channel: Channel,
    /// Largest gRPC message sent or accepted.
    max_message: usize,
    /// Why its registration rules it out, whatever it answers.
    mismatch: Option<String>,
    probe: Mutex<Probe>,
    breaker: Mutex<Breaker>,
    /// Prompt tokens this router has sent it that are still prefilling.
    pub prefill_tokens: AtomicU64,
    /// Sequences this router has running on it.
    pub sequences: AtomicU64,
    /// KV blocks this router's requests hold on it.
    pub blocks: AtomicU64,
    /// Hashes of prompt prefixes sent to it, with when they were last sent.
    prefixes: Mutex<HashMap<u64, u64>>,
    prefix_clock: AtomicU64,
}

#[derive(Debug, Default)]
struct Probe {
    ok: bool,
    incompatible: bool,
    draining: bool,
    load: WorkerLoad,
}

#[derive(Debug)]
struct Breaker {
    failures: u32,
    open_until: Option<Instant>,
    cooldown: Duration,
}

/// Why a worker that answered `reply` cannot be paired by a router that expects `expected`
/// of a `role` worker, or None when it can. Whichever way the worker was found, its own
/// health reply is what is checked.
fn incompatibility(reply: &HealthReply, role: Role, expected: &Expected) -> Option<String> {
    let layout = reply.layout.as_ref().map(|l| discovery::Layout {
        n_layers: l.n_layers,
        n_kv_heads: l.n_kv_heads,
        head_dim: l.head_dim,
        dtype: l.dtype.clone(),
    });
    if reply.role != role.as_str() {
        return Some(format!("role {:?} (want {})", reply.role, role.as_str()));
    }
    expected.mismatch(&reply.model, &reply.engine_version, layout.as_ref())
}

impl Worker {
    pub(crate) fn new(
        name: String,
        addr: &str,
        mismatch: Option<String>,
        s: &PoolSettings,
    ) -> Result<Self, RouterError> {
        let channel = s
            .dialer
            .channel(addr)
            .map_err(|e| RouterError::Internal(format!("bad worker address {addr}: {e}")))?;
        Ok(Self {
            addr: addr.to_string(),
            name,
            channel,
            max_message: s.dialer.max_message,
            mismatch,
            probe: Mutex::default(),
            breaker: Mutex::new(Breaker {
                failures: 0,
                open_until: None,
                cooldown: s.breaker_cooldown,
            }),
            prefill_tokens: AtomicU64::new(0),
            sequences: AtomicU64::new(0),
            blocks: AtomicU64::new(0),
            prefixes: Mutex::default(),
            prefix_clock: AtomicU64::new(0),
        })
    }

    /// A healthy worker at `addr` with nothing placed on it, for policy tests.
    #[cfg(test)]
    pub fn new_for_tests(addr: &str, s: &PoolSettings) -> Self {
        let w = Self::new("test".into(), addr, None, s).expect("a valid address");
        w.probe.lock().expect("probe lock").ok = true;
        w
    }

    /// Sets what the last probe reported, for policy tests.
    #[cfg(test)]
    pub fn set_load_for_tests(&self, load: WorkerLoad) {
        self.probe.lock().expect("probe lock").load = load;
    }

    /// A client for a prefill node.
    pub fn prefill(&self) -> PrefillClient<Channel> {
        PrefillClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    /// A client for a decode node (or colocated worker).
    pub fn decode(&self) -> DecodeClient<Channel> {
        DecodeClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    /// The worker's state now.
    pub fn state(&self) -> State {
        let p = self.probe.lock().expect("probe lock");
        if self.mismatch.is_some() || p.incompatible {
            State::Incompatible
        } else if !p.ok {
            State::Unhealthy
        } else if p.draining {
            State::Draining
        } else if self.breaker_open() {
            State::Open
        } else {
            State::Ready
        }
    }

    pub(crate) fn breaker_open(&self) -> bool {
        let b = self.breaker.lock().expect("breaker lock");
        b.open_until.is_some_and(|t| Instant::now() < t)
    }

    /// What the worker reported holding at its last probe.
    pub fn load(&self) -> WorkerLoad {
        self.probe.lock().expect("probe lock").load
    }

    /// Records a request that failed because of this worker; enough of them in a row open
    /// its breaker. Past the cooldown it takes requests again (half open): one more failure
    /// opens it again for twice as long, a success closes it.
    pub fn failed(&self, s: &PoolSettings) {
        let mut b = self.breaker.lock().expect("breaker lock");
        b.failures += 1;
        if b.failures >= s.breaker_failures.max(1) {
            let reopened = b.open_until.is_some();
            if reopened {
                b.cooldown = (b.cooldown * 2).min(MAX_COOLDOWN);
            }
            b.open_until = Some(Instant::now() + b.cooldown);
            tracing::warn!(worker = %self.addr, failures = b.failures, cooldown = ?b.cooldown,
                "circuit breaker open");
        }
    }

    /// Takes the worker out of rotation until it answers a health probe again: a call to it
    /// found it down or cut off, and the next probe may be a second away.
    pub fn mark_down(&self) {
        self.probe.lock().expect("probe lock").ok = false;
    }

    /// Records a request this worker served.
    pub fn succeeded(&self, s: &PoolSettings) {
        let mut b = self.breaker.lock().expect("breaker lock");
        if b.open_until.is_some() {
            tracing::info!(worker = %self.addr, "circuit breaker closed");
        }
        b.failures = 0;
        b.open_until = None;
        b.cooldown = s.breaker_cooldown;
    }

    /// Asks the worker for its health and load, within `timeout`.
    pub(crate) async fn probe(&self, role: Role, expected: &Expected, timeout: Duration) {
        let call = async {
            match role {
                Role::Prefill => self.prefill().health(HealthRequest {}).await,
                Role::Decode => self.decode().health(HealthRequest {}).await,
            }
        };
        let reply = tokio::time::timeout(timeout, call).await;
        let mut p = self.probe.lock().expect("probe lock");
        let was_ok = p.ok;
        match reply {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                let why = incompatibility(&r, role, expected);
                if why.is_some() && !p.incompatible {
                    tracing::warn!(worker = %self.addr, why = why.as_deref().unwrap_or_default(),
                        "worker does not match this router's model; not routed to");
                }
                p.incompatible = why.is_some();
                p.ok = true;
                p.draining = r.draining;
                p.load = r.load.unwrap_or_default();
            }
            Ok(Err(status)) => {
                p.ok = false;
                if was_ok {
                    tracing::warn!(worker = %self.addr, %status, "worker failed its health call");
                }
            }
            Err(_) => {
                p.ok = false;
                if was_ok {
                    tracing::warn!(worker = %self.addr, ?timeout, "worker did not answer its health call");
                }
            }
        }
    }

    /// Remembers that a prompt with these block hashes was sent here.
    pub fn remember_prefix(&self, hashes: &[u64]) {
        let now = self.prefix_clock.fetch_add(1, Ordering::Relaxed);
        let mut set = self.prefixes.lock().expect("prefix lock");
        for h in hashes {
            set.insert(*h, now);
        }
        if set.len() > PREFIX_MEMORY {
            // Forget the older half at once, so the cost is paid rarely.
            let mut ages: Vec<u64> = set.values().copied().collect();
            let (_, median, _) = ages.select_nth_unstable(set.len() / 2);
            let cut = *median;
            set.retain(|_, t| *t > cut);
        }
    }

    /// How many leading blocks of a prompt with these hashes were sent here before.
    pub fn prefix_blocks(&self, hashes: &[u64]) -> usize {
        let set = self.prefixes.lock().expect("prefix lock");
        hashes.iter().take_while(|h| set.contains_key(h)).count()
    }
}

/// Chained hashes of a prompt's whole blocks: hash i covers tokens [0, (i + 1) × block), so
/// equal hashes mean equal prefixes.
pub fn block_hashes(prompt: &[u32]) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    let mut out = Vec::with_capacity(prompt.len() / AFFINITY_BLOCK);
    let mut prev = 0u64;
    for block in prompt.chunks_exact(AFFINITY_BLOCK) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        prev.hash(&mut h);
        block.hash(&mut h);
        prev = h.finish();
        out.push(prev);
    }
    out
}

/// Load a request places on a worker, taken back when dropped.
pub struct Hold {
    worker: Arc<Worker>,
    tokens: u64,
    sequences: u64,
    blocks: u64,
}

impl Hold {
    /// Counts `tokens` of prefill, or `sequences` and `blocks` of decode, on `worker`.
    pub fn new(worker: &Arc<Worker>, tokens: u64, sequences: u64, blocks: u64) -> Self {
        worker.prefill_tokens.fetch_add(tokens, Ordering::Relaxed);
        worker.sequences.fetch_add(sequences, Ordering::Relaxed);
        worker.blocks.fetch_add(blocks, Ordering::Relaxed);
        Self {
            worker: Arc::clone(worker),
            tokens,
            sequences,
            blocks,
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let w = &self.worker;
        w.prefill_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        w.sequences.fetch_sub(self.sequences, Ordering::Relaxed);
        w.blocks.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// The pool settings the unit tests use: no TLS, a short connect timeout.
#[cfg(test)]
pub(crate) fn test_settings(failures: u32, cooldown_ms: u64) -> PoolSettings {
    PoolSettings {
        dialer: runtime::Dialer {
            connect_timeout: Duration::from_millis(100),
            tls: None,
            max_message: runtime::DEFAULT_MAX_MESSAGE,
            max_age: tls::MAX_CONNECTION_AGE,
        },
        breaker_failures: failures,
        breaker_cooldown: Duration::from_millis(cooldown_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy(addr: &str, s: &PoolSettings) -> Worker {
        Worker::new_for_tests(addr, s)
    }

    #[tokio::test]
    async fn the_breaker_opens_after_repeated_failures_and_lets_a_trial_through_later() {
        let s = test_settings(3, 50);
        let w = healthy("127.0.0.1:1", &s);
        w.failed(&s);
        w.failed(&s);
        assert_eq!(
            w.state(),
            State::Ready,
            "two failures stay under the threshold"
        );
        w.failed(&s);
        assert_eq!(w.state(), State::Open);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            w.state(),
            State::Ready,
            "half open once the cooldown has passed"
        );
        w.failed(&s);
        assert_eq!(w.state(), State::Open, "one failed trial opens it again");
        assert_eq!(
            w.breaker.lock().unwrap().cooldown,
            Duration::from_millis(100),
            "for twice as long"
        );
        w.succeeded(&s);
        assert_eq!(w.state(), State::Ready);
        w.failed(&s);
        assert_eq!(w.state(), State::Ready, "a success starts the count again");
    }

    #[tokio::test]
    async fn a_success_between_failures_keeps_the_breaker_shut() {
        let s = test_settings(2, 1000);
        let w = healthy("127.0.0.1:1", &s);
        for _ in 0..5 {
            w.failed(&s);
            w.succeeded(&s);
        }
        assert_eq!(w.state(), State::Ready);
    }

    #[test]
    fn a_health_reply_is_checked_against_what_the_router_serves() {
        let expected = Expected {
            model: "m".into(),
            layout: discovery::Layout {
                n_layers: 2,
                n_kv_heads: 2,
                head_dim: 8,
                dtype: "f32".into(),
            },
            engine_version: "1".into(),
        };
        let good = HealthReply {
            role: "decode".into(),
            model: "m".into(),
            engine_version: "1".into(),
            layout: Some(proto::v1::KvLayout {
                n_layers: 2,
                n_kv_heads: 2,
                head_dim: 8,
                dtype: "f32".into(),
            }),
            ..HealthReply::default()
        };
        assert_eq!(incompatibility(&good, Role::Decode, &expected), None);
        let why = |f: fn(&mut HealthReply)| {
            let mut r = good.clone();
            f(&mut r);
            incompatibility(&r, Role::Decode, &expected).unwrap_or_default()
        };
        assert!(why(|r| r.role = "prefill".into()).starts_with("role"));
        assert!(why(|r| r.model = "other".into()).starts_with("model"));
        // A worker too old to say which model or engine it runs is not paired.
        assert!(why(|r| r.model.clear()).starts_with("model"));
        assert!(why(|r| r.engine_version = "2".into()).starts_with("engine"));
        assert!(why(|r| r.layout.as_mut().unwrap().n_layers = 3).starts_with("KV layout"));
        assert!(why(|r| r.layout = None).starts_with("KV layout"));
        assert_eq!(
            incompatibility(&good, Role::Prefill, &expected).map(|w| w.starts_with("role")),
            Some(true)
        );
    }

    #[tokio::test]
    async fn states_follow_probes_and_registrations() {
        let s = test_settings(3, 1000);
        let w = Worker::new("w".into(), "127.0.0.1:1", None, &s).unwrap();
        assert_eq!(
            w.state(),
            State::Unhealthy,
            "never routed to before a probe"
        );
        w.probe.lock().unwrap().ok = true;
        w.probe.lock().unwrap().draining = true;
        assert_eq!(w.state(), State::Draining);
        let other = Worker::new("w".into(), "127.0.0.1:1", Some("model x".into()), &s).unwrap();
        other.probe.lock().unwrap().ok = true;
        assert_eq!(other.state(), State::Incompatible);
    }

    #[test]
    fn block_hashes_chain_whole_blocks() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (block_hashes(&a), block_hashes(&b));
        assert_eq!(ha.len(), 2, "only whole blocks of {AFFINITY_BLOCK}");
        assert_eq!(ha[0], hb[0], "same first block");
        assert_ne!(
            ha[1], hb[1],
            "the second differs, and so every hash after it"
        );
    }
}
