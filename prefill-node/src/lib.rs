//! The prefill node: a gRPC service that runs prompts, samples their first token and ships
//! each request's KV cache to the decode node the router chose.

pub mod config;
pub mod error;
pub mod metrics;
pub mod plan;
pub mod prefix;
pub mod service;
pub mod targets;
pub mod worker;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use config::Config;
pub use error::PrefillError;
use metrics::PrefillMetrics;
pub use runtime::ServeError;

/// How often the view of etcd's decode workers is listed again whole.
const RELIST: Duration = Duration::from_secs(30);

/// The decode workers registered in etcd or found in Kubernetes, followed for as long as
/// the node runs; `None` with neither.
async fn registered_decoders(
    cfg: &Config,
) -> Result<Option<tokio::sync::watch::Receiver<discovery::WorkerSet>>, ServeError> {
    let c = &cfg.cluster;
    let (tx, rx) = tokio::sync::watch::channel(discovery::WorkerSet::default());
    if c.etcd_endpoints.is_empty() {
        return Ok(cfg.kube.follow(RELIST, tx).await?.then_some(rx));
    }
    let client = Arc::new(c.etcd.client(&c.etcd_endpoints)?);
    tokio::spawn(discovery::watch_workers(
        client,
        c.etcd_prefix.clone(),
        RELIST,
        tx,
    ));
    Ok(Some(rx))
}

/// The compute thread's bounds from the node's flags, for caches of `layout`.
fn worker_limits(cfg: &Config, layout: &engine::KvLayout) -> worker::Limits {
    let bytes_per_token = layout.bytes_per_token_layer();
    worker::Limits {
        step_tokens: cfg.step_tokens,
        chunk_tokens: cfg.chunk_tokens,
        message_tokens: (cfg.transfer_chunk_bytes / bytes_per_token).max(1),
        prefix_cache_bytes: cfg.prefix_cache_mb << 20,
        max_active_tokens: cfg.max_active_tokens,
    }
}

/// The client KV caches go to decode nodes with.
fn kv_client(cfg: &Config) -> Result<kvwire::Client, ServeError> {
    Ok(kvwire::Client::new(
        Duration::from_millis(cfg.connect_timeout_ms),
        // Only a decode node may take a request's KV cache.
        cfg.cluster
            .tls
            .client()?
            .map(|t| t.expecting(discovery::Role::Decode.certified())),
    ))
}

/// Loads the model and serves `tandem.v1.Prefill` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let advertise = cfg.cluster.advertise(listener.local_addr()?)?;
    // Up before the model loads: probes see a node that loads, not a dead one.
    let ops = runtime::ops::Ops::start(cfg.cluster.metrics_listen).await?;
    // The prompts started at once each hold a cache of their length, beside the prefix
    // cache: the KV memory the node may take.
    let reserve = engine::KvRoom {
        bytes: (cfg.prefix_cache_mb as u64) << 20,
        positions: cfg.max_active_tokens as u64,
    };
    let args = cfg.model.clone();
    let loaded = runtime::load_model(move || args.load(reserve)).await?;
    let intake = intake::Intake::of(&loaded);
    let model = loaded.model;
    let layout = model.kv_layout();
    let registered = kvwire::convert::layout_info(&layout);
    let max_queue = cfg.max_queue.max(1);
    let (jobs_tx, jobs_rx) = tokio::sync::mpsc::channel(max_queue);
    let metrics = Arc::new(PrefillMetrics::default());
    metrics.spawn_upkeep();
    let limits = worker_limits(cfg, &layout);
    let compute = worker::spawn(Arc::new(model), limits, Arc::clone(&metrics), jobs_rx)?;
    let queue = jobs_tx.clone();
    let shown = Arc::clone(&metrics);
    let render = move || shown.render(max_queue - queue.capacity());
    let gate = runtime::Gate::default();
    let capacity = discovery::Capacity {
        max_queue: max_queue as u64,
        ..Default::default()
    };
    let targets = targets::DecodeTargets::new(&cfg.decode_nodes, registered_decoders(cfg).await?);
    if targets.is_unconfigured() {
        tracing::warn!(
            "no --decode-nodes, etcd or Kubernetes discovery: every request will be refused, for want of a decode node to send to"
        );
    }
    let setup = service::Setup {
        model: discovery::model_identity(&cfg.model.path),
        layout,
        intake,
        kv: kv_client(cfg)?,
        targets,
    };
    let svc = service::PrefillService::new(
        jobs_tx,
        Arc::clone(&metrics),
        max_queue,
        setup,
        gate.clone(),
    );
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.path.display(), "prefill node serving");
    let max = cfg.cluster.grpc_max_message_bytes;
    let server = proto::v1::prefill_server::PrefillServer::new(svc)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let routes = tonic::service::Routes::new(server);
    let node = runtime::Node {
        role: discovery::Role::Prefill,
        advertise,
        model: cfg.model.path.clone(),
        layout: registered,
        capacity,
        served: runtime::Served {
            routes,
            render,
            side: None,
        },
        gate,
        ops,
        // The server drops the service and with it the job sender (the metrics closure's
        // clone too): the thread ends.
        compute,
        until_stopped: None,
    };
    runtime::serve_node(listener, node, shutdown, &cfg.cluster).await
}
