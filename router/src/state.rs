//! What every handler shares.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{
    Config, KvCacheDtype, Mode, ReasoningParser, SpecialTokensInContent, ToolCallParser,
};
use crate::error::RouterError;
use crate::keys::{Key, Keys};
use crate::metrics::Metrics;
use crate::output::Render;
use crate::pool::Pool;
use crate::routing::RetryBudget;
use crate::worker::{Expected, PoolSettings};
use text::tools::ToolFormat;

/// The router's shared state.
pub struct AppState {
    pub cfg: Config,
    /// The name requests must give as `model`.
    pub model_name: String,
    pub text: Arc<text::TextModel>,
    /// The vocabulary request grammars are checked against, or why the model's cannot be
    /// constrained (requests with a grammar are then refused).
    pub grammar_vocab: Result<text::grammar::Vocab, String>,
    pub prefill: Pool,
    pub decode: Pool,
    /// Most prompt tokens: min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings).
    pub max_prompt_tokens: usize,
    /// The most bytes of prompt text that can make `max_prompt_tokens` tokens: longer text
    /// is refused before it is tokenized.
    pub max_prompt_bytes: usize,
    /// What a request body's JSON may hold.
    pub json_limits: crate::api::json::JsonLimits,
    /// Requests being parsed, templated and tokenized at once, on the blocking pool, so
    /// that a large input never runs on the threads that serve connections.
    pub preparing: runtime::Turns,
    /// maxSeqLen capped by the model's context.
    pub max_seq_len: usize,
    pub metrics: Arc<Metrics>,
    /// What every request's output is shown with.
    pub(crate) render: Render,
    pub started: Instant,
    /// The tool-call markup chat output is parsed for; `None` refuses tools.
    pub tool_format: Option<ToolFormat>,
    /// The ids of `tool_format`'s markers in the vocabulary (`ToolFormat::markers`).
    pub tool_markers: Arc<[u32]>,
    /// Whether the router writes the tools and tool turns into the messages (the generic
    /// format), because the chat template teaches no tool format.
    pub tools_in_prompt: bool,
    /// Whether `<think>` blocks go to `reasoning_content`.
    pub think: bool,
    /// The special tokens escaped in a chat's content (`--special-tokens-in-content text`);
    /// `None` leaves them special.
    pub specials: Option<text::specials::Specials>,
    /// Accepted API keys; none means the API is open.
    api_keys: Keys,
    /// True while etcd cannot be reached (the last known workers keep serving).
    pub degraded: AtomicBool,
    /// Retries left to spend, so that a failing pool cannot make retries storm.
    pub retry_budget: RetryBudget,
}

/// Where the worker set comes from, for readiness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discovery {
    /// Static lists only.
    Static,
    /// etcd, reachable.
    Ok,
    /// etcd, unreachable: the last known workers.
    Degraded,
}

impl Discovery {
    /// Its name in readiness bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            Discovery::Static => "static",
            Discovery::Ok => "ok",
            Discovery::Degraded => "degraded",
        }
    }
}

/// The layout of the caches the workers of `cfg`'s model hold and register when they hold
/// `dtype`, to refuse workers of another. The router does not link the engine, and every
/// cluster test would fail if the two disagreed, since the router would refuse every worker.
fn cache_layout(cfg: &text::ModelConfig, dtype: KvCacheDtype) -> discovery::Layout {
    discovery::Layout {
        n_layers: cfg.num_hidden_layers as u32,
        n_kv_heads: cfg.num_key_value_heads as u32,
        head_dim: cfg.head_dim as u32,
        dtype: dtype.name().into(),
    }
}

