//! The prefill and decode workers the router sends requests to: static lists for now,
//! picked round-robin.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proto::v1::decode_client::DecodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::HealthRequest;
use tonic::transport::{Channel, Endpoint};

use crate::error::RouterError;

/// One worker and a lazily connected channel to it.
#[derive(Debug, Clone)]
pub struct Worker {
    pub addr: String,
    channel: Channel,
}

impl Worker {
    /// A client for a prefill node.
    pub fn prefill(&self) -> PrefillClient<Channel> {
        PrefillClient::new(self.channel.clone())
    }

    /// A client for a decode node (or colocated worker).
    pub fn decode(&self) -> DecodeClient<Channel> {
        DecodeClient::new(self.channel.clone())
    }
}

/// A list of workers of one role.
#[derive(Debug)]
pub struct Pool {
    role: &'static str,
    workers: Vec<Worker>,
    next: AtomicUsize,
}

impl Pool {
    /// Channels to `addrs`; nothing connects until the first call.
    pub fn new(
        role: &'static str,
        addrs: &[String],
        connect_timeout: Duration,
    ) -> Result<Self, RouterError> {
        let workers = addrs
            .iter()
            .map(|addr| {
                let endpoint = Endpoint::from_shared(format!("http://{addr}")).map_err(|e| {
                    RouterError::Internal(format!("bad {role} worker address {addr}: {e}"))
                })?;
                Ok(Worker {
                    addr: addr.clone(),
                    channel: endpoint
                        .connect_timeout(connect_timeout)
                        .tcp_nodelay(true)
                        .connect_lazy(),
                })
            })
            .collect::<Result<_, RouterError>>()?;
        Ok(Self {
            role,
            workers,
            next: AtomicUsize::new(0),
        })
    }

    /// The next worker in turn.
    pub fn pick(&self) -> Result<&Worker, RouterError> {
        if self.workers.is_empty() {
            return Err(RouterError::NoWorkers(self.role));
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        Ok(&self.workers[i])
    }

    /// How many workers answer a health call within `timeout`.
    pub async fn answering(&self, timeout: Duration) -> usize {
        let probes = self.workers.iter().map(|w| {
            let w = w.clone();
            let role = self.role;
            tokio::spawn(async move {
                let call = async {
                    match role {
                        "prefill" => w.prefill().health(HealthRequest {}).await.is_ok(),
                        _ => w.decode().health(HealthRequest {}).await.is_ok(),
                    }
                };
                tokio::time::timeout(timeout, call).await.unwrap_or(false)
            })
        });
        let mut n = 0;
        for p in probes.collect::<Vec<_>>() {
            if p.await.unwrap_or(false) {
                n += 1;
            }
        }
        n
    }
}
