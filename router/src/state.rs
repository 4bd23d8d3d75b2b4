//! What every handler shares.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, Mode, ReasoningParser, ToolCallParser};
use crate::error::RouterError;
use crate::keys::{Key, Keys};
use crate::metrics::Metrics;
use crate::structured::ToolFormat;
use crate::workers::Pool;

/// The router's shared state.
pub struct AppState {
    pub cfg: Config,
    /// The name requests must give as `model`.
    pub model_name: String,
    pub text: engine::TextModel,
    pub prefill: Pool,
    pub decode: Pool,
    /// Most prompt tokens: min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings).
    pub max_prompt_tokens: usize,
    /// maxSeqLen capped by the model's context.
    pub max_seq_len: usize,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    /// The tool-call markup chat output is parsed for; `None` refuses tools.
    pub tool_format: Option<ToolFormat>,
    /// Whether `<think>` blocks go to `reasoning_content`.
    pub think: bool,
    /// Accepted API keys; none means the API is open.
    api_keys: Keys,
}

impl AppState {
    /// Loads the model's tokenizer and template and sets up the worker pools.
    pub fn new(cfg: Config) -> Result<Self, RouterError> {
        let text = engine::load_text(&cfg.model)
            .map_err(|e| RouterError::Internal(format!("loading {}: {e}", cfg.model.display())))?;
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
        let connect = Duration::from_millis(cfg.connect_timeout_ms);
        let prefill = match cfg.mode {
            Mode::Pd => Pool::new("prefill", &cfg.prefill_nodes, connect)?,
            Mode::Colocated => Pool::new("prefill", &[], connect)?,
        };
        let decode_role = match cfg.mode {
            Mode::Pd => "decode",
            Mode::Colocated => "colocated",
        };
        let decode = Pool::new(decode_role, &cfg.decode_nodes, connect)?;
        let max_pos = text.config.max_position_embeddings;
        let max_seq_len = cfg.max_seq_len.min(max_pos);
        let max_prompt_tokens = cfg
            .max_input_token_len
            .min(max_seq_len.saturating_sub(1))
            .min(max_pos);
        let template_src = text.template.as_ref().map_or("", |t| t.source());
        let tool_format = match cfg.tool_call_parser {
            ToolCallParser::Auto => ToolFormat::detect(template_src),
            ToolCallParser::None => None,
            ToolCallParser::Hermes => Some(ToolFormat::Hermes),
            ToolCallParser::Deepseek => Some(ToolFormat::DeepSeek),
        };
        let think = match cfg.reasoning_parser {
            ReasoningParser::Auto => template_src.contains("</think>"),
            ReasoningParser::None => false,
            ReasoningParser::Think => true,
        };
        tracing::info!(?tool_format, think, "chat output parsing");
        Ok(Self {
            tool_format,
            think,
            cfg,
            model_name,
            text,
            prefill,
            decode,
            max_prompt_tokens,
            max_seq_len,
            metrics: Arc::default(),
            started: Instant::now(),
            api_keys,
        })
    }

    /// The key an `Authorization` header value carries, if it may call the API.
    pub fn authorize(&self, header: Option<&str>) -> Result<Option<Arc<Key>>, RouterError> {
        self.api_keys.authorize(header)
    }

    /// The response for `e` in the configured error format.
    pub fn error_response(&self, e: RouterError) -> axum::response::Response {
        e.response_in(self.cfg.error_format)
    }

    /// Completion tokens a request may get in all. With PD and no smaller explicit
    /// max_tokens, the decode node makes maxIterTimes tokens after the prefill node's first
    /// (the seeds' maxIterTimes + 1); an explicit max_tokens at or below maxIterTimes is never
    /// exceeded. The context (maxSeqLen) caps both.
    pub fn completion_budget(&self, max_tokens: Option<u64>, prompt_tokens: usize) -> usize {
        let iter = self.cfg.max_iter_times;
        let wanted = match (self.cfg.mode, max_tokens) {
            (_, Some(m)) if m as usize <= iter => m as usize,
            (Mode::Pd, _) => iter + 1,
            (Mode::Colocated, _) => iter,
        };
        wanted.min(self.max_seq_len - prompt_tokens).max(1)
    }
}
