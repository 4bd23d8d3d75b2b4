//! Command-line and environment configuration of a decode node.

use std::net::SocketAddr;

/// Configuration of `tandem-decode`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    version,
    name = "tandem-decode",
    about = "Tandem decode node (and colocated worker)",
    after_help = runtime::HUB_ENV_HELP
)]
pub struct Config {
    /// Address the gRPC service listens on.
    #[arg(long, env = "DECODE_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// The model, where it computes and what its KV caches hold.
    #[command(flatten)]
    pub model: engine::ModelArgs,
    /// Most sequences decoded in one step; a request with more (n, best_of, a beam's
    /// width) is refused.
    #[arg(long, env = "DECODE_MAX_BATCH_SIZE", default_value_t = 32)]
    pub max_batch_size: usize,
    /// Memory for KV caches in MiB, split into blocks of `--kv-block-tokens` positions. Every
    /// cache the node holds is reserved from it before it is allocated, for the request's
    /// whole length (prompt plus max tokens, for each of its sequences; transferred caches
    /// before their transfer begins); a request waits in the queue until its blocks are free.
    #[arg(long, env = "DECODE_KV_CACHE_MB", default_value_t = 2048)]
    pub kv_cache_mb: usize,
    /// The KV budget in blocks, instead of `--kv-cache-mb`.
    #[arg(long, env = "DECODE_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Positions per KV block.
    #[arg(long, env = "DECODE_KV_BLOCK_TOKENS", default_value_t = 16)]
    pub kv_block_tokens: usize,
    /// Most requests queued for KV blocks; more are refused at once (RESOURCE_EXHAUSTED:
    /// the router tries another decode node, else answers 503).
    #[arg(long, env = "DECODE_MAX_WAITING", default_value_t = 256)]
    pub max_waiting: usize,
    /// Milliseconds a KV transfer may go quiet (between any two reads) before it is cut;
    /// also the base of its whole deadline (see --kv-min-transfer-kib-s).
    #[arg(long, env = "DECODE_KV_TIMEOUT_MS", default_value_t = 30_000)]
    pub kv_timeout_ms: u64,
    /// Milliseconds a Generate call waits for its KV transfer once its ticket is issued;
    /// the ticket expires with it. This covers the prompt's time in the prefill node's
    /// queue; the default is the router's request timeout.
    #[arg(long, env = "DECODE_KV_WAIT_MS", default_value_t = 600_000)]
    pub kv_wait_ms: u64,
    /// Milliseconds a new KV data-plane connection may take to send its first transfer's
    /// header whole (and a connection between transfers, its next header once begun).
    /// Nothing is allocated for a connection before its header shows a valid ticket.
    #[arg(long, env = "DECODE_KV_HEADER_TIMEOUT_MS", default_value_t = 10_000)]
    pub kv_header_timeout_ms: u64,
    /// Milliseconds a KV data-plane connection may idle between transfers before the node
    /// closes it. Prefill nodes reuse a connection for at most 20 s, so keep this above that.
    #[arg(long, env = "DECODE_KV_IDLE_TIMEOUT_MS", default_value_t = 60_000)]
    pub kv_idle_timeout_ms: u64,
    /// The slowest a KV transfer may arrive on average, in KiB/s: its deadline is
    /// --kv-timeout-ms plus its size at this rate. The prefill node sends a prompt's cache as
    /// it computes it, so this must stay below its slowest prefill (1024 KiB/s is about 20
    /// tokens/s of SmolLM2).
    #[arg(long, env = "DECODE_KV_MIN_TRANSFER_KIB_S", default_value_t = 1024)]
    pub kv_min_transfer_kib_s: u64,
    /// Most KV transfers received at once; more wait for a place (each read still within
    /// --kv-timeout-ms).
    #[arg(long, env = "DECODE_KV_MAX_TRANSFERS", default_value_t = 64)]
    pub kv_max_transfers: usize,
    #[command(flatten)]
    pub cluster: runtime::ClusterArgs,
    #[command(flatten)]
    pub log: runtime::LogArgs,
}
