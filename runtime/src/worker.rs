//! A worker's life in a cluster: registration in etcd once it serves, and on SIGTERM a
//! drain (deregister, refuse new work, finish what it holds within a grace period) before
//! the server stops.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::ServeError;

/// How often a draining worker checks whether it still holds work.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// How long the server may take to close its connections once the drain is over.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// How to reach a secured etcd; shared by the router and the workers.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EtcdArgs {
    /// PEM CA bundle etcd's certificate must chain to; with it etcd is dialed over TLS.
    #[arg(long, env = "TANDEM_ETCD_CA")]
    pub etcd_ca: Option<std::path::PathBuf>,
    /// PEM client certificate for an etcd that asks for one (--client-cert-auth).
    #[arg(long, env = "TANDEM_ETCD_CERT", requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<std::path::PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = "TANDEM_ETCD_KEY", requires_all = ["etcd_cert", "etcd_ca"])]
    pub etcd_key: Option<std::path::PathBuf>,
    /// etcd user to authenticate as (etcd's `auth enable`); the password comes from
    /// TANDEM_ETCD_PASSWORD.
    #[arg(long, env = "TANDEM_ETCD_USER", requires = "etcd_password")]
    pub etcd_user: Option<String>,
    /// Password of --etcd-user. Give it through the environment (a Kubernetes Secret):
    /// a flag shows in the process list.
    #[arg(long, env = "TANDEM_ETCD_PASSWORD", hide_env_values = true, requires = "etcd_user",
        value_parser = |s: &str| Ok::<_, String>(discovery::Password(s.to_string())))]
    pub etcd_password: Option<discovery::Password>,
}

impl EtcdArgs {
    /// A client for the etcd at `endpoints`.
    pub fn client(&self, endpoints: &[String]) -> Result<discovery::EtcdClient, ServeError> {
        if self.etcd_user.is_some() && self.etcd_ca.is_none() {
            // etcd's Authenticate call carries the password as it is: without TLS anyone on
            // the path reads it, and with it the cluster's registrations.
            return Err(ServeError::Config(
                "--etcd-user sends its password to etcd: set --etcd-ca too, so that it \
                 travels over TLS"
                    .into(),
            ));
        }
        let tls = match &self.etcd_ca {
            Some(ca) => Some(tls::ClientTls::load(
                tls::ClientFiles {
                    ca: ca.clone(),
                    identity: self.etcd_cert.clone().zip(self.etcd_key.clone()),
                    alpn: vec![b"h2".to_vec()],
                },
                None,
            )?),
            None => None,
        };
        let security = discovery::EtcdSecurity {
            tls,
            user: self.etcd_user.clone().zip(self.etcd_password.clone()),
        };
        Ok(discovery::EtcdClient::new(endpoints, &security)?)
    }
}

/// Kubernetes discovery; shared by the router and the prefill nodes (which find the decode
/// nodes they may send KV caches to).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KubeArgs {
    /// Label selector of the EndpointSlices of the workers' Services, e.g.
    /// `app.kubernetes.io/instance=tandem`: with it the workers are found through the
    /// Kubernetes API, not etcd. Each slice's `app.kubernetes.io/component` label names its
    /// pool (prefill or decode), its port named `grpc` is dialed, and only endpoints whose
    /// pod is ready are used. Needs list and watch on EndpointSlices in the namespace.
    #[arg(long, env = "TANDEM_KUBE_SELECTOR", conflicts_with = "etcd_endpoints")]
    pub kube_selector: Option<String>,
    /// Namespace of those EndpointSlices; default: the pod's own (its service account's),
    /// else the kubeconfig context's.
    #[arg(long, env = "TANDEM_KUBE_NAMESPACE", requires = "kube_selector")]
    pub kube_namespace: Option<String>,
}

impl KubeArgs {
    /// Follows the workers the selector finds, publishing them on `tx` from a task of its
    /// own, listed again whole every `relist`; false (and nothing started) without
    /// `--kube-selector`.
    pub async fn follow(
        &self,
        relist: Duration,
        tx: tokio::sync::watch::Sender<discovery::WorkerSet>,
    ) -> Result<bool, ServeError> {
        let Some(selector) = self.kube_selector.clone() else {
            return Ok(false);
        };
        let client = discovery::kube::client().await?;
        let namespace = self
            .kube_namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string());
        tracing::info!(%namespace, %selector, "following workers through Kubernetes EndpointSlices");
        tokio::spawn(discovery::kube::watch_endpoints(
            client, namespace, selector, relist, tx,
        ));
        Ok(true)
    }
}

