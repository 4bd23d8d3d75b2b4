//! The decode nodes a prefill node sends KV caches to: those configured (`--decode-nodes`)
//! and those registered in etcd as decode workers, or registered until a little while ago
//! (a draining decode node deregisters first, then still takes the transfers of the
//! requests it admitted). A request names its decode node, but the prefill node dials it
//! only if it is one of these: a request alone never makes it connect to an address.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use discovery::{Role, WorkerSet};
use tokio::sync::watch;

use crate::error::PrefillError;

/// How long a request waits for etcd to show a decode node it names: the router may have
/// seen its registration a moment before this node did.
const CATCH_UP: Duration = Duration::from_secs(2);
/// How long a decode node that left etcd stays a target: longer than a drain (30 s by
/// default) and the prompt queue it may wait behind.
const LINGER: Duration = Duration::from_secs(600);

/// Decode nodes that left etcd, and when this node saw them go.
type Departed = Arc<Mutex<HashMap<String, Instant>>>;

/// The decode nodes this prefill node may send to.
#[derive(Debug, Clone)]
pub struct DecodeTargets {
    listed: Arc<HashSet<String>>,
    registered: Option<watch::Receiver<WorkerSet>>,
    departed: Departed,
    /// How long a departed node stays a target ([`LINGER`]).
    linger: Duration,
}

/// The decode workers' addresses in `set`.
fn decoders(set: &WorkerSet) -> HashSet<String> {
    set.workers
        .values()
        .filter(|w| w.role == Role::Decode)
        .map(|w| w.addr.clone())
        .collect()
}

/// Notes when each decode worker leaves `rx`'s set, forgetting departures past
/// [`LINGER`], until the set's sender is gone.
async fn follow_departures(mut rx: watch::Receiver<WorkerSet>, departed: Departed) {
    let mut seen = decoders(&rx.borrow_and_update());
    while rx.changed().await.is_ok() {
        let now = decoders(&rx.borrow_and_update());
        let mut gone = departed.lock().expect("departures lock");
        for addr in seen.difference(&now) {
            gone.insert(addr.clone(), Instant::now());
        }
        for addr in &now {
            gone.remove(addr);
        }
        gone.retain(|_, at| at.elapsed() < LINGER);
        seen = now;
    }
}

impl DecodeTargets {
    /// The nodes in `listed`, and with `registered` those etcd shows as decode workers
    /// (followed from a task of its own, so call it within a tokio runtime).
    pub fn new(listed: &[String], registered: Option<watch::Receiver<WorkerSet>>) -> Self {
        let departed = Departed::default();
        if let Some(rx) = &registered {
            tokio::spawn(follow_departures(rx.clone(), Arc::clone(&departed)));
        }
        Self {
            listed: Arc::new(listed.iter().cloned().collect()),
            registered,
            departed,
            linger: LINGER,
        }
    }

    /// Whether neither a list nor etcd names any node: then every request is refused.
    pub fn is_unconfigured(&self) -> bool {
        self.listed.is_empty() && self.registered.is_none()
    }

    fn registered_now(set: &WorkerSet, addr: &str) -> bool {
        set.workers
            .values()
            .any(|w| w.role == Role::Decode && w.addr == addr)
    }

    /// Checks that `addr` is a decode node this node knows, waiting briefly for etcd to
    /// catch up with a node the router has just seen.
    pub async fn check(&self, addr: &str) -> Result<(), PrefillError> {
        if addr.is_empty() {
            return Err(PrefillError::NoDecodeAddr);
        }
        let lately = |addr: &str| {
            let gone = self.departed.lock().expect("departures lock");
            gone.get(addr).is_some_and(|at| at.elapsed() < self.linger)
        };
        if self.listed.contains(addr) || lately(addr) {
            return Ok(());
        }
        let unknown = || PrefillError::UnknownDecode(addr.to_string());
        let Some(registered) = &self.registered else {
            return Err(unknown());
        };
        let mut rx = registered.clone();
        if Self::registered_now(&rx.borrow_and_update(), addr) {
            return Ok(());
        }
        let seen = tokio::time::timeout(CATCH_UP, async {
            rx.wait_for(|set| Self::registered_now(set, addr))
                .await
                .is_ok()
        })
        .await;
        match seen {
            Ok(true) => Ok(()),
            _ => Err(unknown()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn worker(role: Role, addr: &str) -> discovery::Member {
        discovery::Member {
            role,
            addr: addr.into(),
            name: String::new(),
            registration: None,
        }
    }

    fn set(workers: &[discovery::Member]) -> WorkerSet {
        WorkerSet {
            workers: workers
                .iter()
                .map(|w| (format!("/p/{}/{}", w.role.as_str(), w.addr), w.clone()))
                .collect::<BTreeMap<_, _>>(),
            degraded: false,
            synced: true,
        }
    }

    #[tokio::test]
    async fn only_listed_or_registered_decode_nodes_are_dialed() {
        let listed = DecodeTargets::new(&["10.0.0.1:50052".into()], None);
        assert!(listed.check("10.0.0.1:50052").await.is_ok());
        for other in ["10.0.0.2:50052", "169.254.169.254:80", "10.0.0.1:50053"] {
            assert!(
                matches!(
                    listed.check(other).await,
                    Err(PrefillError::UnknownDecode(_))
                ),
                "{other}"
            );
        }
        assert!(matches!(
            listed.check("").await,
            Err(PrefillError::NoDecodeAddr)
        ));

        let (tx, rx) = watch::channel(set(&[
            worker(Role::Decode, "d:1"),
            worker(Role::Prefill, "p:1"),
        ]));
        let registered = DecodeTargets::new(&[], Some(rx));
        assert!(registered.check("d:1").await.is_ok());
        assert!(
            registered.check("p:1").await.is_err(),
            "a prefill node is no decode target"
        );
        // A decode node the router saw first is taken once etcd shows it here too.
        let late = {
            let t = registered.clone();
            tokio::spawn(async move { t.check("d:2").await })
        };
        tx.send_replace(set(&[
            worker(Role::Decode, "d:1"),
            worker(Role::Decode, "d:2"),
        ]));
        assert!(late.await.unwrap().is_ok());
        // One that deregisters (a drain) still takes the transfers of what it admitted.
        tx.send_replace(set(&[worker(Role::Decode, "d:2")]));
        while registered.departed.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        assert!(registered.check("d:1").await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_node_is_refused_after_a_short_wait() {
        let (_tx, rx) = watch::channel(set(&[worker(Role::Decode, "d:1")]));
        let t = DecodeTargets::new(&[], Some(rx));
        let started = tokio::time::Instant::now();
        assert!(matches!(
            t.check("evil:1").await,
            Err(PrefillError::UnknownDecode(_))
        ));
        assert_eq!(started.elapsed(), CATCH_UP);
    }

    #[test]
    fn a_departed_node_is_forgotten_after_its_linger() {
        let departed = Departed::default();
        let mut t = DecodeTargets {
            listed: Arc::default(),
            registered: None,
            departed: Arc::clone(&departed),
            linger: Duration::from_secs(3600),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        departed
            .lock()
            .unwrap()
            .insert("old:1".into(), Instant::now());
        assert!(rt.block_on(t.check("old:1")).is_ok(), "within its linger");
        t.linger = Duration::ZERO;
        assert!(rt.block_on(t.check("old:1")).is_err(), "past its linger");
    }
}
