//! One request as validated (as TGI's `ValidGenerateRequest`): its body parsed and checked,
//! its chat template rendered, its prompt tokenized, its limits worked out. `prepare` makes
//! it; the rest of the pipeline reads it: the workers' request is built from it in one
//! place ([`Valid::request`]), and its output from its [`OutputSpec`].

use std::sync::Arc;

use axum::body::Bytes;
use text::structured::Parser;
use tokio::sync::watch;

use crate::api;
use crate::api::json::JsonBudget;
use crate::dispatch::{EndedChoices, GenRequest, Width};
use crate::error::{ErrorFormat, RouterError};
use crate::output::{Echo, Kind, OutputSpec, Stopping};
use crate::params::{self, Common, Constrained};
use crate::state::AppState;
use crate::stops::StopStrings;
use proto::limits::MAX_STOP_TOKEN_IDS;

/// What names a request's response, fixed when it arrives (before its body is read).
#[derive(Debug, Clone)]
pub(crate) struct Stamp {
    /// The endpoint it came in on.
    pub(crate) kind: Kind,
    /// The response's id (`chatcmpl-…`, `cmpl-…`).
    pub(crate) id: String,
    /// Seed 001: `created` is "推理请求时间戳，精确到秒" (the inference request's timestamp,
    /// to the second), so it is taken on arrival, not when the first token comes.
    pub(crate) created: u64,
}

/// A request parsed, validated, templated and tokenized.
pub(crate) struct Valid {
    pub(crate) prompt: Vec<u32>,
    pub(crate) sampling: proto::v1::SamplingParams,
    /// What the output must match, not yet checked against the vocabulary: that can take
    /// long, so it is done on the blocking pool ([`Valid::check_grammar`]).
    pub(crate) grammar: Option<Constrained>,
    /// Completion tokens allowed in all: `max_tokens` within the context and the mode's
    /// budget.
    pub(crate) max_tokens: usize,
    pub(crate) width: Width,
    /// Alternatives reported with each token.
    pub(crate) top_logprobs: usize,
    pub(crate) stream: bool,
    /// The choices the output ended by a stop string while others go on, for the decode
    /// node to stop decoding them; the sending half is the output's.
    pub(crate) ended: Option<watch::Receiver<EndedChoices>>,
    pub(crate) output: OutputSpec,
}

impl Valid {
    /// Splits the request into what the workers run, built here alone, and what its
    /// output needs: `log_id` names it in the nodes' logs, `cache_partition` is its API
    /// key's prefix-cache partition (empty without keys).
    pub(crate) fn into_parts(self, log_id: String, cache_partition: Vec<u8>) -> Parts {
        let request = GenRequest {
            id: self.output.id.clone(),
            log_id,
            prompt: self.prompt,
            sampling: self.sampling,
            max_tokens: self.max_tokens,
            stop_ids: self.output.stopping.ids.clone(),
            top_logprobs: self.top_logprobs,
            width: self.width,
            cache_partition,
            prompt_logprobs: self.output.echo.is_some() && self.output.logprobs,
            ended: self.ended,
            resumed: 0,
            spent: None,
        };
        Parts {
            request,
            output: self.output,
        }
    }

    /// The most tokens the request can use: its prompt and every sequence's budget (a
    /// beam search runs best_of sequences, of which it reports n).
    pub(crate) fn worst_case(&self) -> u64 {
        let sequences = self.width.best_of.max(self.width.reported());
        (self.prompt.len() + self.max_tokens * sequences) as u64
    }
}

/// A validated request split in two: what the workers run and what its output needs.
pub(crate) struct Parts {
    pub(crate) request: GenRequest,
    pub(crate) output: OutputSpec,
}

/// A request of either endpoint, as typed.
enum Request {
    Chat(api::chat::ChatRequest),
    Completion(api::completions::CompletionRequest),
}

/// A prompt as given: its text, and its tokens when the client sent token ids.
struct Given {
    text: String,
    tokens: Option<Vec<u32>>,
    /// The parameter the prompt came in, for the errors about it.
    param: &'static str,
    logprobs: Option<usize>,
    parser: Option<text::structured::Parser>,
    echo: bool,
}

/// Parses and validates a request's body, renders its chat template and tokenizes its
/// prompt: the work whose cost grows with the input, run on the blocking pool. Text longer
/// than any prompt of `max_prompt_tokens` can be is refused before it is tokenized.
pub(crate) fn prepare(state: &AppState, stamp: Stamp, body: Bytes) -> Result<Valid, RouterError> {
    let kind = stamp.kind;
    let json = JsonBudget::new(state.json_limits);
    let o = json.object(&body)?;
    // Parsed: a large body need not be held beside its values.
    drop(body);
    let vocab = state.text.config.vocab_size;
    let stops = match state.cfg.error_format {
        ErrorFormat::Provider => params::StopLimits::PROVIDER,
        ErrorFormat::Openai => params::StopLimits::MINDIE,
    };
    let (mut common, request) = match kind {
        Kind::Chat => {
            let r = api::chat::ChatRequest::from_object(o)?;
            params::known_fields(&r.extra, "")?;
            (
                params::common(&r.sampling, vocab, stops, &json)?,
                Request::Chat(r),
            )
        }
        Kind::Completion => {
            let r = api::completions::CompletionRequest::from_object(o)?;
            params::known_fields(&r.extra, "")?;
            (
                params::common(&r.sampling, vocab, stops, &json)?,
                Request::Completion(r),
            )
        }
    };
    if common.model != state.model_name {
        return Err(RouterError::ModelNotFound(common.model));
    }
    let mut given = given(state, request, &json, &mut common)?;
    let prompt = tokenized(state, kind, &mut given)?;
    validated(state, stamp, common, given, prompt)
}

