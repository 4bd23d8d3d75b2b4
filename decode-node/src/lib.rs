//! The decode node: a gRPC service that receives KV caches from prefill nodes and decodes
//! many sequences at once. It also serves as the colocated worker, prefilling prompts itself.

pub mod budget;
pub mod config;
pub mod ended;
pub mod error;
pub mod kv;
pub mod metrics;
pub mod scheduler;
pub mod service;
pub mod store;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use config::Config;
pub use error::DecodeError;
use metrics::DecodeMetrics;
pub use runtime::ServeError;

/// KV data-plane connections accepted and not yet given a task.
const KV_BACKLOG: usize = 128;

/// The node's KV memory from its flags: `--kv-blocks`, else as many as `--kv-cache-mb`
/// holds.
fn kv_budget(cfg: &Config, layout: &engine::KvLayout, max_positions: usize) -> budget::KvBudget {
    let block_tokens = cfg.kv_block_tokens.max(1);
    let blocks = cfg.kv_blocks.unwrap_or(budget::KvBudget::blocks_in(
        cfg.kv_cache_mb << 20,
        layout,
        block_tokens,
    ));
    budget::KvBudget::new(
        layout.clone(),
        max_positions,
        block_tokens,
        blocks,
        cfg.max_waiting,
    )
}

/// The KV data plane's bounds from the node's flags, for a model of `max_positions`.
fn kv_limits(cfg: &Config, max_positions: usize) -> kv::KvLimits {
    kv::KvLimits {
        header: Duration::from_millis(cfg.kv_header_timeout_ms),
        idle: Duration::from_millis(cfg.kv_idle_timeout_ms),
        quiet: Duration::from_millis(cfg.kv_timeout_ms),
        min_rate: cfg.kv_min_transfer_kib_s.saturating_mul(1024),
        max_header: kv::KvLimits::header_bytes(max_positions),
        max_transfers: cfg.kv_max_transfers,
    }
}

/// Serves each KV data-plane connection from `conns` on `plane` in a task of its own.
/// Dropping the sender it returns (once the server has stopped) ends them all: KV
/// connections still open (a prefill node's idle ones) close, and the service they hold
/// goes, so the compute thread can end.
fn accept_kv(
    plane: Arc<kv::KvPlane>,
    mut conns: tokio::sync::mpsc::Receiver<runtime::Sniffed>,
) -> tokio::sync::watch::Sender<()> {
    let (stop, stopped) = tokio::sync::watch::channel(());
    let mut accepting = stopped.clone();
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                c = conns.recv() => match c {
                    Some(c) => c,
                    None => return,
                },
                _ = accepting.changed() => return,
            };
            let (plane, mut stopped) = (Arc::clone(&plane), stopped.clone());
            tokio::spawn(async move {
                tokio::select! {
                    () = plane.serve(conn) => {}
                    _ = stopped.changed() => {}
                }
            });
        }
    });
    stop
}

/// Loads the model and serves `tandem.v1.Decode`, and the KV data plane beside it, on
/// `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let advertise = cfg.cluster.advertise(listener.local_addr()?)?;
    // Up before the model loads: probes see a node that loads, not a dead one.
    let ops = runtime::ops::Ops::start(cfg.cluster.metrics_listen).await?;
    let reserve = match cfg.kv_blocks {
        Some(blocks) => engine::KvRoom {
            bytes: 0,
            positions: (blocks * cfg.kv_block_tokens.max(1)) as u64,
        },
        None => engine::KvRoom {
            bytes: (cfg.kv_cache_mb as u64) << 20,
            positions: 0,
        },
    };
    let args = cfg.model.clone();
    let loaded = runtime::load_model(move || args.load(reserve)).await?;
    let intake = intake::Intake::of(&loaded);
    let model = loaded.model;
    let layout = model.kv_layout();
    let device = model.device().clone();
    let registered = kvwire::convert::layout_info(&layout);
    let max_positions = model.config().max_position_embeddings;
    let budget = Arc::new(kv_budget(cfg, &layout, max_positions));
    let (blocks, block_tokens) = (budget.capacity(), budget.block_tokens());
    let metrics = Arc::new(DecodeMetrics::new(block_tokens));
    metrics.spawn_upkeep();
    let (admit_tx, admit_rx) = tokio::sync::mpsc::unbounded_channel();
    let compute = scheduler::spawn(
        Arc::new(model),
        cfg.max_batch_size,
        Arc::clone(&metrics),
        admit_rx,
    )?;
    let tickets = store::Tickets::new();
    let gate = runtime::Gate::default();
    let max = cfg.cluster.grpc_max_message_bytes;
    let svc = Arc::new(service::DecodeService::new(
        admit_tx,
        Arc::clone(&tickets),
        Arc::clone(&budget),
        service::Shape {
            model: discovery::model_identity(&cfg.model.path),
            layout: layout.clone(),
            intake,
            max_batch: cfg.max_batch_size.max(1),
        },
        Arc::clone(&metrics),
        gate.clone(),
        Duration::from_millis(cfg.kv_wait_ms),
    ));
    let plane = Arc::new(kv::KvPlane::new(
        Arc::clone(&tickets),
        layout,
        device,
        Arc::clone(&metrics),
        gate.clone(),
        kv_limits(cfg, max_positions),
    ));
    let (kv_tx, kv_rx) = tokio::sync::mpsc::channel(KV_BACKLOG);
    let stop_kv = accept_kv(Arc::clone(&plane), kv_rx);
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.path.display(),
        kv_blocks = blocks, block_tokens, "decode node serving");
    let server = proto::v1::decode_server::DecodeServer::from_arc(svc)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let routes = tonic::service::Routes::new(server);
    let node = runtime::Node {
        role: discovery::Role::Decode,
        advertise,
        model: cfg.model.path.clone(),
        layout: registered,
        capacity: discovery::Capacity {
            kv_blocks: blocks as u64,
            block_tokens: block_tokens as u64,
            max_batch: cfg.max_batch_size as u64,
            max_queue: cfg.max_waiting as u64,
        },
        served: runtime::Served {
            routes,
            render: move || {
                metrics.render(metrics::Held {
                    capacity: budget.capacity(),
                    used_blocks: budget.used(),
                    reserving: budget.waiting(),
                    receiving: plane.receiving(),
                    tickets: tickets.len(),
                })
            },
            side: Some(runtime::SideProtocol {
                preface: kvwire::PREFACE,
                conns: kv_tx,
            }),
        },
        gate,
        ops,
        compute,
        until_stopped: Some(Box::new(stop_kv)),
    };
    runtime::serve_node(listener, node, shutdown, &cfg.cluster).await
}
