//! The etcd calls discovery makes, through `etcd-client` with one client per member: ranges,
//! puts, deletes, leases and a watch, each under a timeout, trying the next member when one
//! fails.
//!
//! `etcd-client` balances over its members itself, but only with tonic's own TLS, which loads
//! the certificates once. Each member's channel here goes through `tls::Connector` instead, which
//! takes rotated certificate files without a restart (as every other hop in the cluster does),
//! so the members are kept in a list of our own and rotated on failure.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper, WatchOptions,
    WatchStream,
};
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint};

/// How long one unary call to etcd may take; a hung member must not hang a worker.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd endpoint is configured")]
    NoEndpoints,
    #[error("bad etcd endpoint {0}: {1}")]
    BadEndpoint(String, String),
    #[error("etcd call timed out after {0:?}")]
    Timeout(Duration),
    #[error("etcd: {0}")]
    Client(#[from] etcd_client::Error),
    #[error("etcd refused the lease: {0}")]
    Lease(String),
    #[error("etcd ended the stream")]
    StreamEnded,
    #[error("etcd refused the user {0}: {1}")]
    Auth(String, String),
}

impl EtcdError {
    /// The gRPC status etcd answered with, if it answered.
    fn code(&self) -> Option<tonic::Code> {
        match self {
            EtcdError::Client(etcd_client::Error::GRpcStatus(s)) => Some(s.code()),
            _ => None,
        }
    }
}

/// A password, kept out of `Debug` output and so out of logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(pub String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// How to reach a secured etcd: TLS (with a client certificate when etcd asks for one)
/// and etcd's own user authentication.
#[derive(Debug, Clone, Default)]
pub struct EtcdSecurity {
    /// TLS to every member.
    pub tls: Option<tls::ClientTls>,
    /// The user and password to authenticate as.
    pub user: Option<(String, Password)>,
}

/// One etcd member: its channel, and a client on it once one has authenticated.
struct Member {
    endpoint: String,
    channel: Channel,
    client: Mutex<Option<Client>>,
}

/// Clients of etcd's members; calls go to one, and move on to the next when it fails.
pub struct EtcdClient {
    members: Vec<Member>,
    current: AtomicUsize,
    user: Option<(String, Password)>,
}

