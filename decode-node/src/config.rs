//! Command-line and environment configuration of a decode node.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Configuration of `tandem-decode`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "tandem-decode",
    about = "Tandem decode node (and colocated worker)"
)]
pub struct Config {
    /// Address the gRPC service listens on.
    #[arg(long, env = "DECODE_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Hugging Face model folder or GGUF file.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// Most sequences decoded in one step.
    #[arg(long, env = "DECODE_MAX_BATCH_SIZE", default_value_t = 32)]
    pub max_batch_size: usize,
    /// Milliseconds a received KV cache waits for its Generate call, and a Generate call
    /// waits for its KV cache, before both are freed and failed.
    #[arg(long, env = "DECODE_KV_TIMEOUT_MS", default_value_t = 30_000)]
    pub kv_timeout_ms: u64,
}
