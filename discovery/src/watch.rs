//! The router's view of the registered workers: a full listing, then a watch from the
//! listing's revision, listed again every so often so that a missed event cannot leave a
//! stale worker behind. When etcd cannot be reached the last set is kept and marked
//! degraded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::etcd::{EtcdClient, EtcdError};
use crate::pb::event::EventType;
use crate::WorkerInfo;

/// How long the watcher waits before trying etcd again after a failure.
const RETRY: Duration = Duration::from_millis(500);

/// The registered workers as last seen, by key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerSet {
    pub workers: BTreeMap<String, WorkerInfo>,
    /// True while etcd cannot be reached: `workers` is the last set seen.
    pub degraded: bool,
    /// True once etcd has been listed at least once.
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
    loop {
        let result = follow(&client, &prefix, relist, &tx).await;
        if tx.is_closed() {
            return;
        }
        if let Err(e) = result {
            tx.send_if_modified(|set| !std::mem::replace(&mut set.degraded, true));
            tracing::warn!(error = %e, "etcd unreachable; routing to the last known workers");
            tokio::time::sleep(RETRY).await;
        }
    }
}

/// Lists, then applies watch events until the re-list period ends (Ok) or etcd fails.
async fn follow(
    client: &EtcdClient,
    prefix: &str,
    relist: Duration,
    tx: &watch::Sender<WorkerSet>,
) -> Result<(), EtcdError> {
    let (revision, kvs) = client.range_prefix(prefix).await?;
    let mut workers = BTreeMap::new();
    for kv in kvs {
        if let Some((key, info)) = parse(&kv.key, &kv.value) {
            workers.insert(key, info);
        }
    }
    tx.send_if_modified(|set| {
        let next = WorkerSet {
            workers,
            degraded: false,
            synced: true,
        };
        if *set == next {
            return false;
        }
        if set.degraded {
            tracing::info!("etcd reachable again; worker set resynced");
        }
        *set = next;
        true
    });
    let (_keep, mut stream) = client.watch_prefix(prefix, revision + 1).await?;
    let deadline = tokio::time::Instant::now() + relist;
    loop {
        let msg = tokio::select! {
            m = stream.message() => m?.ok_or(EtcdError::StreamEnded)?,
            _ = tokio::time::sleep_until(deadline) => return Ok(()),
            _ = tx.closed() => return Ok(()),
        };
        if msg.canceled {
            // Compacted past our revision, or refused: a fresh listing catches up.
            tracing::info!(reason = %msg.cancel_reason, "etcd cancelled the watch; listing again");
            return Ok(());
        }
        if msg.events.is_empty() {
            continue;
        }
        tx.send_modify(|set| {
            for ev in msg.events {
                let Some(kv) = ev.kv else { continue };
                let key = String::from_utf8_lossy(&kv.key).into_owned();
                if ev.r#type == EventType::Delete as i32 {
                    if set.workers.remove(&key).is_some() {
                        tracing::info!(%key, "worker left");
                    }
                } else if let Some((key, info)) = parse(&kv.key, &kv.value) {
                    if set.workers.insert(key.clone(), info).is_none() {
                        tracing::info!(%key, "worker joined");
                    }
                } else {
                    set.workers.remove(&key);
                }
            }
        });
    }
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
