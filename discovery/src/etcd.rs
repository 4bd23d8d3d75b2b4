//! A small etcd v3 client over tonic: ranges, puts, deletes, leases and a watch stream,
//! trying the configured endpoints in turn when one fails.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;

use crate::pb;
use crate::pb::auth_client::AuthClient;
use crate::pb::kv_client::KvClient;
use crate::pb::lease_client::LeaseClient;
use crate::pb::watch_client::WatchClient;

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
    Status(#[from] tonic::Status),
    #[error("etcd refused the lease: {0}")]
    Lease(String),
    #[error("etcd ended the stream")]
    StreamEnded,
    #[error("etcd refused the user {0}: {1}")]
    Auth(String, String),
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

/// Channels to etcd's members; calls go to one, and move on to the next when it fails.
pub struct EtcdClient {
    endpoints: Vec<(String, Channel)>,
    current: AtomicUsize,
    user: Option<(String, Password)>,
    /// The auth token every call carries while it is valid.
    token: Mutex<Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>>,
}

impl EtcdClient {
    /// Lazily connected channels to `endpoints` (host:port or URLs); nothing connects until
    /// the first call.
    pub fn new(endpoints: &[String], security: &EtcdSecurity) -> Result<Self, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let endpoints = endpoints
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
                Ok((e.clone(), channel))
            })
            .collect::<Result<_, EtcdError>>()?;
        Ok(Self {
            endpoints,
            current: AtomicUsize::new(0),
            user: security.user.clone(),
            token: Mutex::default(),
        })
    }

    /// `msg` as a request carrying the auth token, authenticating first when there is
    /// none yet (or the last one was refused).
    async fn request<T>(&self, msg: T) -> Result<tonic::Request<T>, EtcdError> {
        let mut req = tonic::Request::new(msg);
        let Some((name, password)) = &self.user else {
            return Ok(req);
        };
        let held = self.token.lock().expect("token lock").clone();
        let token = match held {
            Some(t) => t,
            None => {
                let mut auth = AuthClient::new(self.channel());
                let call = auth.authenticate(pb::AuthenticateRequest {
                    name: name.clone(),
                    password: password.0.clone(),
                });
                let resp = match tokio::time::timeout(CALL_TIMEOUT, call).await {
                    Ok(Ok(r)) => r.into_inner(),
                    Ok(Err(s)) if s.code() == tonic::Code::InvalidArgument => {
                        return Err(EtcdError::Auth(name.clone(), s.message().to_string()))
                    }
                    Ok(Err(s)) => {
                        self.failed();
                        return Err(s.into());
                    }
                    Err(_) => {
                        self.failed();
                        return Err(EtcdError::Timeout(CALL_TIMEOUT));
                    }
                };
                let t = resp.token.parse().map_err(|_| {
                    EtcdError::Auth(name.clone(), "the token is not valid metadata".into())
                })?;
                *self.token.lock().expect("token lock") = Some(Clone::clone(&t));
                t
            }
        };
        req.metadata_mut().insert("token", token);
        Ok(req)
    }

    fn channel(&self) -> Channel {
        let i = self.current.load(Ordering::Relaxed) % self.endpoints.len();
        self.endpoints[i].1.clone()
    }

    /// Notes that the current member failed, so the next call tries another.
    fn failed(&self) {
        if self.endpoints.len() > 1 {
            let i = self.current.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::debug!(next = %self.endpoints[i % self.endpoints.len()].0, "etcd member failed; trying the next");
        }
    }

    /// Runs one unary call with a timeout, rotating members on failure.
    async fn call<T, F>(&self, f: F) -> Result<T, EtcdError>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(CALL_TIMEOUT, f).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => {
                if s.code() == tonic::Code::Unauthenticated {
                    // An expired or revoked token: the next call authenticates again.
                    *self.token.lock().expect("token lock") = None;
                } else {
                    self.failed();
                }
                Err(s.into())
            }
            Err(_) => {
                self.failed();
                Err(EtcdError::Timeout(CALL_TIMEOUT))
            }
        }
    }

    /// Every key under `prefix`, with the store's revision at the time of the read.
    pub async fn range_prefix(&self, prefix: &str) -> Result<(i64, Vec<pb::KeyValue>), EtcdError> {
        let req = pb::RangeRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: crate::prefix_end(prefix.as_bytes()),
            ..Default::default()
        };
        let mut kv = KvClient::new(self.channel());
        let resp = self.call(kv.range(self.request(req).await?)).await?;
        let revision = resp.header.map_or(0, |h| h.revision);
        Ok((revision, resp.kvs))
    }

    /// Stores `value` under `key`, tied to `lease` (0: none).
    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let req = pb::PutRequest {
            key: key.as_bytes().to_vec(),
            value: value.to_vec(),
            lease,
        };
        let mut kv = KvClient::new(self.channel());
        self.call(kv.put(self.request(req).await?)).await.map(drop)
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) -> Result<(), EtcdError> {
        let req = pb::DeleteRangeRequest {
            key: key.as_bytes().to_vec(),
            range_end: Vec::new(),
        };
        let mut kv = KvClient::new(self.channel());
        self.call(kv.delete_range(self.request(req).await?))
            .await
            .map(drop)
    }

    /// A new lease of `ttl` seconds; returns its id.
    pub async fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let mut lease = LeaseClient::new(self.channel());
        let resp = self
            .call(lease.lease_grant(self.request(pb::LeaseGrantRequest { ttl, id: 0 }).await?))
            .await?;
        if !resp.error.is_empty() {
            return Err(EtcdError::Lease(resp.error));
        }
        Ok(resp.id)
    }

    /// Revokes lease `id`, deleting every key tied to it.
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        let mut lease = LeaseClient::new(self.channel());
        self.call(lease.lease_revoke(self.request(pb::LeaseRevokeRequest { id }).await?))
            .await
            .map(drop)
    }

    /// Opens a keep-alive stream for lease `id`, renewing it once: each message sent on the
    /// returned sender renews it again, and each reply carries its remaining TTL (0 or
    /// less: the lease is gone).
    pub async fn keep_alive(
        &self,
        id: i64,
    ) -> Result<
        (
            mpsc::Sender<pb::LeaseKeepAliveRequest>,
            Streaming<pb::LeaseKeepAliveResponse>,
        ),
        EtcdError,
    > {
        let (tx, rx) = mpsc::channel(4);
        // etcd answers the call only once it has a request to answer.
        tx.send(pb::LeaseKeepAliveRequest { id })
            .await
            .expect("the receiver is held below");
        let mut lease = LeaseClient::new(self.channel());
        let stream = self
            .call(lease.lease_keep_alive(self.request(ReceiverStream::new(rx)).await?))
            .await?;
        Ok((tx, stream))
    }

    /// Watches every key under `prefix` from `revision` on. The sender must be kept: dropping
    /// it ends the watch.
    pub async fn watch_prefix(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<(mpsc::Sender<pb::WatchRequest>, Streaming<pb::WatchResponse>), EtcdError> {
        let (tx, rx) = mpsc::channel(1);
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                pb::WatchCreateRequest {
                    key: prefix.as_bytes().to_vec(),
                    range_end: crate::prefix_end(prefix.as_bytes()),
                    start_revision: revision,
                },
            )),
        };
        tx.send(create).await.expect("the receiver is held below");
        let mut watch = WatchClient::new(self.channel());
        let stream = self
            .call(watch.watch(self.request(ReceiverStream::new(rx)).await?))
            .await?;
        Ok((tx, stream))
    }
}
