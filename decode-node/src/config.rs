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
    /// Memory for KV caches in MiB, split into blocks of `--kv-block-tokens` positions. A
    /// request is admitted once the blocks for its whole budget (prompt plus max tokens, for
    /// each of its sequences) are free; until then it waits in the queue.
    #[arg(long, env = "DECODE_KV_CACHE_MB", default_value_t = 2048)]
    pub kv_cache_mb: usize,
    /// The KV budget in blocks, instead of `--kv-cache-mb`.
    #[arg(long, env = "DECODE_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Positions per KV block.
    #[arg(long, env = "DECODE_KV_BLOCK_TOKENS", default_value_t = 16)]
    pub kv_block_tokens: usize,
    /// Most requests queued for KV blocks or a batch slot; more are refused
    /// (RESOURCE_EXHAUSTED, which the router answers with 503).
    #[arg(long, env = "DECODE_MAX_WAITING", default_value_t = 256)]
    pub max_waiting: usize,
    /// Milliseconds a received KV cache waits for its Generate call before it is freed;
    /// also the longest a transfer may go quiet before it is cut.
    #[arg(long, env = "DECODE_KV_TIMEOUT_MS", default_value_t = 30_000)]
    pub kv_timeout_ms: u64,
    /// Milliseconds a Generate call waits for its KV transfer before it fails. The router
    /// calls at the same time as it sends the prompt to the prefill node, so this covers
    /// the prompt's time in that node's queue; the default is the router's request timeout.
    #[arg(long, env = "DECODE_KV_WAIT_MS", default_value_t = 600_000)]
    pub kv_wait_ms: u64,
    #[command(flatten)]
    pub cluster: runtime::ClusterArgs,
}
