//! Process plumbing shared by the router and the nodes: logging and trace export, the
//! shutdown signal, the request id and trace context carried in gRPC metadata, and why a
//! node could not serve.

pub mod channel;
pub mod cpu;
pub mod http;
pub mod memory;
pub mod ops;
pub mod otel;
pub mod process;
pub mod prom;
pub mod sniff;
pub mod turns;
pub mod worker;

pub use channel::{Channel, ChannelError};
pub use memory::{hold_freed_memory, return_freed_memory};
pub use sniff::{SideProtocol, Sniffed};
pub use turns::{TurnError, Turns};
pub use worker::{serve_node, ClusterArgs, EtcdArgs, Gate, KubeArgs, Node, Pass, Served, Tracked};

use std::future::Future;

use tokio::net::TcpListener;

/// How often an idle gRPC connection to a peer is pinged, and how long a ping may go
/// unanswered before the connection counts as broken: a peer that stops answering (paused,
/// partitioned) fails its calls within seconds instead of holding them forever.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// HTTP/2 flow-control windows of every gRPC connection, both ends. h2's default of 64 KiB
/// lets a KV transfer send one window per round trip, a few percent of what loopback
/// carries; megabytes in flight keep the pipe full.
pub const STREAM_WINDOW: u32 = 8 << 20;
/// See [`STREAM_WINDOW`]: one connection carries many transfers at once.
pub const CONNECTION_WINDOW: u32 = 32 << 20;

/// Largest HTTP/2 frame a worker accepts: a KV chunk crosses in a few frames, not a
/// hundred 16 KiB ones.
pub const MAX_FRAME: u32 = 1 << 20;

/// Connections a worker's port holds open at once, TLS handshakes included; more wait in
/// the listen backlog. Its peers are routers (a channel each), prefill nodes (at most 16
/// KV connections each) and Prometheus: far fewer, so only a peer that opens sockets
/// without end meets it.
pub const MAX_PEER_CONNECTIONS: usize = 4096;
/// A worker's operations listener: connections open at once (probes and scrapers need a
/// few), the largest request head, and how long a head may take to arrive or a response
/// wait on a reader, so that nothing that reaches the port holds it.
pub const OPS_MAX_CONNECTIONS: usize = 64;
pub const OPS_MAX_HEADER_BYTES: usize = 16 << 10;
pub const OPS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Largest gRPC message on any hop unless configured otherwise (see
/// `--grpc-max-message-bytes`).
pub const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

/// The build's version, which every crate of the workspace shares: caches and requests pass
/// only between processes of the same build, so workers register it and the router checks it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The registration of a worker of `role` at `addr` serving the model at `model` with
/// caches of `layout`.
pub(crate) fn worker_info(
    role: discovery::Role,
    addr: String,
    name: String,
    model: &std::path::Path,
    layout: discovery::Layout,
    capacity: discovery::Capacity,
) -> discovery::WorkerInfo {
    discovery::WorkerInfo {
        role,
        addr,
        name,
        model: discovery::model_identity(model),
        layout,
        engine_version: VERSION.into(),
        capacity,
    }
}

/// How a process dials its peers: every hop is set up the same way.
#[derive(Debug, Clone)]
pub struct Dialer {
    /// How long a connection may take to open.
    pub connect_timeout: std::time::Duration,
    /// Mutual TLS, when configured.
    pub tls: Option<tls::ClientTls>,
    /// Largest gRPC message sent or accepted.
    pub max_message: usize,
    /// How long a connection takes new calls ([`tls::MAX_CONNECTION_AGE`]) before the
    /// next call dials a new one.
    pub max_age: std::time::Duration,
}

impl Dialer {
    /// A lazily connected channel to the worker at `addr` (host:port): a connect timeout,
    /// no Nagle delay, pings so that a peer that stops answering (paused, cut off) fails
    /// its calls within seconds, wide flow-control windows, and mutual TLS when set.
    pub fn channel(&self, addr: &str) -> Result<Channel, ChannelError> {
        Channel::new(self.clone(), addr)
    }
}

/// The gRPC metadata key that carries a request's id from the router to both nodes.
pub const REQUEST_ID: &str = "x-request-id";

/// How a process writes its log lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, the event's fields at the
    /// top, and `span` (the innermost span's fields, `req_id` among them) and `spans`.
    Json,
}