impl AppState {
    /// Loads the model's tokenizer and template and sets up the worker pools.
    pub fn new(cfg: Config) -> Result<Self, RouterError> {
        let text = text::load(&cfg.model)
            .map_err(|e| RouterError::Internal(format!("loading {}: {e}", cfg.model.display())))?;
        let grammar_vocab = text::grammar::Vocab::new(&text.tokenizer, &text.config.eos_token_ids)
            .map_err(|e| {
                tracing::warn!(error = %e, "requests with a grammar will be refused");
                e.to_string()
            });
        let model_name = cfg.model_name.clone().unwrap_or_else(|| {
            let stem = if cfg.model.is_dir() {
                cfg.model.file_name()
            } else {
                cfg.model.file_stem()
            };
            stem.map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        let api_keys = Keys::load(&cfg.api_keys, cfg.api_key_file.as_deref())?;
        let settings = PoolSettings {
            dialer: runtime::Dialer {
                connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
                tls: cfg.tls.client()?,
                max_message: cfg.grpc_max_message_bytes,
                max_age: tls::MAX_CONNECTION_AGE,
            },
            breaker_failures: cfg.breaker_failures,
            breaker_cooldown: Duration::from_millis(cfg.breaker_cooldown_ms),
        };
        let expected = Expected {
            model: discovery::model_identity(&cfg.model),
            layout: cache_layout(&text.config, cfg.kv_cache_dtype),
            engine_version: runtime::VERSION.into(),
        };
        let policy = cfg.policy.build(cfg.affinity_slack_tokens);
        let static_prefill: &[String] = match cfg.mode {
            Mode::Pd => &cfg.prefill_nodes,
            Mode::Colocated => &[],
        };
        let prefill = Pool::new(
            "prefill",
            discovery::Role::Prefill,
            static_prefill,
            expected.clone(),
            settings.clone(),
            Arc::clone(&policy),
        )?;
        let decode_name = match cfg.mode {
            Mode::Pd => "decode",
            Mode::Colocated => "colocated",
        };
        let decode = Pool::new(
            decode_name,
            discovery::Role::Decode,
            &cfg.decode_nodes,
            expected,
            settings,
            policy,
        )?;
        let max_pos = text.config.max_position_embeddings;
        let max_seq_len = cfg.max_seq_len.min(max_pos);
        let max_prompt_tokens = cfg
            .max_input_token_len
            .min(max_seq_len.saturating_sub(1))
            .min(max_pos);
        let template_src = text.template.as_ref().map_or("", |t| t.source());
        // The generic format writes the tools into the prompt and parses Hermes markup.
        let generic = (Some(ToolFormat::Hermes), true);
        let (tool_format, tools_in_prompt) = match cfg.tool_call_parser {
            ToolCallParser::Auto => match ToolFormat::detect(template_src) {
                Some(taught) => (Some(taught), false),
                None => generic,
            },
            ToolCallParser::Generic => generic,
            ToolCallParser::None => (None, false),
            ToolCallParser::Hermes => (Some(ToolFormat::Hermes), false),
            ToolCallParser::Deepseek => (Some(ToolFormat::DeepSeek), false),
            ToolCallParser::Llama3Json => (Some(ToolFormat::Llama3Json), false),
            ToolCallParser::Mistral => (Some(ToolFormat::Mistral), false),
            ToolCallParser::MistralArgs => (Some(ToolFormat::MistralArgs), false),
            ToolCallParser::Phi4Mini => (Some(ToolFormat::Phi4Mini), false),
        };
        // The format's markers are special tokens, which the output must show its parser.
        let tool_markers = tool_format
            .map(ToolFormat::markers)
            .unwrap_or_default()
            .iter()
            .filter_map(|m| text.tokenizer.token_id(m))
            .collect();
        let think = match cfg.reasoning_parser {
            ReasoningParser::Auto => template_src.contains("</think>"),
            ReasoningParser::None => false,
            ReasoningParser::Think => true,
        };
        tracing::info!(?tool_format, tools_in_prompt, think, "chat output parsing");
        // A text of more bytes than this cannot be max_prompt_tokens tokens: every token
        // stands for at most the longest token's bytes, and a normalizer shrinks text by
        // less than four times (NFKC composes at most three bytes into one).
        let longest = (0..text.tokenizer.vocab_size() as u32)
            .filter_map(|id| text.tokenizer.token_bytes(id))
            .map(|b| b.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let max_prompt_bytes = max_prompt_tokens.saturating_mul(longest).saturating_mul(4);
        if cfg.log_prompts {
            tracing::warn!(
                "--log-prompts is on: the text of every prompt will be written to the logs; \
                 use it only for debugging, never with private data"
            );
        }
        let specials = match cfg.special_tokens_in_content {
            SpecialTokensInContent::Text => Some(
                text::specials::Specials::of(&text.tokenizer)
                    .map_err(|e| RouterError::Internal(format!("the tokenizer: {e}")))?,
            ),
            SpecialTokensInContent::Special => None,
        };
        let text = Arc::new(text);
        let metrics = Arc::<Metrics>::default();
        let render = Render {
            text: Arc::clone(&text),
            model: model_name.as_str().into(),
            full_text: cfg.full_text_enabled,
            metrics: Arc::clone(&metrics),
        };
        Ok(Self {
            tool_format,
            tool_markers,
            tools_in_prompt,
            think,
            specials,
            cfg,
            model_name,
            text,
            grammar_vocab,
            prefill,
            decode,
            max_prompt_tokens,
            max_prompt_bytes,
            json_limits: crate::api::json::JsonLimits::for_prompts(max_prompt_tokens),
            max_seq_len,
            preparing: runtime::Turns::new(runtime::usable_cpus()),
            metrics,
            render,
            started: Instant::now(),
            api_keys,
            degraded: AtomicBool::new(false),
            retry_budget: RetryBudget::default(),
        })
    }

    /// Where the worker set comes from, and whether that source answers.
    pub fn discovery(&self) -> Discovery {
        if self.cfg.etcd_endpoints.is_empty() && self.cfg.kube.kube_selector.is_none() {
            Discovery::Static
        } else if self.degraded.load(Ordering::Relaxed) {
            Discovery::Degraded
        } else {
            Discovery::Ok
        }
    }

    /// Keeps the pools in step with discovery and the workers' health until the process
    /// ends: a watch of etcd's registrations or of Kubernetes' EndpointSlices (when either
    /// is configured) and periodic health probes.
    pub async fn spawn_background(self: &Arc<Self>) -> Result<(), RouterError> {
        self.metrics.spawn_upkeep();
        let interval = Duration::from_millis(self.cfg.health_interval_ms.max(10));
        // A probe may take as long as the interval, but no longer than a paused worker
        // deserves.
        let probe_timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(2));
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(state) = weak.upgrade() else { return };
                tokio::join!(
                    state.prefill.probe_all(probe_timeout),
                    state.decode.probe_all(probe_timeout)
                );
            }
        });
        let relist = Duration::from_millis(self.cfg.relist_interval_ms.max(100));
        let (tx, mut rx) = tokio::sync::watch::channel(discovery::WorkerSet::default());
        if self.cfg.etcd_endpoints.is_empty() {
            let found = self.cfg.kube.follow(relist, tx).await;
            if !found.map_err(|e| RouterError::Internal(e.to_string()))? {
                return Ok(());
            }
        } else {
            let client = self
                .cfg
                .etcd
                .client(&self.cfg.etcd_endpoints)
                .map_err(|e| RouterError::Internal(format!("etcd: {e}")))?;
            tokio::spawn(discovery::watch_workers(
                Arc::new(client),
                self.cfg.etcd_prefix.clone(),
                relist,
                tx,
            ));
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let Some(state) = weak.upgrade() else { return };
                let set = rx.borrow_and_update().clone();
                state.degraded.store(set.degraded, Ordering::Relaxed);
                if set.synced {
                    state.prefill.sync(&set.workers);
                    state.decode.sync(&set.workers);
                }
                // New workers are probed at once rather than at the next tick.
                tokio::join!(
                    state.prefill.probe_all(probe_timeout),
                    state.decode.probe_all(probe_timeout)
                );
            }
        });
        Ok(())
    }

    /// The key an `Authorization` header value carries, if it may call the API.
    pub fn authorize(&self, header: Option<&str>) -> Result<Option<Arc<Key>>, RouterError> {
        self.api_keys.authorize(header)
    }

    /// The response for `e` in the configured error format.
    pub fn error_response(&self, e: RouterError) -> axum::response::Response {
        e.response_in(self.cfg.error_format)
    }

    /// Tokens each sequence of a request with `prompt_tokens` may get
    /// ([`crate::budget::completion_budget`]).
    pub fn completion_budget(&self, max_tokens: Option<u64>, prompt_tokens: usize) -> usize {
        crate::budget::completion_budget(
            self.cfg.mode,
            self.cfg.max_iter_times,
            self.max_seq_len - prompt_tokens,
            max_tokens,
        )
    }
}