/// Flags for discovery and draining, shared by the prefill and decode nodes.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// etcd endpoints (host:port), comma separated. With none the worker does not register
    /// and routers must list it statically.
    #[arg(long, env = "TANDEM_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of the registrations.
    #[arg(long, env = "TANDEM_ETCD_PREFIX", default_value = discovery::DEFAULT_PREFIX)]
    pub etcd_prefix: String,
    /// The address (host:port) routers and prefill nodes dial; default: the listen address.
    /// Needed when listening on 0.0.0.0 (in Kubernetes, the pod IP).
    #[arg(long, env = "TANDEM_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// The name this worker registers under, by which routers label it in their metrics
    /// (never by its address): in Kubernetes, the pod's name. Default: its role and its
    /// process id.
    #[arg(long, env = "TANDEM_WORKER_NAME")]
    pub worker_name: Option<String>,
    /// Seconds the registration outlives a worker that stops renewing it (killed, cut off).
    #[arg(long, env = "TANDEM_LEASE_TTL_S", default_value_t = 10)]
    pub lease_ttl_s: u64,
    /// Seconds a worker told to stop may take to finish the work it holds.
    #[arg(long, env = "TANDEM_DRAIN_GRACE_S", default_value_t = 30)]
    pub drain_grace_s: u64,
    /// Largest gRPC message this worker sends or accepts, in bytes. (KV data-plane chunks
    /// are bounded by the memory their ticket reserved instead: they are read straight into
    /// it.)
    #[arg(long, env = "TANDEM_GRPC_MAX_MESSAGE_BYTES", default_value_t = crate::DEFAULT_MAX_MESSAGE)]
    pub grpc_max_message_bytes: usize,
    /// Address of the operations listener: plain HTTP `/health`, `/health/ready` and
    /// `/metrics`, apart from the gRPC port and its TLS, for probes and Prometheus
    /// (default: none; the gRPC port answers `GET /metrics` as well).
    #[arg(long, env = "TANDEM_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub tls: tls::TlsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

impl ClusterArgs {
    /// The name to register as a worker of `role` (`--worker-name`).
    pub fn name(&self, role: discovery::Role) -> String {
        self.worker_name
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| format!("{}-{}", role.as_str(), std::process::id()))
    }

    /// The address to register: `--advertise-addr`, else the listen address when it is a
    /// specific one.
    pub fn advertise(&self, listen: SocketAddr) -> Result<String, ServeError> {
        match &self.advertise_addr {
            Some(a) => Ok(a.clone()),
            None if listen.ip().is_unspecified() && !self.etcd_endpoints.is_empty() => {
                Err(ServeError::Config(format!(
                    "listening on {listen}: set --advertise-addr to the address others dial"
                )))
            }
            None => Ok(listen.to_string()),
        }
    }
}

/// Refuses new work once the worker drains, and counts the calls it still serves.
#[derive(Debug, Clone, Default)]
pub struct Gate {
    draining: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
}

/// One call the worker serves; the count drops when it is dropped.
#[derive(Debug)]
pub struct Pass(Arc<AtomicUsize>);

impl Drop for Pass {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// From now on, refuse new work.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// True once the worker has been told to stop.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Admits a new piece of work, or refuses it as UNAVAILABLE while draining, so that
    /// the router retries it elsewhere.
    pub fn admit(&self) -> Result<Pass, tonic::Status> {
        if self.draining() {
            return Err(proto::error_status(
                tonic::Code::Unavailable,
                "the worker is draining and takes no new work".into(),
                proto::v1::ErrorReason::ShuttingDown,
            ));
        }
        Ok(self.track())
    }

    /// Counts work that belongs to a request already admitted (a KV transfer for a
    /// Generate call this node holds), which a drain must still accept.
    pub fn track(&self) -> Pass {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Pass(Arc::clone(&self.in_flight))
    }

