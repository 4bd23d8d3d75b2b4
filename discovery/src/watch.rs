//! The router's view of the registered workers: a full listing, then a watch from the
//! listing's revision, listed again every so often so that a missed event cannot leave a
//! stale worker behind. When etcd cannot be reached the last set is kept and marked
//! degraded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::etcd::{EtcdClient, EtcdError};
use crate::{Member, WorkerInfo};
use etcd_client::EventType;

/// How long the watcher first waits before trying etcd again after a failure or a
/// cancelled watch; each failure in a row doubles it, up to [`RETRY_MAX`].
const RETRY: Duration = Duration::from_millis(500);
/// See [`RETRY`].
const RETRY_MAX: Duration = Duration::from_secs(10);

/// The wait before the next try: doubles with each failure in a row, back to the first
/// once a watch has followed etcd to the end of its period.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Self { next: RETRY }
    }

    /// The wait after one more failure.
    fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(RETRY_MAX);
        wait
    }

    fn succeeded(&mut self) {
        self.next = RETRY;
    }
}

/// How one period of following etcd ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The re-list period is over (or nobody listens any more).
    Period,
    /// etcd cancelled the watch (compacted past its revision, or refused it).
    Cancelled,
}

/// The discovered workers as last seen, by key (the etcd key, or the Kubernetes
/// endpoint's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerSet {
    pub workers: BTreeMap<String, Member>,
    /// True while the source (etcd, the Kubernetes API) cannot be reached: `workers` is the
    /// last set seen.
    pub degraded: bool,
    /// True once the source has been listed at least once.
    pub synced: bool,
}

/// Follows the workers registered under `prefix`, publishing each change on `tx`, until
/// every receiver is gone. `relist` bounds how long a missed event can go unnoticed.
pub async fn watch_workers(
    client: Arc<EtcdClient>,
    prefix: String,
    relist: Duration,
    tx: watch::Sender<WorkerSet>,
) {
    let mut backoff = Backoff::new();
    loop {
        let result = follow(&client, &prefix, relist, &tx).await;
        if tx.is_closed() {
            return;
        }
        // A watch that etcd cancels at once every time (it refuses it, or a proxy ends it)
        // would otherwise list and watch again in a tight loop.
        let wait = match result {
            Ok(Ended::Period) => {
                backoff.succeeded();
                continue;
            }
            Ok(Ended::Cancelled) => backoff.failed(),
            Err(e) => {
                tx.send_if_modified(|set| !std::mem::replace(&mut set.degraded, true));
                tracing::warn!(error = %e, "etcd unreachable; routing to the last known workers");
                backoff.failed()
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = tx.closed() => return,
        }
    }
}

/// Lists, then applies watch events until the re-list period ends, etcd cancels the
/// watch, or etcd fails.
async fn follow(
    client: &EtcdClient,
    prefix: &str,
    relist: Duration,
    tx: &watch::Sender<WorkerSet>,
) -> Result<Ended, EtcdError> {
    let (revision, kvs) = client.range_prefix(prefix).await?;
    let mut workers = BTreeMap::new();
    for (key, value) in kvs {
        if let Some((key, info)) = parse(&key, &value) {
            workers.insert(key, Member::from(info));
        }
    }
    resync(tx, workers, |was, _| {
        if was.degraded {
            tracing::info!("etcd reachable again; worker set resynced");
        }
    });
    let mut stream = client.watch_prefix(prefix, revision + 1).await?;
    let deadline = tokio::time::Instant::now() + relist;
    loop {
        let msg = tokio::select! {
            m = stream.message() => m?.ok_or(EtcdError::StreamEnded)?,
            _ = tokio::time::sleep_until(deadline) => return Ok(Ended::Period),
            _ = tx.closed() => return Ok(Ended::Period),
        };
        if msg.canceled() {
            // Compacted past our revision, or refused: a fresh listing catches up.
            tracing::info!(reason = %msg.cancel_reason(), "etcd cancelled the watch; listing again");
            return Ok(Ended::Cancelled);
        }
        if msg.events().is_empty() {
            continue;
        }
        tx.send_modify(|set| {
            for ev in msg.events() {
                let Some(kv) = ev.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                if ev.event_type() == EventType::Delete {
                    if set.workers.remove(&key).is_some() {
                        tracing::info!(%key, "worker left");
                    }
                } else if let Some((key, info)) = parse(kv.key(), kv.value()) {
                    if set.workers.insert(key.clone(), info.into()).is_none() {
                        tracing::info!(%key, "worker joined");
                    }
                } else {
                    set.workers.remove(&key);
                }
            }
        });
    }
}

/// Makes `workers`, a whole listing, the set on `tx` (synced, not degraded), calling
/// `changed` with the set before and after when it differs.
pub(crate) fn resync(
    tx: &watch::Sender<WorkerSet>,
    workers: BTreeMap<String, Member>,
    changed: impl FnOnce(&WorkerSet, &WorkerSet),
) {
    tx.send_if_modified(|set| {
        let next = WorkerSet {
            workers,
            degraded: false,
            synced: true,
        };
        if *set == next {
            return false;
        }
        changed(set, &next);
        *set = next;
        true
    });
}

/// A registration, or None (logged) when the value is not one.
fn parse(key: &[u8], value: &[u8]) -> Option<(String, WorkerInfo)> {
    let key = String::from_utf8_lossy(key).into_owned();
    match serde_json::from_slice(value) {
        Ok(info) => Some((key, info)),
        Err(e) => {
            tracing::warn!(%key, error = %e, "ignoring a registration that does not parse");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_wait_longer_up_to_a_limit() {
        let mut b = Backoff::new();
        let waits: Vec<u128> = (0..7).map(|_| b.failed().as_millis()).collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 8000, 10000, 10000]);
        b.succeeded();
        assert_eq!(b.failed(), RETRY);
    }
}
