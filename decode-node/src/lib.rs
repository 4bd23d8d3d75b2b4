//! The decode node: a gRPC service that receives KV caches from prefill nodes and decodes
//! many sequences at once. It also serves as the colocated worker, prefilling prompts itself.

pub mod config;
pub mod error;
pub mod scheduler;
pub mod service;
pub mod store;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

pub use config::Config;
pub use error::DecodeError;
pub use runtime::ServeError;

/// Loads the model and serves `tandem.v1.Decode` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: &Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let model = runtime::load_model(&cfg.model).await?;
    let layout = model.kv_layout();
    let (admit_tx, admit_rx) = tokio::sync::mpsc::unbounded_channel();
    let compute = scheduler::spawn(Arc::new(model), cfg.max_batch_size, admit_rx)?;
    let store = store::TransferStore::new(Duration::from_millis(cfg.kv_timeout_ms));
    let svc = service::DecodeService::new(admit_tx, store, layout);
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.display(), "decode node serving");
    tonic::transport::Server::builder()
        .add_service(proto::v1::decode_server::DecodeServer::new(svc))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    let _ = tokio::task::spawn_blocking(move || compute.join()).await;
    Ok(())
}
