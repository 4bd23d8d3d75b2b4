//! Command-line and environment configuration of the router. Where MindIE has a name for a
//! setting (modelName, maxIterTimes, maxSeqLen, maxInputTokenLen, fullTextEnabled), the flag
//! accepts it as an alias.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::error::ErrorFormat;
use crate::routing::PolicyKind;

/// How requests are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Prefill on a prefill node, decode on a decode node, KV cache sent between them.
    Pd,
    /// One worker (a decode node) prefills and decodes each request itself.
    Colocated,
}

/// What the workers' KV caches hold: the router pairs only workers whose caches are this
/// type. The names are the engine's (`engine::KvDtype`), which the router does not link;
/// the end-to-end tests hold the two lists equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheDtype {
    F16,
    #[value(name = "q8_0")]
    Q8_0,
}

impl KvCacheDtype {
    /// Its name in worker registrations and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
        }
    }
}

/// Which tool-call markup chat output is parsed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolCallParser {
    /// The markup the model's chat template teaches (Hermes, DeepSeek, Llama 3's JSON,
    /// Mistral's or Phi-4-mini's), or `generic` for a template that teaches none.
    Auto,
    /// None: requests with tools are refused, since their calls could not be returned.
    None,
    /// The router writes the tools into the system turn, and tool turns into plain ones, as
    /// Qwen's templates do, and parses Hermes markup: for any template.
    Generic,
    /// Qwen2.5 and Qwen3: `<tool_call>{...}</tool_call>`.
    Hermes,
    /// DeepSeek-V3 and R1.
    Deepseek,
    /// Llama 3.1 to 3.3: a reply that is `{"name": ..., "parameters": {...}}`.
    Llama3Json,
    /// Mistral (v3 tokenizers: Mistral-7B-v0.3, Nemo): `[TOOL_CALLS][{...}]`.
    Mistral,
    /// Mistral (v11 and later tokenizers: Small 3.2, Devstral): `[TOOL_CALLS]name[ARGS]{...}`.
    MistralArgs,
    /// Phi-4-mini: `<|tool_call|>[{...}]<|/tool_call|>`, tools in the system message.
    Phi4Mini,
}

/// Whether chat output is split into `reasoning_content` and `content`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    /// `think` when the model's chat template knows `</think>`.
    Auto,
    /// Reasoning stays in `content`.
    None,
    /// `<think>...</think>` goes to `reasoning_content`.
    Think,
}

/// What a special token's text inside a chat's content becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecialTokensInContent {
    /// The plain text it is.
    Text,
    /// The special token.
    Special,
}

/// An API key; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub String);