/// The prompt a request gives, rendered by the chat template for a chat.
fn given(
    state: &AppState,
    request: Request,
    json: &JsonBudget,
    common: &mut Common,
) -> Result<Given, RouterError> {
    Ok(match request {
        Request::Chat(r) => {
            let chat = params::chat(r, json)?;
            let (text, parser) = crate::chat::prompt(state, &chat, common)?;
            Given {
                text,
                tokens: None,
                param: "messages",
                logprobs: chat.logprobs,
                parser,
                echo: false,
            }
        }
        Request::Completion(r) => {
            let c = params::completion(&r, state.text.config.vocab_size)?;
            let (text, tokens) = match c.prompt {
                params::Prompt::Text(t) => (t, None),
                params::Prompt::Tokens(ids) => {
                    // Shown by echo and --log-prompts as the model reads it.
                    let text = state
                        .text
                        .tokenizer
                        .decode(&ids, false)
                        .map_err(|e| RouterError::param("prompt", e.to_string()))?;
                    (text, Some(ids))
                }
            };
            Given {
                text,
                tokens,
                param: "prompt",
                logprobs: c.logprobs,
                parser: None,
                echo: c.echo,
            }
        }
    })
}

/// The prompt's tokens, within `max_prompt_tokens`: a client's token ids are taken from
/// `given`, not copied.
fn tokenized(state: &AppState, kind: Kind, given: &mut Given) -> Result<Vec<u32>, RouterError> {
    let (text, param) = (&given.text, given.param);
    if state.cfg.log_prompts {
        // Inside the request's span, so the line carries its req_id.
        tracing::info!(prompt = ?crate::chat::shown(state, text), "prompt");
    }
    if given.tokens.is_none() && text.len() > state.max_prompt_bytes {
        return Err(RouterError::param(
            param,
            format!(
                "the prompt is {} bytes, more than {} tokens (the limit) can be",
                text.len(),
                state.max_prompt_tokens
            ),
        ));
    }
    let prompt = match (given.tokens.take(), kind) {
        (Some(ids), _) => ids,
        (None, Kind::Chat) => crate::chat::encode(state, text)?,
        (None, Kind::Completion) => state
            .text
            .tokenizer
            .encode(text)
            .map_err(|e| RouterError::param(param, e.to_string()))?,
    };
    tracing::Span::current().record("prompt_tokens", runtime::otel::count(prompt.len()));
    if prompt.len() > state.max_prompt_tokens {
        return Err(RouterError::PromptTooLong {
            param,
            got: prompt.len(),
            limit: state.max_prompt_tokens,
        });
    }
    Ok(prompt)
}

/// The one value the rest of the request reads.
fn validated(
    state: &AppState,
    stamp: Stamp,
    common: Common,
    given: Given,
    prompt: Vec<u32>,
) -> Result<Valid, RouterError> {
    let width = Width {
        n: common.n,
        best_of: common.best_of,
        beam: common.beam,
    };
    let stopping = Stopping {
        ids: stop_ids(
            &state.text.config.eos_token_ids,
            common.ignore_eos,
            &common.stop_token_ids,
        )?,
        user_ids: common.stop_token_ids,
        strings: StopStrings::new(
            common.stop,
            common.include_stop_str_in_output,
            common.min_tokens,
        ),
    };
    // Only a choice among several can end while others go on.
    let (ended_tx, ended) = if width.best_of > 1 && !stopping.strings.is_empty() {
        let (tx, rx) = watch::channel(EndedChoices::default());
        (Some(Arc::new(tx)), Some(rx))
    } else {
        (None, None)
    };
    let echo = given.echo.then(|| Echo::new(given.text, prompt.clone()));
    Ok(Valid {
        max_tokens: state.completion_budget(common.max_tokens, prompt.len()),
        output: OutputSpec {
            kind: stamp.kind,
            id: stamp.id,
            created: stamp.created,
            prompt_tokens: prompt.len(),
            stopping,
            logprobs: given.logprobs.is_some(),
            n: width.n,
            sequences: width.reported(),
            skip_special_tokens: common.skip_special_tokens,
            kept_specials: match given.parser.as_ref().and_then(Parser::format) {
                Some(_) => state.tool_markers.clone(),
                None => Default::default(),
            },
            parser: given.parser,
            include_usage: common.include_usage,
            echo,
            ended: ended_tx,
        },
        prompt,
        sampling: common.sampling,
        grammar: common.grammar,
        width,
        top_logprobs: given.logprobs.unwrap_or(0),
        stream: common.stream,
        ended,
    })
}

/// The tokens that end a request's sequences: the model's end tokens (unless `ignore_eos`)
/// and the request's `stop_token_ids`, each once, within the limit the nodes hold them to.
pub(crate) fn stop_ids(
    eos: &[u32],
    ignore_eos: bool,
    requested: &[u32],
) -> Result<Vec<u32>, RouterError> {
    let mut ids = if ignore_eos { Vec::new() } else { eos.to_vec() };
    ids.extend(requested);
    ids.sort_unstable();
    ids.dedup();
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(RouterError::param(
            "stop_token_ids",
            format!(
                "stop_token_ids and the model's end tokens are {} distinct ids, the limit is \
                 {MAX_STOP_TOKEN_IDS}",
                ids.len()
            ),
        ));
    }
    Ok(ids)
}
