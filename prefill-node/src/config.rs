//! Command-line and environment configuration of a prefill node.

use std::net::SocketAddr;

/// Configuration of `tandem-prefill`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    version,
    name = "tandem-prefill",
    about = "Tandem prefill node",
    after_help = runtime::HUB_ENV_HELP
)]
pub struct Config {
    /// Address the gRPC service listens on.
    #[arg(long, env = "PREFILL_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// The model, where it computes and what its KV caches hold.
    #[command(flatten)]
    pub model: engine::ModelArgs,
    /// Prompts that may wait for the compute thread; more are refused as resource exhausted.
    #[arg(long, env = "PREFILL_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Most prompt tokens started at once, over all prompts being computed or sent (each
    /// holds a KV cache of its whole length): this bounds the node's KV memory beside the
    /// prefix cache. Prompts past it wait in the queue, holding no cache; one prompt longer
    /// than this still runs, alone.
    #[arg(long, env = "PREFILL_MAX_ACTIVE_TOKENS", default_value_t = 16384)]
    pub max_active_tokens: usize,
    /// Most prompt tokens computed in one step, over all the prompts batched into it.
    #[arg(long, env = "PREFILL_STEP_TOKENS", default_value_t = 2048)]
    pub step_tokens: usize,
    /// Most tokens of one prompt in one step: a longer prompt is computed in chunks, so
    /// prompts that arrive behind it join the next step instead of waiting for all of it.
    #[arg(long, env = "PREFILL_CHUNK_TOKENS", default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Memory for the prefix cache in MiB (0 turns it off): the KV of recent prompts,
    /// reused by prompts that share a prefix with them.
    #[arg(long, env = "PREFILL_PREFIX_CACHE_MB", default_value_t = 256)]
    pub prefix_cache_mb: usize,
    /// Upper bound on the K (and again V) bytes of one transfer message; gRPC messages stay
    /// well under tonic's 4 MiB default.
    #[arg(long, env = "PREFILL_TRANSFER_CHUNK_BYTES", default_value_t = 1 << 20)]
    pub transfer_chunk_bytes: usize,
    /// Decode nodes (host:port, as the router names them) this node may send KV caches to,
    /// comma separated, beside those registered in etcd as decode workers. A request that
    /// names any other is refused: a request alone never makes this node dial an address.
    #[arg(long, env = "PREFILL_DECODE_NODES", value_delimiter = ',')]
    pub decode_nodes: Vec<String>,
    /// Milliseconds to connect to a decode node before the transfer fails.
    #[arg(long, env = "PREFILL_CONNECT_TIMEOUT_MS", default_value_t = 2_000)]
    pub connect_timeout_ms: u64,
    #[command(flatten)]
    pub cluster: runtime::ClusterArgs,
    /// How the decode nodes are found in Kubernetes, instead of etcd.
    #[command(flatten)]
    pub kube: runtime::KubeArgs,
    #[command(flatten)]
    pub log: runtime::LogArgs,
}