/// The logging and tracing flags all three binaries take.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogArgs {
    /// `text` or `json` (one object per line, with the request's id, for log pipelines).
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Send every request's spans to this OpenTelemetry collector (OTLP over gRPC, e.g.
    /// `http://otel-collector:4317`), in the trace a client's `traceparent` header names.
    /// Unset: no traces.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// Logs in `args`' format, filtered by `RUST_LOG` (default `info`), and with
/// `--otlp-endpoint` exports the same spans as `service`; the exporter, which sends what it
/// still holds when dropped: keep it until the process ends.
pub fn init_tracing(
    args: &LogArgs,
    service: &'static str,
) -> Result<Option<otel::Exporter>, otel::OtelError> {
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;

    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let exporter = match &args.otlp_endpoint {
        Some(endpoint) => Some(otel::Exporter::start(endpoint, service)?),
        None => None,
    };
    let traces = exporter
        .as_ref()
        .map(|e| tracing_opentelemetry::layer().with_tracer(e.tracer(service)));
    let logs = match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer().boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(traces)
        .init();
    Ok(exporter)
}

/// What each binary's `--help` says of the Hugging Face environment `--model` reads.
pub const HUB_ENV_HELP: &str = hub::ENV_HELP;

/// The `--model` argument made into a path on this machine: a Hub name is found in the
/// Hugging Face cache or fetched into it first (the `HF_*` environment says where and
/// how). It blocks: the binaries call it before they start their runtime, so that a
/// fetch leaves no thread behind (the router's `--threads 1` is one thread).
pub fn resolve_model(model: &std::path::Path) -> Result<hub::Resolved, hub::HubError> {
    hub::resolve(model, &hub::Options::from_env())
}

/// Sizes the compute thread pools (candle's and rayon's) to [`usable_cpus`], unless
/// `RAYON_NUM_THREADS` or `CANDLE_NUM_THREADS` is set. candle counts the machine's physical
/// cores instead, so a worker pinned to one core (or given one CPU by Kubernetes) ran two
/// spinning threads on it and every step waited on a descheduled one: 30x slower.
///
/// Also shortens how long candle's pool workers spin after each matmul before they sleep
/// (`CANDLE_BARRIER_POOL_SPIN_LIMIT`, unless set): 25,000 turns by default, about 0.3 ms
/// here, during which a spinning worker holds a core that the sequences' attention, which
/// runs on rayon between the matmuls, could use. 2,000 turns still catch the next matmul
/// of a decode step; batch-16 decode gained about a quarter (bench/README.md, figure 1).
/// Call first thing in `main`, before any thread reads the environment.
pub fn fit_compute_threads() {
    if std::env::var_os(SPIN_LIMIT).is_none() {
        std::env::set_var(SPIN_LIMIT, "2000");
    }
    if ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    {
        return;
    }
    std::env::set_var("RAYON_NUM_THREADS", usable_cpus().to_string());
}

/// The CPUs this process may run on, as `available_parallelism` reports them (the affinity
/// mask, a cgroup CPU quota); 1 when it cannot tell.
pub fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The tokio runtime a serving process runs its I/O on: `threads` threads, else one per
/// CPU this process may use ([`usable_cpus`]). One thread gets the current-thread
/// scheduler: with a single worker the multi-thread one only adds its cross-thread
/// bookkeeping to every wake-up, about a quarter of the router's CPU per request on one
/// core (bench/README.md, figure 4).
pub fn io_runtime(threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let n = threads.unwrap_or_else(usable_cpus).max(1);
    let mut builder = if n == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(n);
        b
    };
    builder.enable_all().build()
}

/// How many turns candle's pool workers spin before they sleep.
const SPIN_LIMIT: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes and the quickstart send).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The request id a caller sent as metadata, else `fallback`.
pub fn request_id<T>(req: &tonic::Request<T>, fallback: &str) -> String {
    req.metadata()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or(fallback)
        .to_string()
}

/// `msg` as a request that carries `id`, and the current span's trace context, as
/// metadata.
pub fn with_request_id<T>(id: &str, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    otel::inject_current(r.metadata_mut());
    if let Ok(mut v) = id.parse::<tonic::metadata::MetadataValue<_>>() {
        // Marked sensitive so HPACK sends it as a literal: every id is new, and entering
        // each in the connection's header table would evict the headers that repeat.
        v.set_sensitive(true);
        r.metadata_mut().insert(REQUEST_ID, v);
    }
    r
}

