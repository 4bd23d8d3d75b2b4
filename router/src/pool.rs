//! The prefill and decode workers the router sends requests to: listed statically or
//! discovered in etcd, probed for health and load, and chosen by a routing policy.

use std::collections::BTreeMap;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use discovery::{Member, Role};
use runtime::prom::Registry;

use crate::error::RouterError;
use crate::routing::Policy;
use crate::worker::{block_hashes, Expected, PoolSettings, State, Worker};

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
        let mut settings = settings;
        // Each worker of the pool must prove this role, not only the cluster's name.
        settings.dialer.tls = settings.dialer.tls.map(|t| t.expecting(role.certified()));
        let mut workers = BTreeMap::new();
        for (i, addr) in addrs.iter().enumerate() {
            let w = Worker::new(format!("{name}-{i}"), addr, None, &settings)?;
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

    /// Makes the discovered workers those in `set` (for this pool's role); static ones
    /// stay. A worker that left keeps serving the calls it has.
    pub fn sync(&self, set: &BTreeMap<String, Member>) {
        let mut workers = self.workers.write().expect("pool lock");
        workers.retain(|key, _| key.starts_with("static/") || set.contains_key(key));
        for (key, info) in set {
            if info.role != self.role || workers.contains_key(key) {
                continue;
            }
            let mismatch = info.registration.as_ref().and_then(|r| {
                self.expected
                    .mismatch(&r.model, &r.engine_version, Some(&r.layout))
            });
            if let Some(why) = &mismatch {
                tracing::warn!(%key, %why, "registered worker is incompatible; not routed to");
            }
            match Worker::new(label(info, key), &info.addr, mismatch, &self.settings) {
                Ok(w) => {
                    workers.insert(key.clone(), Arc::new(w));
                }
                Err(e) => tracing::warn!(%key, error = %e, "ignoring a registration"),
            }
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

    /// `Err` with why when none of the workers could ever take a request that needs `need`
    /// (see [`crate::room`]).
    pub fn fits_some(&self, need: crate::room::KvNeed) -> Result<(), crate::room::NoRoom> {
        let loads: Vec<_> = self.all().iter().map(|w| w.load()).collect();
        crate::room::fits_some(&loads, need)
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

    /// Sets this pool's worker gauges, labelled `role`.
    fn publish(&self, role: &str, r: &Registry) {
        for (state, n) in State::ALL.iter().zip(self.states()) {
            r.gauge_with(
                "router_workers",
                "Known workers by role and state (ready ones are in rotation).",
                &[("role", role), ("state", state.as_str())],
            )
            .set(n as f64);
        }
        for w in self.all() {
            r.gauge_with(
                "router_breaker_open",
                "1 while a worker's circuit breaker keeps it out of rotation.",
                &[("role", role), ("worker", &w.name)],
            )
            .set(f64::from(u8::from(w.breaker_open())));
        }
    }
}

/// The name a registered worker is labelled by: its registration's (at most 63 characters),
/// else its role and a digest of its key, which is stable and names no address.
fn label(info: &Member, key: &str) -> String {
    if !info.name.is_empty() {
        return info.name.chars().take(63).collect();
    }
    let digest = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    format!("{}-{:08x}", info.role.as_str(), digest as u32)
}

/// Sets the worker gauges of the router's pools, each `(role label, pool)`, for a render.
pub fn publish(pools: &[(&str, &Pool)], r: &Registry) {
    for (role, pool) in pools {
        pool.publish(role, r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::test_settings;
    use discovery::WorkerInfo;

    fn layout(n: u32) -> discovery::Layout {
        discovery::Layout {
            n_layers: n,
            n_kv_heads: 2,
            head_dim: 8,
            dtype: "f32".into(),
        }
    }

    fn info(role: Role, addr: &str, model: &str, layers: u32, version: &str) -> Member {
        WorkerInfo {
            role,
            addr: addr.into(),
            name: String::new(),
            model: model.into(),
            layout: layout(layers),
            engine_version: version.into(),
            capacity: Default::default(),
        }
        .into()
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
            test_settings(3, 1000),
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
        // Found in Kubernetes: an address and a name, no registration; unhealthy (never
        // routed to) until its health reply says what it serves.
        set.insert(
            "k/e".into(),
            Member {
                role: Role::Decode,
                addr: "127.0.0.1:15".into(),
                name: "decode-e".into(),
                registration: None,
            },
        );
        pool.sync(&set);
        // The static worker and five decode workers (not the prefill one); three of them
        // registered something else.
        assert_eq!(pool.states(), [0, 3, 0, 3, 0]);
        set.remove("k/a");
        pool.sync(&set);
        assert_eq!(pool.states(), [0, 2, 0, 3, 0], "a worker that left is gone");
        pool.sync(&BTreeMap::new());
        assert_eq!(pool.states(), [0, 1, 0, 0, 0], "static workers stay");
    }

    #[test]
    fn workers_are_labelled_by_name_never_by_address() {
        let mut named = info(Role::Decode, "10.1.2.3:50052", "m", 2, "1");
        named.name = "decode-7f9c".into();
        assert_eq!(
            label(&named, "/tandem/workers/decode/10.1.2.3:50052"),
            "decode-7f9c"
        );
        let unnamed = info(Role::Decode, "10.1.2.3:50052", "m", 2, "1");
        let key = "/tandem/workers/decode/10.1.2.3:50052";
        let l = label(&unnamed, key);
        assert!(l.starts_with("decode-") && !l.contains("10.1"), "{l}");
        assert_eq!(l, label(&unnamed, key), "stable");
        assert_ne!(l, label(&unnamed, "/tandem/workers/decode/10.1.2.4:50052"));
        let pool = Pool::new(
            "decode",
            Role::Decode,
            &["127.0.0.1:9".into(), "127.0.0.1:10".into()],
            Expected {
                model: "m".into(),
                layout: layout(2),
                engine_version: "1".into(),
            },
            test_settings(3, 1000),
            crate::routing::PolicyKind::RoundRobin.build(0),
        )
        .unwrap();
        let mut names: Vec<_> = pool.all().iter().map(|w| w.name.clone()).collect();
        names.sort();
        assert_eq!(names, ["decode-0", "decode-1"]);
    }
}
