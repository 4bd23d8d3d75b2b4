//! Command-line and environment configuration of a prefill node.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Configuration of `tandem-prefill`.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "tandem-prefill", about = "Tandem prefill node")]
pub struct Config {
    /// Address the gRPC service listens on.
    #[arg(long, env = "PREFILL_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Hugging Face model folder or GGUF file.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// Prompts that may wait for the compute thread; more are refused as resource exhausted.
    #[arg(long, env = "PREFILL_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Upper bound on the K (and again V) bytes of one transfer message; gRPC messages stay
    /// well under tonic's 4 MiB default.
    #[arg(long, env = "PREFILL_TRANSFER_CHUNK_BYTES", default_value_t = 1 << 20)]
    pub transfer_chunk_bytes: usize,
    /// Milliseconds to connect to a decode node before the transfer fails.
    #[arg(long, env = "PREFILL_CONNECT_TIMEOUT_MS", default_value_t = 2_000)]
    pub connect_timeout_ms: u64,
}
