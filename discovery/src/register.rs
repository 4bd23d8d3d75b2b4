//! A worker's registration: its key under a lease that a background task keeps alive, and
//! puts back whenever etcd loses it (an outage longer than the TTL, a restored snapshot).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use etcd_client::{LeaseKeepAliveResponse, LeaseKeepAliveStream};

use crate::etcd::{EtcdClient, EtcdError};
use crate::WorkerInfo;

/// How long a worker waits before trying etcd again after a failure.
const RETRY: Duration = Duration::from_millis(500);
/// How long deregistering may take before the worker goes on draining without it.
const DEREGISTER_TIMEOUT: Duration = Duration::from_secs(3);

/// A live registration; `deregister` removes it.
pub struct Registration {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Registration {
    /// Starts registering `info` under `prefix` through `client` with a lease of `ttl_s`
    /// seconds, and keeps it registered until `deregister`.
    pub fn spawn(client: EtcdClient, prefix: &str, ttl_s: u64, info: WorkerInfo) -> Self {
        let client = Arc::new(client);
        let key = info.key(prefix);
        let value = serde_json::to_vec(&info).expect("a registration serializes");
        let (stop, stopped) = watch::channel(false);
        let ttl = ttl_s.max(1) as i64;
        let task = tokio::spawn(keep_registered(client, key, value, ttl, stopped));
        Self { stop, task }
    }

    /// Removes the key (revoking its lease) and stops renewing it.
    pub async fn deregister(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Registers, renews, and registers again after losing the lease, until `stopped`.
async fn keep_registered(
    client: Arc<EtcdClient>,
    key: String,
    value: Vec<u8>,
    ttl: i64,
    mut stopped: watch::Receiver<bool>,
) {
    let mut lease = None;
    // Whether the key is in etcd now, and whether this outage has been logged.
    let mut up = false;
    let mut quiet = false;
    loop {
        let held = tokio::select! {
            r = hold(&client, &key, &value, ttl, &mut lease, &mut up) => r,
            _ = stopped.wait_for(|s| *s) => break,
        };
        if std::mem::replace(&mut up, false) {
            quiet = false;
        }
        match held {
            Ok(()) => tracing::warn!(%key, "etcd dropped the lease; registering again"),
            // Said once per outage, not at every retry.
            Err(e) if !quiet => {
                quiet = true;
                tracing::warn!(%key, error = %e, "etcd registration interrupted; retrying");
            }
            Err(e) => tracing::debug!(%key, error = %e, "etcd still unreachable"),
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stopped.wait_for(|s| *s) => break,
        }
    }
    let removed = async {
        match lease {
            Some(id) => client.revoke(id).await,
            None => client.delete(&key).await,
        }
    };
    match tokio::time::timeout(DEREGISTER_TIMEOUT, removed).await {
        Ok(Ok(())) => tracing::info!(%key, "deregistered from etcd"),
        Ok(Err(e)) => {
            tracing::warn!(%key, error = %e, "deregistering failed; the lease will expire")
        }
        Err(_) => tracing::warn!(%key, "deregistering timed out; the lease will expire"),
    }
}

/// Puts the key under a lease (reusing `lease` while etcd still has it) and renews it every
/// third of the TTL. Returns Ok when etcd reports the lease gone, Err when etcd fails.
async fn hold(
    client: &EtcdClient,
    key: &str,
    value: &[u8],
    ttl: i64,
    lease: &mut Option<i64>,
    up: &mut bool,
) -> Result<(), EtcdError> {
    // After an outage the old lease may still be alive (etcd extends leases over a leader
    // change); keep it rather than leave a second copy of the key behind.
    let kept = match *lease {
        Some(id) => client.keep_alive(id).await?.map(|k| (id, k)),
        None => None,
    };
    let (id, (mut keeper, mut replies)) = match kept {
        Some(k) => k,
        None => {
            let id = client.grant(ttl).await?;
            let kept = client.keep_alive(id).await?;
            (
                id,
                kept.ok_or(EtcdError::Lease("a new lease is gone".into()))?,
            )
        }
    };
    *lease = Some(id);
    client.put(key, value, id).await?;
    *up = true;
    tracing::info!(%key, lease = id, ttl, "registered in etcd");
    let period = Duration::from_millis((ttl as u64 * 1000 / 3).max(200));
    loop {
        tokio::time::sleep(period).await;
        keeper.keep_alive().await?;
        if next_reply(&mut replies, period).await?.ttl() <= 0 {
            *lease = None;
            return Ok(());
        }
    }
}

/// The next keep-alive reply, within `limit`.
async fn next_reply(
    replies: &mut LeaseKeepAliveStream,
    limit: Duration,
) -> Result<LeaseKeepAliveResponse, EtcdError> {
    tokio::time::timeout(limit, replies.message())
        .await
        .map_err(|_| EtcdError::Timeout(limit))??
        .ok_or(EtcdError::StreamEnded)
}
