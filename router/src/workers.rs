//! The prefill and decode workers the router sends requests to: listed statically or
//! discovered in etcd, probed for health and load, each behind a circuit breaker, and
//! chosen by a routing policy.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use discovery::{Role, WorkerInfo};
use proto::v1::decode_client::DecodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{HealthRequest, WorkerLoad};
use runtime::prom;
use runtime::Channel;

use crate::error::RouterError;
use crate::routing::Policy;

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

impl Worker {
    fn new(addr: &str, mismatch: Option<String>, s: &PoolSettings) -> Result<Self, RouterError> {
        let channel = s
            .dialer
            .channel(addr)
            .map_err(|e| RouterError::Internal(format!("bad worker address {addr}: {e}")))?;
        Ok(Self {
            addr: addr.to_string(),
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
        let w = Self::new(addr, None, s).expect("a valid address");
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

    fn breaker_open(&self) -> bool {
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
    async fn probe(&self, role: Role, expected: &Expected, timeout: Duration) {
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
                let layout = r.layout.as_ref().map(|l| discovery::Layout {
                    n_layers: l.n_layers,
                    n_kv_heads: l.n_kv_heads,
                    head_dim: l.head_dim,
                    dtype: l.dtype.clone(),
                });
                p.incompatible =
                    r.role != role.as_str() || layout.as_ref() != Some(&expected.layout);
                p.ok = true;
                p.draining = r.draining;
                p.load = r.load.unwrap_or_default();
                if p.incompatible {
                    tracing::warn!(worker = %self.addr, role = %r.role, ?layout,
                        "worker does not match this router's model; not routed to");
                }
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

/// The workers of one role, by key (`static/<addr>` or the etcd key).
pub struct Pool {
    /// The role's name in errors ("prefill", "decode" or "colocated").
    pub name: &'static str,
    role: Role,
    workers: RwLock<BTreeMap<String, Arc<Worker>>>,
    expected: Expected,
    pub settings: PoolSettings,
    policy: Arc<dyn Policy>,
    rotation: AtomicUsize,
}

impl Pool {
    /// A pool holding the static `addrs`; nothing connects until the first call.
    pub fn new(
        name: &'static str,
        role: Role,
        addrs: &[String],
        expected: Expected,
        settings: PoolSettings,
        policy: Arc<dyn Policy>,
    ) -> Result<Self, RouterError> {
        let mut workers = BTreeMap::new();
        for addr in addrs {
            let w = Worker::new(addr, None, &settings)?;
            workers.insert(format!("static/{addr}"), Arc::new(w));
        }
        Ok(Self {
            name,
            role,
            workers: RwLock::new(workers),
            expected,
            settings,
            policy,
            rotation: AtomicUsize::new(0),
        })
    }

    /// Makes the discovered workers those registered in `set` (for this pool's role);
    /// static ones stay. A worker that left keeps serving the calls it has.
    pub fn sync(&self, set: &BTreeMap<String, WorkerInfo>) {
        let mut workers = self.workers.write().expect("pool lock");
        workers.retain(|key, _| key.starts_with("static/") || set.contains_key(key));
        for (key, info) in set {
            if info.role != self.role || workers.contains_key(key) {
                continue;
            }
            let mismatch = self.mismatch(info);
            if let Some(why) = &mismatch {
                tracing::warn!(%key, %why, "registered worker is incompatible; not routed to");
            }
            match Worker::new(&info.addr, mismatch, &self.settings) {
                Ok(w) => {
                    workers.insert(key.clone(), Arc::new(w));
                }
                Err(e) => tracing::warn!(%key, error = %e, "ignoring a registration"),
            }
        }
    }

    fn mismatch(&self, info: &WorkerInfo) -> Option<String> {
        let e = &self.expected;
        if info.model != e.model {
            Some(format!("model {} (router: {})", info.model, e.model))
        } else if info.layout != e.layout {
            Some(format!(
                "KV layout {:?} (router: {:?})",
                info.layout, e.layout
            ))
        } else if info.engine_version != e.engine_version {
            Some(format!(
                "engine {} (router: {})",
                info.engine_version, e.engine_version
            ))
        } else {
            None
        }
    }

    fn all(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .expect("pool lock")
            .values()
            .cloned()
            .collect()
    }

    /// Ready workers not in `exclude`, rotated so that ties between equal loads spread.
    fn ready(&self, exclude: &[String]) -> Vec<Arc<Worker>> {
        let mut ready: Vec<_> = self
            .all()
            .into_iter()
            .filter(|w| !exclude.contains(&w.addr) && w.state() == State::Ready)
            .collect();
        if !ready.is_empty() {
            let n = self.rotation.fetch_add(1, Ordering::Relaxed) % ready.len();
            ready.rotate_left(n);
        }
        ready
    }

    /// How many workers are ready.
    pub fn ready_count(&self) -> usize {
        self.ready(&[]).len()
    }

    /// The prefill worker for `prompt`, other than those in `exclude`.
    pub fn pick_prefill(
        &self,
        exclude: &[String],
        prompt: &[u32],
    ) -> Result<Arc<Worker>, RouterError> {
        let ready = self.ready(exclude);
        if ready.is_empty() {
            return Err(RouterError::NoWorkers(self.name));
        }
        let hashes = block_hashes(prompt);
        let w = Arc::clone(&ready[self.policy.prefill(&ready, &hashes)]);
        w.remember_prefix(&hashes);
        Ok(w)
    }

    /// The decode worker for a request that needs `tokens` positions for each of
    /// `sequences` sequences, other than those in `exclude`.
    pub fn pick_decode(
        &self,
        exclude: &[String],
        tokens: usize,
        sequences: usize,
    ) -> Result<Arc<Worker>, RouterError> {
        let ready = self.ready(exclude);
        if ready.is_empty() {
            return Err(RouterError::NoWorkers(self.name));
        }
        Ok(Arc::clone(
            &ready[self.policy.decode(&ready, tokens, sequences)],
        ))
    }

    /// Probes every worker at once, each within `timeout`.
    pub async fn probe_all(&self, timeout: Duration) {
        let probes = self.all().into_iter().map(|w| {
            let role = self.role;
            let expected = self.expected.clone();
            tokio::spawn(async move { w.probe(role, &expected, timeout).await })
        });
        for p in probes.collect::<Vec<_>>() {
            let _ = p.await;
        }
    }

    /// Workers in each state, in `State::ALL` order.
    pub fn states(&self) -> [usize; 5] {
        let mut n = [0; 5];
        for w in self.all() {
            let s = w.state();
            n[State::ALL
                .iter()
                .position(|x| *x == s)
                .expect("a known state")] += 1;
        }
        n
    }

    /// Writes this pool's samples of the worker metrics (their headers come from
    /// `render_headers`).
    fn render(&self, label: &str, states: &mut String, breakers: &mut String) {
        for (state, n) in State::ALL.iter().zip(self.states()) {
            prom::sample(
                states,
                "router_workers",
                &[("role", label), ("state", state.as_str())],
                n,
            );
        }
        for w in self.all() {
            let open = u8::from(w.breaker_open());
            prom::sample(
                breakers,
                "router_breaker_open",
                &[("role", label), ("worker", &w.addr)],
                open,
            );
        }
    }
}

/// The worker metrics of the router's pools, each `(role label, pool)`.
pub fn render(pools: &[(&str, &Pool)]) -> String {
    let mut states = String::new();
    let mut breakers = String::new();
    prom::header(
        &mut states,
        "router_workers",
        "gauge",
        "Known workers by role and state (ready ones are in rotation).",
    );
    prom::header(
        &mut breakers,
        "router_breaker_open",
        "gauge",
        "1 while a worker's circuit breaker keeps it out of rotation.",
    );
    for (label, pool) in pools {
        pool.render(label, &mut states, &mut breakers);
    }
    let mut out = states;
    let _ = write!(out, "{breakers}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(failures: u32, cooldown_ms: u64) -> PoolSettings {
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

    fn healthy(addr: &str, s: &PoolSettings) -> Worker {
        Worker::new_for_tests(addr, s)
    }

    #[tokio::test]
    async fn the_breaker_opens_after_repeated_failures_and_lets_a_trial_through_later() {
        let s = settings(3, 50);
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
        let s = settings(2, 1000);
        let w = healthy("127.0.0.1:1", &s);
        for _ in 0..5 {
            w.failed(&s);
            w.succeeded(&s);
        }
        assert_eq!(w.state(), State::Ready);
    }

    #[tokio::test]
    async fn states_follow_probes_and_registrations() {
        let s = settings(3, 1000);
        let w = Worker::new("127.0.0.1:1", None, &s).unwrap();
        assert_eq!(
            w.state(),
            State::Unhealthy,
            "never routed to before a probe"
        );
        w.probe.lock().unwrap().ok = true;
        w.probe.lock().unwrap().draining = true;
        assert_eq!(w.state(), State::Draining);
        let other = Worker::new("127.0.0.1:1", Some("model x".into()), &s).unwrap();
        other.probe.lock().unwrap().ok = true;
        assert_eq!(other.state(), State::Incompatible);
    }

    fn layout(n: u32) -> discovery::Layout {
        discovery::Layout {
            n_layers: n,
            n_kv_heads: 2,
            head_dim: 8,
            dtype: "f32".into(),
        }
    }

    fn info(role: Role, addr: &str, model: &str, layers: u32, version: &str) -> WorkerInfo {
        WorkerInfo {
            role,
            addr: addr.into(),
            model: model.into(),
            layout: layout(layers),
            engine_version: version.into(),
            capacity: Default::default(),
        }
    }

    #[tokio::test]
    async fn sync_follows_registrations_and_rules_out_mismatches() {
        let expected = Expected {
            model: "m".into(),
            layout: layout(2),
            engine_version: "1".into(),
        };
        let policy = crate::routing::PolicyKind::RoundRobin.build(0);
        let pool = Pool::new(
            "decode",
            Role::Decode,
            &["127.0.0.1:9".into()],
            expected,
            settings(3, 1000),
            policy,
        )
        .unwrap();
        let mut set = BTreeMap::new();
        set.insert(
            "k/a".into(),
            info(Role::Decode, "127.0.0.1:10", "m", 2, "1"),
        );
        set.insert(
            "k/b".into(),
            info(Role::Decode, "127.0.0.1:11", "other", 2, "1"),
        );
        set.insert(
            "k/c".into(),
            info(Role::Decode, "127.0.0.1:12", "m", 3, "1"),
        );
        set.insert(
            "k/d".into(),
            info(Role::Decode, "127.0.0.1:13", "m", 2, "2"),
        );
        set.insert(
            "k/p".into(),
            info(Role::Prefill, "127.0.0.1:14", "m", 2, "1"),
        );
        pool.sync(&set);
        // The static worker and four decode registrations (not the prefill one); three of
        // them serve something else.
        assert_eq!(pool.states(), [0, 2, 0, 3, 0]);
        set.remove("k/a");
        pool.sync(&set);
        assert_eq!(pool.states(), [0, 1, 0, 3, 0], "a worker that left is gone");
        pool.sync(&BTreeMap::new());
        assert_eq!(pool.states(), [0, 1, 0, 0, 0], "static workers stay");
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