/// Runs a model's loading on the blocking pool, off the async threads, and gives the
/// load's transient memory back after it ([`memory::return_freed_memory`]). Plumbing knows
/// no model: the node passes the call that loads its own.
pub async fn load_model<M, E>(
    load: impl FnOnce() -> Result<M, E> + Send + 'static,
) -> Result<M, ServeError>
where
    M: Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    let load_and_return = move || {
        let loaded = load();
        memory::return_freed_memory();
        loaded
    };
    tokio::task::spawn_blocking(load_and_return)
        .await
        .expect("model loading does not panic")
        .map_err(|e| ServeError::Model(Box::new(e)))
}

/// Why a node could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("loading the model: {0}")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("starting the compute thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("etcd: {0}")]
    Discovery(#[from] discovery::EtcdError),
    #[error("Kubernetes: {0}")]
    Kube(#[from] discovery::kube::KubeError),
    #[error("configuration: {0}")]
    Config(String),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("listening: {0}")]
    Listen(std::io::Error),
}

/// Calls refused because the caller's certificate does not carry a role the service is
/// open to.
static ROLE_REFUSALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Calls refused for their caller's role since the process started.
pub fn role_refusals() -> u64 {
    ROLE_REFUSALS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Lets a gRPC call through only from a caller whose identity may use the services:
/// under mutual TLS, a certificate with one of `callers`' roles; others get
/// PERMISSION_DENIED before the service sees the call.
async fn gate_callers(
    callers: &'static [tls::Role],
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let identity = req
        .extensions()
        .get::<tls::Peer>()
        .map_or(tls::Identity::Plain, |p| p.identity);
    if identity.may(callers) {
        return next.run(req).await;
    }
    ROLE_REFUSALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = req.uri().path();
    tracing::debug!(
        ?identity,
        path,
        "refused a call from a peer without the role for it"
    );
    let message = format!(
        "{path} takes calls from {} only; the caller's certificate carries {identity:?}",
        callers
            .iter()
            .map(|r| r.uri())
            .collect::<Vec<_>>()
            .join(", ")
    );
    proto::error_status(
        tonic::Code::PermissionDenied,
        message,
        proto::v1::ErrorReason::Forbidden,
    )
    .into_http()
}

/// Serves gRPC `routes` and `GET /metrics` (the text `render` returns) on one listener
/// until `shutdown` resolves: HTTP/1 is accepted beside HTTP/2, so a Prometheus scraper
/// needs no port of its own, and connections of a `side` protocol go to its handler. With
/// `tls`, every connection is TLS (mutual, when the configuration asks for client
/// certificates), and the gRPC services take calls only from certificates with one of
/// `callers`' roles; `/metrics` from any certificate the CA signed (a scraper's).
pub async fn serve_grpc_with_metrics(
    listener: TcpListener,
    tls: Option<tls::ServerTls>,
    side: Option<SideProtocol>,
    (routes, callers): (tonic::service::Routes, &'static [tls::Role]),
    render: impl Fn() -> String + Clone + Send + Sync + 'static,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let metrics = axum::routing::get(move || {
        let text = render();
        async move { ([("content-type", "text/plain; version=0.0.4")], text) }
    });
    let router = routes
        .into_axum_router()
        .layer(axum::middleware::from_fn(move |req, next| {
            gate_callers(callers, req, next)
        }))
        .route("/metrics", metrics);
    let incoming = sniff::split(
        tls::accept(listener, tls, MAX_PEER_CONNECTIONS).map_err(ServeError::Listen)?,
        side,
    );
    tonic::transport::Server::builder()
        .accept_http1(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(Some(MAX_FRAME))
        .add_routes(router.into())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_travel_in_metadata() {
        let req = with_request_id("chatcmpl-1", ());
        assert_eq!(request_id(&req, "fallback"), "chatcmpl-1");
        assert_eq!(request_id(&tonic::Request::new(()), "fallback"), "fallback");
        let id = req.metadata().get(REQUEST_ID).expect("the id is set");
        assert!(id.is_sensitive(), "ids are kept out of the HPACK table");
    }

    #[test]
    fn one_serving_thread_gets_the_current_thread_scheduler() {
        use tokio::runtime::RuntimeFlavor;
        let flavor = |threads| io_runtime(threads).unwrap().handle().runtime_flavor();
        assert_eq!(flavor(Some(1)), RuntimeFlavor::CurrentThread);
        assert_eq!(flavor(Some(2)), RuntimeFlavor::MultiThread);
        let expected = if usable_cpus() == 1 {
            RuntimeFlavor::CurrentThread
        } else {
            RuntimeFlavor::MultiThread
        };
        assert_eq!(flavor(None), expected);
    }
}