    /// Calls in progress.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

/// A stream that holds a `Pass` until it is dropped (the call ended or its caller left).
pub struct Tracked<S> {
    inner: S,
    _pass: Pass,
}

impl<S> Tracked<S> {
    /// `inner`, counted as in flight while it lives.
    pub fn new(inner: S, pass: Pass) -> Self {
        Self { inner, _pass: pass }
    }
}

impl<S: tokio_stream::Stream + Unpin> tokio_stream::Stream for Tracked<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// What a worker serves on its port.
pub struct Served<R> {
    /// Its gRPC services.
    pub routes: tonic::service::Routes,
    /// The text of `GET /metrics`.
    pub render: R,
    /// A protocol beside gRPC on the same port (the KV data plane of a decode node).
    pub side: Option<crate::SideProtocol>,
}

/// Serves `served` on `listener`; registers `info` in etcd when configured; on `shutdown`
/// drains through `gate` and stops.
async fn serve_worker<R: Fn() -> String + Clone + Send + Sync + 'static>(
    listener: TcpListener,
    served: Served<R>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    args: &ClusterArgs,
    info: discovery::WorkerInfo,
    gate: Gate,
) -> Result<(), ServeError> {
    let registration = if args.etcd_endpoints.is_empty() {
        None
    } else {
        Some(discovery::Registration::spawn(
            args.etcd.client(&args.etcd_endpoints)?,
            &args.etcd_prefix,
            args.lease_ttl_s,
            info,
        ))
    };
    let grace = Duration::from_secs(args.drain_grace_s);
    // grpc.health.v1 on the gRPC port: SERVING from the start (the model is loaded),
    // NOT_SERVING from the drain on.
    let (health, health_service) = tonic_health::server::health_reporter();
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = async move {
        shutdown.await;
        gate.start_draining();
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        tracing::info!(in_flight = gate.in_flight(), "draining: no new work");
        if let Some(r) = registration {
            r.deregister().await;
        }
        let deadline = tokio::time::Instant::now() + grace;
        while gate.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        match gate.in_flight() {
            0 => tracing::info!("drained"),
            n => tracing::warn!(
                in_flight = n,
                ?grace,
                "grace period over; stopping with work in flight"
            ),
        }
        let _ = drained_tx.send(());
    };
    let server = crate::serve_grpc_with_metrics(
        listener,
        args.tls.server()?,
        served.side,
        // The workers' request services are the router's to call (the KV plane, which
        // prefill nodes use, checks its own callers).
        (
            served.routes.add_service(health_service),
            &[tls::Role::Router],
        ),
        served.render,
        drain,
    );
    tokio::pin!(server);
    // Once drained, connections get CLOSE_GRACE to close; a peer that keeps one open (or
    // stopped answering) cannot hold the process.
    tokio::select! {
        r = &mut server => return r,
        _ = drained_rx => {}
    }
    match tokio::time::timeout(CLOSE_GRACE, server).await {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("connections still open after the drain; stopping anyway");
            Ok(())
        }
    }
}

/// A worker node set up to serve: what it registers as, what it serves, and the thread
/// that runs its model.
pub struct Node<R> {
    pub role: discovery::Role,
    /// The address others dial it at ([`ClusterArgs::advertise`]).
    pub advertise: String,
    /// The model file it serves: its identity in the registration.
    pub model: std::path::PathBuf,
    pub layout: discovery::Layout,
    pub capacity: discovery::Capacity,
    pub served: Served<R>,
    pub gate: Gate,
    /// Its operations listener, told here that the node serves.
    pub ops: crate::ops::Ops,
    /// The compute thread: it ends once the server has dropped the node's services.
    pub compute: std::thread::JoinHandle<()>,
    /// Held while the server runs and dropped once it has stopped, before the compute
    /// thread is waited for: what else holds the services (a decode node's KV connections)
    /// lets go on it.
    pub until_stopped: Option<Box<dyn Send>>,
}

/// Serves `node` on `listener` as [`serve_worker`] does, then waits for its compute thread
/// to end. Both worker nodes serve through it.
pub async fn serve_node<R: Fn() -> String + Clone + Send + Sync + 'static>(
    listener: TcpListener,
    node: Node<R>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    args: &ClusterArgs,
) -> Result<(), ServeError> {
    let name = args.name(node.role);
    let info = crate::worker_info(
        node.role,
        node.advertise,
        name,
        &node.model,
        node.layout,
        node.capacity,
    );
    node.ops
        .serving(node.gate.clone(), node.served.render.clone());
    let served = serve_worker(listener, node.served, shutdown, args, info, node.gate).await;
    node.ops.stopped();
    served?;
    drop(node.until_stopped);
    let compute = node.compute;
    let _ = tokio::task::spawn_blocking(move || compute.join()).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_etcd_password_is_never_sent_without_tls() {
        let args = EtcdArgs {
            etcd_user: Some("tandem".into()),
            etcd_password: Some(discovery::Password("secret".into())),
            ..EtcdArgs::default()
        };
        let refused = args.client(&["127.0.0.1:2379".into()]).err();
        assert!(
            matches!(&refused, Some(ServeError::Config(m)) if m.contains("--etcd-ca")),
            "{refused:?}"
        );
    }
}
