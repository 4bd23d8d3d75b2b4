//! The prefill node: a gRPC service that runs prompts, samples their first token and ships
//! each request's KV cache to the decode node the router chose.

pub mod config;
pub mod error;
pub mod service;
pub mod worker;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

pub use config::Config;
pub use error::PrefillError;
pub use runtime::ServeError;

/// Loads the model and serves `tandem.v1.Prefill` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let model = runtime::load_model(&cfg.model).await?;
    let layout = model.kv_layout();
    let max_positions = model.config().max_position_embeddings;
    let bytes_per_token = layout.n_kv_heads * layout.head_dim * 4;
    let chunk_tokens = (cfg.transfer_chunk_bytes / bytes_per_token).max(1);
    let (jobs_tx, jobs_rx) = tokio::sync::mpsc::channel(cfg.max_queue.max(1));
    let compute = worker::spawn(Arc::new(model), chunk_tokens, jobs_rx)?;
    let svc = service::PrefillService::new(
        jobs_tx,
        cfg.max_queue,
        layout,
        max_positions,
        Duration::from_millis(cfg.connect_timeout_ms),
    );
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.display(), "prefill node serving");
    tonic::transport::Server::builder()
        .add_service(proto::v1::prefill_server::PrefillServer::new(svc))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    // The server has dropped the service and with it the job sender: the thread ends.
    let _ = tokio::task::spawn_blocking(move || compute.join()).await;
    Ok(())
}