impl std::str::FromStr for ApiKey {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.trim().to_string()))
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Configuration of `tandem-router`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    version,
    name = "tandem-router",
    about = "Tandem router: the OpenAI-style HTTP API",
    after_help = runtime::HUB_ENV_HELP
)]
pub struct Config {
    /// Address the HTTP API listens on.
    #[arg(long, env = "ROUTER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Address the operations listener listens on: `/metrics`, `/health` and
    /// `/health/ready`, for Prometheus and probes. The API port serves `/health` alone, so
    /// no client reads the cluster's map or its breakers from it.
    #[arg(long, env = "ROUTER_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,
    /// Hugging Face model folder or GGUF file, or a Hub name (`org/name[@rev][:QUANT]`)
    /// fetched into the Hugging Face cache first; the router reads the model's tokenizer,
    /// chat template and config, never its weights.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// The name requests must give as `model` (default: the Hub name as given, else the
    /// model folder or file name).
    #[arg(long, visible_alias = "modelName", env = "ROUTER_MODEL_NAME")]
    pub model_name: Option<String>,
    /// What the workers' KV caches hold, `f16` or `q8_0`, as their own
    /// `--kv-cache-dtype`: a worker whose caches hold another type is not routed to.
    #[arg(long, env = "TANDEM_KV_CACHE_DTYPE", value_enum, default_value_t = KvCacheDtype::F16)]
    pub kv_cache_dtype: KvCacheDtype,
    /// `pd` (prefill and decode nodes) or `colocated` (decode nodes serve whole requests).
    #[arg(long, env = "ROUTER_MODE", value_enum, default_value_t = Mode::Pd)]
    pub mode: Mode,
    /// Under PD, a prompt of at most this many tokens is prefilled by its decode node rather
    /// than sent through a prefill node and a KV transfer (0: every prompt goes through a
    /// prefill node). The tokens are the same either way.
    #[arg(long, env = "ROUTER_LOCAL_PREFILL_MAX_TOKENS", default_value_t = 0)]
    pub local_prefill_max_tokens: usize,
    /// Prefill node addresses (host:port), comma separated.
    #[arg(long, env = "ROUTER_PREFILL_NODES", value_delimiter = ',')]
    pub prefill_nodes: Vec<String>,
    /// Decode node addresses (host:port), comma separated; the workers in colocated mode.
    #[arg(long, env = "ROUTER_DECODE_NODES", value_delimiter = ',')]
    pub decode_nodes: Vec<String>,
    /// Most tokens a decode node produces for one request (MindIE's maxIterTimes). With PD,
    /// a request limited by it gets maxIterTimes + 1 tokens: the prefill node's first one
    /// and the decode node's.
    #[arg(
        long,
        visible_alias = "maxIterTimes",
        env = "ROUTER_MAX_ITER_TIMES",
        default_value_t = 512
    )]
    pub max_iter_times: usize,
    /// Most tokens of prompt plus output (capped by the model's max_position_embeddings).
    #[arg(
        long,
        visible_alias = "maxSeqLen",
        env = "ROUTER_MAX_SEQ_LEN",
        default_value_t = 2560
    )]
    pub max_seq_len: usize,
    /// Most prompt tokens.
    #[arg(
        long,
        visible_alias = "maxInputTokenLen",
        env = "ROUTER_MAX_INPUT_TOKEN_LEN",
        default_value_t = 2048
    )]
    pub max_input_token_len: usize,
    /// Streamed content is cumulative and the last chunk carries `full_text`.
    #[arg(
        long,
        visible_alias = "fullTextEnabled",
        env = "ROUTER_FULL_TEXT_ENABLED",
        default_value_t = false
    )]
    pub full_text_enabled: bool,
    /// Milliseconds to connect to a worker before the request fails with 503.
    #[arg(long, env = "ROUTER_CONNECT_TIMEOUT_MS", default_value_t = 1_000)]
    pub connect_timeout_ms: u64,
    /// Milliseconds a request may take from start to last token before it fails with 504.
    #[arg(long, env = "ROUTER_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    pub request_timeout_ms: u64,
    /// Milliseconds a PD request waits in a decode node's queue for its KV memory to be
    /// reserved; then it tries another decode node, or fails with 503. A burst larger than
    /// the decode nodes' budgets waits its turn: half the request timeout by default, so that
    /// a retry elsewhere still has time.
    #[arg(long, env = "ROUTER_KV_RESERVE_TIMEOUT_MS", default_value_t = 300_000)]
    pub kv_reserve_timeout_ms: u64,
    /// API keys clients must send as `Authorization: Bearer <key>`, comma separated. With
    /// none (and no key file) the API is open.
    #[arg(
        long,
        env = "ROUTER_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<ApiKey>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped).
    #[arg(long, env = "ROUTER_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Error bodies: `openai`, or `provider` for seed 003's `{"code", "result", "message"}`.
    #[arg(long, env = "ROUTER_ERROR_FORMAT", value_enum, default_value_t = ErrorFormat::Openai)]
    pub error_format: ErrorFormat,
    /// Tool-call markup parsed out of chat output into `tool_calls`.
    #[arg(long, env = "ROUTER_TOOL_CALL_PARSER", value_enum, default_value_t = ToolCallParser::Auto)]
    pub tool_call_parser: ToolCallParser,
    /// Reasoning markup parsed out of chat output into `reasoning_content`.
    #[arg(long, env = "ROUTER_REASONING_PARSER", value_enum, default_value_t = ReasoningParser::Auto)]
    pub reasoning_parser: ReasoningParser,
    /// What a special token's text (`<|im_start|>`) inside a chat's messages, tools or
    /// template kwargs is: `text` (the default) encodes it as the plain text it is, so only
    /// the chat template marks turns; `special` makes it the special token, as older
    /// servers did, which lets any client write turns of any role.
    #[arg(long, env = "ROUTER_SPECIAL_TOKENS_IN_CONTENT", value_enum, default_value_t = SpecialTokensInContent::Text)]
    pub special_tokens_in_content: SpecialTokensInContent,
    /// Debugging only: log each request's prompt text (the rendered prompt) at info. Prompts
    /// are private: off by default, and a warning at startup says when it is on.
    #[arg(long, env = "ROUTER_LOG_PROMPTS", default_value_t = false)]
    pub log_prompts: bool,
    /// Most requests served at once; past it a request gets 503 with Retry-After at once.
    #[arg(long, env = "ROUTER_MAX_IN_FLIGHT", default_value_t = 1024)]
    pub max_in_flight: usize,
    /// Most requests one API key may have in flight (0: no limit); past it, 429 with
    /// Retry-After.
    #[arg(long, env = "ROUTER_MAX_IN_FLIGHT_PER_KEY", default_value_t = 0)]
    pub max_in_flight_per_key: usize,
    /// Most streamed (SSE) responses open at once (0: no limit beyond --max-in-flight);
    /// past it a streamed request gets 503 with Retry-After at once.
    #[arg(long, env = "ROUTER_MAX_STREAMS", default_value_t = 512)]
    pub max_streams: usize,
    /// Milliseconds a request's body may take to arrive once its head has; past it, 408
    /// and the connection closes (a client that announces a body and never sends it).
    #[arg(long, env = "ROUTER_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// Milliseconds a request's head may take to arrive (and an idle keep-alive connection
    /// may wait for the next one).
    #[arg(long, env = "ROUTER_HEADER_TIMEOUT_MS", default_value_t = 30_000)]
    pub header_timeout_ms: u64,
    /// Most client connections open at once; past it new connections wait in the listen
    /// backlog until one closes, and the open ones keep working.
    #[arg(long, env = "ROUTER_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Milliseconds a response may wait on a client that reads nothing of it; then the
    /// connection closes and its generation is cancelled on the workers
    /// (router_client_stalls_total).
    #[arg(long, env = "ROUTER_CLIENT_STALL_TIMEOUT_MS", default_value_t = 30_000)]
    pub client_stall_timeout_ms: u64,
    /// Largest request body in bytes; larger ones get 413 (from the Content-Length before
    /// any of it is read, or as a chunked body's bytes arrive).
    #[arg(long, env = "ROUTER_MAX_BODY_BYTES", default_value_t = 20 << 20)]
    pub max_body_bytes: usize,
    /// etcd endpoints (host:port), comma separated: workers registered there join the
    /// static lists and are followed as they come and go.
    #[arg(long, env = "TANDEM_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of the worker registrations.
    #[arg(long, env = "TANDEM_ETCD_PREFIX", default_value = discovery::DEFAULT_PREFIX)]
    pub etcd_prefix: String,
    /// Milliseconds between full listings of the registrations, on top of the watch, so
    /// that a missed event cannot leave a stale worker.
    #[arg(long, env = "ROUTER_RELIST_INTERVAL_MS", default_value_t = 10_000)]
    pub relist_interval_ms: u64,
    /// Milliseconds between health probes of each worker; a worker is routed to only after
    /// answering one with this router's KV layout.
    #[arg(long, env = "ROUTER_HEALTH_INTERVAL_MS", default_value_t = 1_000)]
    pub health_interval_ms: u64,
    /// How workers are chosen.
    #[arg(long, env = "ROUTER_POLICY", value_enum, default_value_t = PolicyKind::LeastLoad)]
    pub policy: PolicyKind,
    /// Extra outstanding prompt tokens a prefill node may have over the least loaded one
    /// and still get the prompts whose prefix it holds.
    #[arg(long, env = "ROUTER_AFFINITY_SLACK_TOKENS", default_value_t = 4096)]
    pub affinity_slack_tokens: u64,
    /// Attempts per request: one that fails on a worker before its first token reaches
    /// the client is retried on another pair, up to this many times in all.
    #[arg(long, env = "ROUTER_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: usize,
    /// Moves a single-sequence request whose decode node fails or stops answering after
    /// some tokens: a prefill node computes the prompt and the tokens so far, another
    /// decode node goes on, and the stream continues with the tokens of an uninterrupted
    /// run (within --max-attempts). `false` ends such a stream with an error.
    #[arg(
        long,
        env = "ROUTER_STREAM_MIGRATION",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub stream_migration: bool,
    /// Consecutive failed requests that take a worker out of rotation.
    #[arg(long, env = "ROUTER_BREAKER_FAILURES", default_value_t = 3)]
    pub breaker_failures: u32,
    /// Milliseconds a worker stays out after its breaker opens (doubling while it keeps
    /// failing, up to a minute).
    #[arg(long, env = "ROUTER_BREAKER_COOLDOWN_MS", default_value_t = 2_000)]
    pub breaker_cooldown_ms: u64,
    /// PEM certificate (chain) for serving the API over HTTPS; with --https-key. Reloaded
    /// when the file changes. Without it the API is plain HTTP.
    #[arg(long, env = "ROUTER_HTTPS_CERT", requires = "https_key")]
    pub https_cert: Option<std::path::PathBuf>,
    /// PEM private key of --https-cert.
    #[arg(long, env = "ROUTER_HTTPS_KEY", requires = "https_cert")]
    pub https_key: Option<std::path::PathBuf>,
    /// Largest request header section in bytes (request line and all headers); a larger
    /// one gets 431. At most 100 headers are read in any case.
    #[arg(long, env = "ROUTER_MAX_HEADER_BYTES", default_value_t = 64 << 10,
        value_parser = clap::value_parser!(u64).range(8192..))]
    pub max_header_bytes: u64,
    /// Threads serving requests (default: one per CPU the process may use, by its affinity
    /// mask and cgroup quota); with one, tokio's current-thread scheduler.
    #[arg(long, env = "ROUTER_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Largest gRPC message sent to or accepted from a worker, in bytes.
    #[arg(long, env = "TANDEM_GRPC_MAX_MESSAGE_BYTES", default_value_t = runtime::DEFAULT_MAX_MESSAGE)]
    pub grpc_max_message_bytes: usize,
    #[command(flatten)]
    pub tls: tls::TlsArgs,
    #[command(flatten)]
    pub etcd: runtime::EtcdArgs,
    /// How the workers are found in Kubernetes, instead of etcd.
    #[command(flatten)]
    pub kube: runtime::KubeArgs,
    #[command(flatten)]
    pub log: runtime::LogArgs,
}