impl EtcdClient {
    /// Lazily connected channels to `endpoints` (host:port or URLs); nothing connects until
    /// the first call.
    pub fn new(endpoints: &[String], security: &EtcdSecurity) -> Result<Self, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let members = endpoints
            .iter()
            .map(|e| {
                let hostport = e.split_once("://").map_or(e.as_str(), |(_, rest)| rest);
                // With TLS the connector does the handshake under an http URI.
                let url = match (&security.tls, e.contains("://")) {
                    (None, true) => e.clone(),
                    _ => format!("http://{hostport}"),
                };
                let endpoint = Endpoint::from_shared(url)
                    .map_err(|err| EtcdError::BadEndpoint(e.clone(), err.to_string()))?
                    .connect_timeout(Duration::from_secs(2))
                    // A member that stops answering (paused, partitioned) breaks its streams
                    // within seconds instead of never. etcd closes connections that ping more
                    // often than every 5 s (--grpc-keepalive-min-time).
                    .http2_keep_alive_interval(Duration::from_secs(6))
                    .keep_alive_timeout(Duration::from_secs(3))
                    .keep_alive_while_idle(true)
                    .tcp_nodelay(true);
                let channel = match &security.tls {
                    Some(t) => endpoint.connect_with_connector_lazy(tls::Connector::new(t.clone())),
                    None => endpoint.connect_lazy(),
                };
                Ok(Member {
                    endpoint: e.clone(),
                    channel,
                    client: Mutex::default(),
                })
            })
            .collect::<Result<_, EtcdError>>()?;
        Ok(Self {
            members,
            current: AtomicUsize::new(0),
            user: security.user.clone(),
        })
    }

    fn member(&self) -> &Member {
        &self.members[self.current.load(Ordering::Relaxed) % self.members.len()]
    }

    /// The current member's client, authenticating first when there is none yet (or the
    /// last token was refused).
    async fn client(&self) -> Result<Client, EtcdError> {
        let member = self.member();
        let mut held = member.client.lock().await;
        if let Some(c) = held.as_ref() {
            return Ok(c.clone());
        }
        let options = self
            .user
            .as_ref()
            .map(|(name, password)| ConnectOptions::new().with_user(name, &password.0));
        let channel = etcd_client::Channel::Tonic(member.channel.clone());
        let connected = Client::from_channel(channel, options);
        let client = match tokio::time::timeout(CALL_TIMEOUT, connected).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                let e = EtcdError::from(e);
                return Err(match (e.code(), &self.user) {
                    (Some(tonic::Code::InvalidArgument), Some((name, _))) => {
                        EtcdError::Auth(name.clone(), e.to_string())
                    }
                    _ => {
                        self.failed();
                        e
                    }
                });
            }
            Err(_) => {
                self.failed();
                return Err(EtcdError::Timeout(CALL_TIMEOUT));
            }
        };
        *held = Some(client.clone());
        Ok(client)
    }

    /// Notes that the current member failed, so the next call tries another.
    fn failed(&self) {
        if self.members.len() > 1 {
            let i = self.current.fetch_add(1, Ordering::Relaxed) + 1;
            let next = &self.members[i % self.members.len()].endpoint;
            tracing::debug!(%next, "etcd member failed; trying the next");
        }
    }

    /// Runs one call on the current member's client with a timeout, rotating members on
    /// failure.
    async fn call<T, F, Fut>(&self, f: F) -> Result<T, EtcdError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let client = self.client().await?;
        match tokio::time::timeout(CALL_TIMEOUT, f(client)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => {
                match &e {
                    // An expired or revoked token: the next call authenticates again.
                    etcd_client::Error::GRpcStatus(s)
                        if s.code() == tonic::Code::Unauthenticated =>
                    {
                        *self.member().client.lock().await = None
                    }
                    // An answer about the lease, not a failing member.
                    etcd_client::Error::LeaseKeepAliveError(_) => {}
                    _ => self.failed(),
                }
                Err(e.into())
            }
            Err(_) => {
                self.failed();
                Err(EtcdError::Timeout(CALL_TIMEOUT))
            }
        }
    }

    /// Every key under `prefix` as (key, value), with the store's revision at the time of
    /// the read.
    pub async fn range_prefix(
        &self,
        prefix: &str,
    ) -> Result<(i64, Vec<(Vec<u8>, Vec<u8>)>), EtcdError> {
        let resp = self
            .call(|mut c| async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await })
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let kvs = resp
            .kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), kv.value().to_vec()))
            .collect();
        Ok((revision, kvs))
    }

    /// Stores `value` under `key`, tied to `lease` (0: none).
    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let options = etcd_client::PutOptions::new().with_lease(lease);
        self.call(|mut c| async move { c.put(key, value, Some(options)).await })
            .await
            .map(drop)
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) -> Result<(), EtcdError> {
        self.call(|mut c| async move { c.delete(key, None).await })
            .await
            .map(drop)
    }

    /// A new lease of `ttl` seconds; returns its id.
    pub async fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let resp = self
            .call(|mut c| async move { c.lease_grant(ttl, None).await })
            .await?;
        if !resp.error().is_empty() {
            return Err(EtcdError::Lease(resp.error().to_string()));
        }
        Ok(resp.id())
    }

    /// Revokes lease `id`, deleting every key tied to it.
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.call(|mut c| async move { c.lease_revoke(id).await })
            .await
            .map(drop)
    }

    /// Opens a keep-alive stream for lease `id`, renewing it once. `Ok(None)`: etcd no longer
    /// has the lease. Each `keep_alive` on the keeper renews it again, and each reply on the
    /// stream carries its remaining TTL (0 or less: the lease is gone).
    pub async fn keep_alive(
        &self,
        id: i64,
    ) -> Result<Option<(LeaseKeeper, LeaseKeepAliveStream)>, EtcdError> {
        match self
            .call(|mut c| async move { c.lease_keep_alive(id).await })
            .await
        {
            Ok(kept) => Ok(Some(kept)),
            // etcd-client's answer when the first renewal reports no TTL left.
            Err(EtcdError::Client(etcd_client::Error::LeaseKeepAliveError(_))) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Watches every key under `prefix` from `revision` on.
    pub async fn watch_prefix(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<WatchStream, EtcdError> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision);
        self.call(|mut c| async move { c.watch(prefix, Some(options)).await })
            .await
    }
}
