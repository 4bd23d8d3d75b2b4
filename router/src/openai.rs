//! The OpenAI-style endpoints in the seeds' shapes: chat and text completions, streamed
//! (SSE) and not, with MindIE's usage fields.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use proto::v1::FinishReason;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use crate::api;
use crate::dispatch::{self, GenRequest, Piece, Pieces, TokenStat};
use crate::error::RouterError;
use crate::keys::{Key, QuotaHold};
use crate::metrics::InFlight;
use crate::params::{self, ToolChoice};
use crate::state::AppState;
use crate::stops::{Scan, StopStrings};
use text::structured::{prompt_opens_reasoning, Parser};
use text::tools::ToolCall;

/// Bodies up to this size are parsed, templated and tokenized on the thread serving the
/// connection: a few thousand tokens at most, about a millisecond, a bounded stall; the hop
/// to the blocking pool would cost every request two thread switches, and a one-thread
/// router (`--threads 1`) its single thread. Larger bodies go to the blocking pool.
const INLINE_BODY_BYTES: usize = 16 << 10;

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
        }
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(state): State<Arc<AppState>>,
    key: Option<Extension<Arc<Key>>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, Kind::Chat, key.map(|k| k.0), (headers, body)).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    key: Option<Extension<Arc<Key>>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, Kind::Completion, key.map(|k| k.0), (headers, body)).await
}

/// Reads a request's body, after its in-flight slot is taken: a body announced over
/// `--max-body-bytes` is refused before a byte of it is read, a chunked one as soon as its
/// bytes pass the limit, and one that takes longer than `--body-timeout-ms` gets 408.
async fn read_body(
    state: &AppState,
    (headers, body): (HeaderMap, Body),
) -> Result<Bytes, RouterError> {
    use http_body_util::BodyExt;
    let max = state.cfg.max_body_bytes;
    let announced = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max as u64) {
        return Err(RouterError::BodyTooLarge(max));
    }
    let limit = state.cfg.body_timeout_ms;
    let read = http_body_util::Limited::new(body, max).collect();
    match tokio::time::timeout(std::time::Duration::from_millis(limit), read).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(RouterError::BodyTooLarge(max))
        }
        Ok(Err(e)) => Err(RouterError::InvalidJson(format!(
            "the request body could not be read: {e}"
        ))),
        Err(_) => {
            state.metrics.body_timed_out();
            Err(RouterError::BodyTimeout(limit))
        }
    }
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let created = unix_now() - state.started.elapsed().as_secs();
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": created, "owned_by": "tandem",
        "max_model_len": state.max_seq_len,
    }]}))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn handle(
    state: Arc<AppState>,
    kind: Kind,
    key: Option<Arc<Key>>,
    body: (HeaderMap, Body),
) -> Response {
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let id = format!(
        "{prefix}-{:016x}{:016x}",
        params::random_u64(),
        params::random_u64()
    );
    let span = tracing::info_span!("request", req_id = %id, endpoint = kind.endpoint(),
        prompt_tokens = tracing::field::Empty);
    let admitted = state.metrics.start(
        state.cfg.max_in_flight,
        key.clone(),
        state.cfg.max_in_flight_per_key,
    );
    let result = match admitted {
        Ok(in_flight) => {
            run(&state, kind, id, key, body, in_flight)
                .instrument(span)
                .await
        }
        Err(e) => Err(e),
    };
    let response = match result {
        Ok(r) => r,
        Err(e) => state.error_response(e),
    };
    state
        .metrics
        .finished(kind.endpoint(), response.status().as_u16());
    response
}

async fn run(
    state: &Arc<AppState>,
    kind: Kind,
    id: String,
    key: Option<Arc<Key>>,
    body: (HeaderMap, Body),
    mut in_flight: InFlight,
) -> Result<Response, RouterError> {
    let arrived = Instant::now();
    let body = read_body(state, body).await?;
    let Prepared {
        common,
        prompt,
        logprobs,
        parser,
    } = if body.len() <= INLINE_BODY_BYTES {
        prepare(state, kind, &body)?
    } else {
        let _turn = state
            .preparing
            .acquire()
            .await
            .map_err(|_| RouterError::Internal("the router is stopping".into()))?;
        let (st, span) = (Arc::clone(state), tracing::Span::current());
        tokio::task::spawn_blocking(move || span.in_scope(|| prepare(&st, kind, &body)))
            .await
            .map_err(|e| RouterError::Internal(format!("preparing the request: {e}")))??
    };
    if common.stream {
        // Held by the streaming task with the in-flight slot, so both end with the stream.
        in_flight.open_stream(state.cfg.max_streams)?;
    }
    let mut stop_ids = if common.ignore_eos {
        Vec::new()
    } else {
        state.text.config.eos_token_ids.clone()
    };
    stop_ids.extend(&common.stop_token_ids);
    let req = GenRequest {
        id: id.clone(),
        max_tokens: state.completion_budget(common.max_tokens, prompt.len()),
        prompt,
        sampling: common.sampling,
        stop_ids: stop_ids.clone(),
        top_logprobs: logprobs.unwrap_or(0),
        sequences: common.best_of,
        beam: common.beam.then_some(common.n),
        cache_partition: key
            .as_ref()
            .map_or_else(Vec::new, |k| k.cache_partition().to_vec()),
    };
    let prompt_tokens = req.prompt.len();
    // Beam search returns its n best hypotheses; sampling all best_of sequences.
    let sequences = req.reported();
    let worst = prompt_tokens + req.max_tokens * req.sequences.max(sequences);
    let hold = key.as_ref().map(|k| k.hold(worst as u64)).transpose()?;
    // A non-streamed request has sent nothing yet when a worker fails mid-way, so it can
    // start over (same seed, same tokens) where a stream has to end with an error.
    let restart = (!common.stream).then(|| req.clone());
    let (mut first, mut rest) = dispatch::start(state, req).await?;
    let output = |first_at| Output {
        state: Arc::clone(state),
        kind,
        id: id.clone(),
        created: unix_now(),
        prompt_tokens,
        stop_ids: stop_ids.clone(),
        user_stop_ids: common.stop_token_ids.clone(),
        stops: StopStrings::new(common.stop.clone(), common.include_stop_str_in_output),
        logprobs: logprobs.is_some(),
        n: common.n,
        choices: (0..sequences)
            .map(|_| ChoiceOut::new(common.skip_special_tokens, parser.clone()))
            .collect(),
        tally: Tally::default(),
        first_at,
        hold: None,
    };
    let first_at = Instant::now();
    state.metrics.ttft.observe(first_at - arrived);
    let mut out = output(first_at);
    out.hold = hold;
    let Some(req) = restart else {
        return Ok(if common.beam {
            stream_whole(out, first, rest, in_flight)
        } else {
            stream(out, first, rest, in_flight)
        });
    };
    let mut restarts = 0;
    loop {
        match drain(&mut out, first, rest).await {
            Ok(()) => return Ok(Json(out.response()).into_response()),
            Err(e)
                if e.retryable()
                    && restarts + 1 < state.cfg.max_attempts
                    && state.retry_budget.spend() =>
            {
                restarts += 1;
                tracing::warn!(error = %e, restart = restarts,
                    "a worker failed before the answer was sent; starting the generation again");
                state.metrics.retried();
                // The key pays for the answer it gets, not for the attempt that failed: the
                // hold moves to the new attempt's output, and the failed one charges nothing.
                let hold = out.hold.take();
                (first, rest) = dispatch::start(state, req.clone()).await?;
                out = output(Instant::now());
                out.hold = hold;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A request parsed, validated, templated and tokenized.
/// A request of either endpoint, as typed.
enum Request {
    Chat(api::chat::ChatRequest),
    Completion(api::completions::CompletionRequest),
}

struct Prepared {
    common: params::Common,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
    parser: Option<Parser>,
}

/// Parses and validates a request's body, renders its chat template and tokenizes its
/// prompt: the work whose cost grows with the input, run on the blocking pool. Text longer
/// than any prompt of `max_prompt_tokens` can be is refused before it is tokenized.
fn prepare(state: &AppState, kind: Kind, body: &[u8]) -> Result<Prepared, RouterError> {
    let o = api::object(body)?;
    let vocab = state.text.config.vocab_size;
    let (common, request) = match kind {
        Kind::Chat => {
            let r = api::chat::ChatRequest::from_object(o)?;
            (params::common(&r.sampling, vocab)?, Request::Chat(r))
        }
        Kind::Completion => {
            let r = api::completions::CompletionRequest::from_object(o)?;
            (params::common(&r.sampling, vocab)?, Request::Completion(r))
        }
    };
    if common.model != state.model_name {
        return Err(RouterError::ModelNotFound(common.model));
    }
    let (text, param, logprobs, parser) = match request {
        Request::Chat(r) => {
            let chat = params::chat(&r)?;
            let template = state
                .text
                .template
                .as_ref()
                .ok_or(RouterError::NoChatTemplate)?;
            let mut text = text::tools::render(template, &chat.input)
                .map_err(|e| RouterError::Template(e.to_string()))?;
            let parser = chat_parser(state, &chat.tool_choice, &mut text)?;
            (text, "messages", chat.logprobs, parser)
        }
        Request::Completion(r) => {
            let c = params::completion(&r)?;
            (c.prompt, "prompt", c.logprobs, None)
        }
    };
    if state.cfg.log_prompts {
        // Inside the request's span, so the line carries its req_id.
        tracing::info!(prompt = ?text, "prompt");
    }
    if text.len() > state.max_prompt_bytes {
        return Err(RouterError::param(
            param,
            format!(
                "the prompt is {} bytes, more than {} tokens (the limit) can be",
                text.len(),
                state.max_prompt_tokens
            ),
        ));
    }
    let prompt = state
        .text
        .tokenizer
        .encode(&text)
        .map_err(|e| RouterError::param(param, e.to_string()))?;
    tracing::Span::current().record("prompt_tokens", prompt.len());
    if prompt.len() > state.max_prompt_tokens {
        return Err(RouterError::PromptTooLong {
            param,
            got: prompt.len(),
            limit: state.max_prompt_tokens,
        });
    }
    Ok(Prepared {
        common,
        prompt,
        logprobs,
        parser,
    })
}

/// The parser for a chat's output, if it needs one, with the prompt extended by what
/// forces a required or named tool call.
fn chat_parser(
    state: &AppState,
    choice: &ToolChoice,
    prompt: &mut String,
) -> Result<Option<Parser>, RouterError> {
    let tools = match (choice, state.tool_format) {
        (ToolChoice::None, _) => None,
        (_, Some(f)) => Some(f),
        (_, None) => {
            return Err(RouterError::param(
                "tools",
                "tool calls cannot be returned for this model: its chat template teaches no \
                 tool-call format the router parses (see --tool-call-parser)",
            ))
        }
    };
    if tools.is_none() && !state.think {
        return Ok(None);
    }
    let parser = Parser::new(state.think, tools, prompt_opens_reasoning(prompt));
    let forced = match (choice, tools) {
        (ToolChoice::Required, Some(f)) => Some(f.forced(None)),
        (ToolChoice::Named(name), Some(f)) => Some(f.forced(Some(name))),
        _ => None,
    };
    Ok(Some(match forced {
        Some((suffix, body)) => {
            prompt.push_str(&suffix);
            parser.forced(body)
        }
        None => parser,
    }))
}

/// Per-token figures the usage reports, over every sequence.
#[derive(Debug, Default)]
struct Tally {
    completion_tokens: usize,
    batch_size: Vec<u32>,
    queue_wait_us: Vec<u64>,
    prefill_ms: f64,
    decode_ms: Vec<f64>,
    cached_tokens: u32,
}

/// Milliseconds to three decimals.
fn ms(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// A token as logprobs show it: its text (OpenAI's `bytes:\xNN...` when it is only part
/// of a character) and its bytes.
#[derive(Debug, Clone)]
struct Shown {
    text: String,
    bytes: Vec<u8>,
}

/// One token's logprob and alternatives, with its text and where that text starts.
#[derive(Debug, Clone)]
struct LogprobEntry {
    token: Shown,
    logprob: f32,
    top: Vec<(Shown, f32)>,
    /// Characters of output before this token's text.
    offset: usize,
}

/// What one token (or the end) of a choice let out to the client.
#[derive(Debug, Default)]
struct Released {
    content: String,
    reasoning: String,
    /// The new calls, as indices into the choice's `calls`.
    calls: std::ops::Range<usize>,
}

/// One sequence's output as it grows.
struct ChoiceOut {
    decoder: text::IncrementalDecoder,
    /// Decoded text; past a matched stop string it is cut where the output ends.
    text: String,
    text_chars: usize,
    /// Bytes of `text` already released to the client.
    sent: usize,
    /// Splits released chat text into reasoning, content and tool calls.
    parser: Option<Parser>,
    /// Released text that is content (all of it without a parser).
    content: String,
    reasoning: String,
    /// Tool calls with their ids.
    calls: Vec<(String, ToolCall)>,
    stop_reason: Value,
    /// A stop string ended the output: its later tokens are ignored.
    stopped: bool,
    finish: Option<FinishReason>,
    /// Sum of its tokens' logprobs: how best_of ranks sequences.
    cumulative_logprob: f64,
    entries: Vec<LogprobEntry>,
}

impl ChoiceOut {
    fn new(skip_special: bool, parser: Option<Parser>) -> Self {
        Self {
            decoder: text::IncrementalDecoder::new(skip_special),
            text: String::new(),
            text_chars: 0,
            sent: 0,
            parser,
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            stop_reason: Value::Null,
            stopped: false,
            finish: None,
            cumulative_logprob: 0.0,
            entries: Vec::new(),
        }
    }

    fn append(&mut self, piece: &str, stops: &StopStrings) {
        let old = self.text.len();
        self.text.push_str(piece);
        self.text_chars += piece.chars().count();
        if let Scan::Stop { end, which } = stops.scan(&self.text, old) {
            self.text.truncate(end);
            self.text_chars = self.text.chars().count();
            self.stop_reason = json!(stops.get(which));
            self.stopped = true;
        }
    }

    /// Lets out the text now free to go (`all` at the end of the output), through the
    /// parser when there is one.
    fn release(&mut self, stops: &StopStrings, all: bool) -> Released {
        let upto = if all || self.stopped {
            self.text.len()
        } else {
            match stops.scan(&self.text, self.text.len()) {
                Scan::Release(n) => n,
                Scan::Stop { end, .. } => end,
            }
        };
        let upto = upto.max(self.sent);
        let text = &self.text[self.sent..upto];
        self.sent = upto;
        let Some(parser) = &mut self.parser else {
            self.content.push_str(text);
            return Released {
                content: text.to_string(),
                ..Released::default()
            };
        };
        let mut d = parser.feed(text);
        if all {
            let end = parser.finish();
            d.reasoning.push_str(&end.reasoning);
            d.content.push_str(&end.content);
            d.calls.extend(end.calls);
        }
        self.content.push_str(&d.content);
        self.reasoning.push_str(&d.reasoning);
        let first = self.calls.len();
        self.calls
            .extend(d.calls.into_iter().map(|c| (call_id(), c)));
        Released {
            content: d.content,
            reasoning: d.reasoning,
            calls: first..self.calls.len(),
        }
    }
}

/// A tool call id as OpenAI writes them.
fn call_id() -> String {
    format!(
        "call_{:016x}{:08x}",
        params::random_u64(),
        params::random_u64() as u32
    )
}

/// One request's output: one `ChoiceOut` per generated sequence.
struct Output {
    state: Arc<AppState>,
    kind: Kind,
    id: String,
    created: u64,
    prompt_tokens: usize,
    /// Every id that ends generation (EOS unless ignored, and stop_token_ids).
    stop_ids: Vec<u32>,
    /// The request's own stop_token_ids, reported as `stop_reason`.
    user_stop_ids: Vec<u32>,
    stops: StopStrings,
    /// Whether the request asked for logprobs.
    logprobs: bool,
    /// Choices returned (the best n of the sequences when best_of > n).
    n: usize,
    choices: Vec<ChoiceOut>,
    tally: Tally,
    /// When the first token arrived.
    first_at: Instant,
    /// What the request holds of its API key's quota, charged for the tokens it used.
    hold: Option<QuotaHold>,
}

impl Drop for Output {
    /// Charges the key for every token the request used, also when the client left early;
    /// the hold then gives back the rest.
    fn drop(&mut self) {
        if let Some(hold) = &self.hold {
            hold.charge((self.prompt_tokens + self.tally.completion_tokens) as u64);
        }
    }
}

impl Output {
    fn shown(&self, id: u32) -> Shown {
        let bytes = self
            .state
            .text
            .tokenizer
            .token_bytes(id)
            .unwrap_or_default();
        let text = match std::str::from_utf8(&bytes) {
            Ok(s) => s.to_string(),
            Err(_) => bytes.iter().fold(String::from("bytes:"), |mut s, b| {
                s.push_str(&format!("\\x{b:02x}"));
                s
            }),
        };
        Shown { text, bytes }
    }

    fn choice_mut(&mut self, choice: u32) -> Result<&mut ChoiceOut, RouterError> {
        self.choices
            .get_mut(choice as usize)
            .ok_or_else(|| RouterError::Internal(format!("a token for unknown choice {choice}")))
    }

    /// Counts a token and returns what it releases for its choice (nothing while a
    /// character is split or the text could still become a stop string or markup), or
    /// `None` when that choice has already ended.
    fn push(&mut self, t: &TokenStat) -> Result<Option<Released>, RouterError> {
        if self.choice_mut(t.choice)?.finish.is_some() {
            return Ok(None);
        }
        let tally = &mut self.tally;
        tally.completion_tokens += 1;
        tally.batch_size.push(t.batch_size);
        tally.queue_wait_us.push(t.queue_wait_us);
        if t.from_prefill {
            tally.prefill_ms = t.step_ms;
            tally.cached_tokens = t.cached_tokens;
        } else {
            tally.decode_ms.push(ms(t.step_ms));
        }
        let entry = self.logprobs.then(|| LogprobEntry {
            token: self.shown(t.id),
            logprob: t.logprob,
            top: t.top.iter().map(|&(id, lp)| (self.shown(id), lp)).collect(),
            offset: 0,
        });
        let is_stop = self.stop_ids.contains(&t.id);
        let user_stop = self.user_stop_ids.contains(&t.id);
        let piece = if is_stop {
            // A stop token ends the output and is not part of its text.
            String::new()
        } else {
            let tokenizer = &self.state.text.tokenizer;
            let choice = &mut self.choices[t.choice as usize];
            choice
                .decoder
                .push(tokenizer, t.id)
                .map_err(|e| RouterError::Internal(e.to_string()))?
                .unwrap_or_default()
        };
        let stops = &self.stops;
        let choice = &mut self.choices[t.choice as usize];
        choice.cumulative_logprob += f64::from(t.logprob);
        if let Some(mut e) = entry {
            e.offset = choice.text_chars;
            choice.entries.push(e);
        }
        if user_stop {
            choice.stop_reason = json!(t.id);
        }
        choice.append(&piece, stops);
        Ok(Some(choice.release(stops, false)))
    }

    /// Ends a choice: returns what it still held back.
    fn finish(&mut self, choice: u32, reason: FinishReason) -> Result<Released, RouterError> {
        let tokenizer = &self.state.text.tokenizer;
        let stops = &self.stops;
        let c = self.choices.get_mut(choice as usize).ok_or_else(|| {
            RouterError::Internal(format!("a finish for unknown choice {choice}"))
        })?;
        if !c.stopped {
            let rest = c
                .decoder
                .flush(tokenizer)
                .map_err(|e| RouterError::Internal(e.to_string()))?
                .unwrap_or_default();
            c.append(&rest, stops);
        }
        c.finish = Some(if c.stopped {
            FinishReason::Stop
        } else {
            reason
        });
        let rest = c.release(stops, true);
        if self.all_finished() {
            self.record();
        }
        Ok(rest)
    }

    /// The choice `piece` ends, and why, when that choice is still open: a worker's finish,
    /// or a token whose text matched a stop string.
    fn ending(&self, piece: &Piece) -> Result<Option<(u32, FinishReason)>, RouterError> {
        let (choice, reason, is_finish) = match piece {
            Piece::Token(t) => (t.choice, FinishReason::Stop, false),
            Piece::Finish { choice, reason } => (*choice, *reason, true),
        };
        let c = self
            .choices
            .get(choice as usize)
            .ok_or_else(|| RouterError::Internal(format!("a piece for unknown choice {choice}")))?;
        let ends = c.finish.is_none() && (is_finish || c.stopped);
        Ok(ends.then_some((choice, reason)))
    }

    fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    fn usage(&self) -> Value {
        let t = &self.tally;
        json!({
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
            "completion_tokens": t.completion_tokens,
            "total_tokens": self.prompt_tokens + t.completion_tokens,
            "batch_size": t.batch_size,
            "queue_wait_time": t.queue_wait_us,
        })
    }

    fn record(&self) {
        let m = &self.state.metrics;
        m.tokens(self.prompt_tokens, self.tally.completion_tokens);
        let per_choice = self.tally.completion_tokens as f64 / self.choices.len().max(1) as f64;
        if per_choice > 1.0 {
            m.tpot
                .observe(self.first_at.elapsed().div_f64(per_choice - 1.0));
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// The `logprobs` value of a choice for `entries`, or null when not asked for.
    fn logprobs_json(&self, entries: &[LogprobEntry]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => json!({"content": entries.iter().map(|e| json!({
                "token": e.token.text, "logprob": e.logprob, "bytes": e.token.bytes,
                "top_logprobs": e.top.iter().map(|(t, lp)| json!({
                    "token": t.text, "logprob": lp, "bytes": t.bytes})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()}),
            Kind::Completion => {
                // As vLLM and OpenAI do: the sampled token is always among the alternatives.
                let top: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let mut m = serde_json::Map::new();
                        for (t, lp) in &e.top {
                            m.insert(t.text.clone(), json!(lp));
                        }
                        m.entry(e.token.text.clone()).or_insert(json!(e.logprob));
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "text_offset": entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
                    "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                    "tokens": entries.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
                    "top_logprobs": top,
                })
            }
        }
    }

    /// Choice `index` (as shown) of sequence `c` with the logprobs of `entries`: the
    /// whole output, or with `part` a chunk's delta (cumulative content with fullText).
    fn choice_json(
        &self,
        index: usize,
        c: &ChoiceOut,
        part: Option<&Released>,
        entries: &[LogprobEntry],
        finish: Option<FinishReason>,
    ) -> Value {
        let ending = Ending {
            logprobs: self.logprobs_json(entries),
            stop_reason: match finish {
                Some(_) => c.stop_reason.clone(),
                None => Value::Null,
            },
            finish: finish.map(|f| finish_str(f, !c.calls.is_empty())),
        };
        let content = self.content_of(c, part);
        let Some(r) = part else {
            if self.kind == Kind::Completion {
                return delta_json(self.kind, index, content, &Released::default(), &[], ending);
            }
            // OpenAI's shape: a message that only calls tools has null content.
            let content = if content.is_empty() && !c.calls.is_empty() {
                Value::Null
            } else {
                json!(content)
            };
            let mut message = json!({"role": "assistant", "content": content,
                "tool_calls": calls_json(&c.calls, None)});
            if !c.reasoning.is_empty() {
                message["reasoning_content"] = json!(c.reasoning);
            }
            return json!({"index": index, "message": message, "logprobs": ending.logprobs,
                "finish_reason": ending.finish});
        };
        delta_json(self.kind, index, content, r, &c.calls, ending)
    }

    /// The content a choice shows: a chunk's delta, or the whole text so far for the
    /// whole output and with fullText.
    fn content_of<'a>(&self, c: &'a ChoiceOut, part: Option<&'a Released>) -> &'a str {
        match part {
            Some(r) if !self.state.cfg.full_text_enabled => r.content.as_str(),
            _ => c.content.as_str(),
        }
    }

    fn head(&self, chunk: bool) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(chunk)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.state.model_name));
        m
    }

    /// What every chunk starts with, up to its choices: `{"id":...,"choices":[`.
    fn chunk_head(&self) -> String {
        let mut head = Value::Object(self.head(true)).to_string();
        head.pop();
        head.push_str(r#","choices":["#);
        head
    }

    /// The chunk for a token of `choice` that released `part`, after `head` (from
    /// `chunk_head`). Most tokens release plain text only; those are written straight
    /// out, without building a JSON tree (a streamed request's main cost in the router).
    fn token_chunk(&self, head: &str, choice: u32, part: &Released) -> String {
        let c = &self.choices[choice as usize];
        let mut s = String::with_capacity(head.len() + 128);
        s.push_str(head);
        if !self.logprobs && part.reasoning.is_empty() && part.calls.is_empty() {
            plain_delta(
                &mut s,
                self.kind,
                choice as usize,
                self.content_of(c, Some(part)),
            );
        } else {
            let newest = c.entries.len().saturating_sub(1);
            let v = self.choice_json(choice as usize, c, Some(part), &c.entries[newest..], None);
            s.push_str(&v.to_string());
        }
        s.push_str("]}");
        s
    }

    /// The chunk that ends `choice` with what it still held back; the last one to end
    /// also carries the usage.
    fn finish_chunk(&self, choice: u32, rest: &Released) -> Value {
        let c = &self.choices[choice as usize];
        let mut m = self.head(true);
        if self.state.cfg.full_text_enabled {
            m.insert("full_text".into(), json!(c.content));
        }
        if self.all_finished() {
            m.insert("usage".into(), self.usage());
        }
        m.insert(
            "choices".into(),
            json!([self.choice_json(choice as usize, c, Some(rest), &[], c.finish)]),
        );
        Value::Object(m)
    }

    /// One chunk with every choice whole, and the usage.
    fn whole_chunk(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let whole = Released {
                    content: c.content.clone(),
                    reasoning: c.reasoning.clone(),
                    calls: 0..c.calls.len(),
                };
                self.choice_json(index, c, Some(&whole), &c.entries, c.finish)
            })
            .collect();
        let mut m = self.head(true);
        m.insert("choices".into(), json!(choices));
        m.insert("usage".into(), self.usage());
        Value::Object(m)
    }

    /// The non-streamed body: the n best sequences by cumulative logprob (all of them, in
    /// order, without best_of).
    fn response(&self) -> Value {
        let mut order: Vec<usize> = (0..self.choices.len()).collect();
        if self.choices.len() > self.n {
            order.sort_by(|&a, &b| {
                self.choices[b]
                    .cumulative_logprob
                    .total_cmp(&self.choices[a].cumulative_logprob)
            });
            order.truncate(self.n);
        }
        let choices: Vec<Value> = order
            .iter()
            .enumerate()
            .map(|(index, &i)| {
                let c = &self.choices[i];
                self.choice_json(index, c, None, &c.entries, c.finish)
            })
            .collect();
        let mut m = self.head(false);
        m.insert("choices".into(), json!(choices));
        m.insert("usage".into(), self.usage());
        m.insert("prefill_time".into(), json!(ms(self.tally.prefill_ms)));
        m.insert("decode_time_arr".into(), json!(self.tally.decode_ms));
        Value::Object(m)
    }
}

/// The finish_reason a client sees; a choice that called tools and stopped on its own
/// ends with "tool_calls".
fn finish_str(f: FinishReason, called: bool) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// The fields that close a choice: null in a chunk of plain text.
#[derive(Default)]
struct Ending {
    logprobs: Value,
    stop_reason: Value,
    finish: Option<&'static str>,
}

/// A choice of a chunk (`r` its delta, `calls` the choice's calls) or of a whole text
/// completion, in the key order clients see.
fn delta_json(
    kind: Kind,
    index: usize,
    content: &str,
    r: &Released,
    calls: &[(String, ToolCall)],
    ending: Ending,
) -> Value {
    let Ending {
        logprobs,
        stop_reason,
        finish,
    } = ending;
    match kind {
        Kind::Chat => {
            let mut delta = json!({"role": "assistant", "content": content});
            if !r.reasoning.is_empty() {
                delta["reasoning_content"] = json!(r.reasoning);
            }
            if !r.calls.is_empty() {
                delta["tool_calls"] = calls_json(&calls[r.calls.clone()], Some(r.calls.start));
            }
            json!({"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish})
        }
        Kind::Completion => json!({"index": index, "text": content,
            "logprobs": logprobs, "stop_reason": stop_reason, "finish_reason": finish}),
    }
}

/// Writes what `delta_json` gives for a chunk of plain text, without logprobs, to `s`.
fn plain_delta(s: &mut String, kind: Kind, index: usize, content: &str) {
    use std::fmt::Write;
    let text = Value::String(content.to_owned());
    let _ = match kind {
        Kind::Chat => write!(
            s,
            r#"{{"index":{index},"delta":{{"role":"assistant","content":{text}}},"logprobs":null,"finish_reason":null}}"#
        ),
        Kind::Completion => write!(
            s,
            r#"{{"index":{index},"text":{text},"logprobs":null,"stop_reason":null,"finish_reason":null}}"#
        ),
    };
}

/// Tool calls as OpenAI shows them; `first` numbers them for stream deltas.
fn calls_json(calls: &[(String, ToolCall)], first: Option<usize>) -> Value {
    let list = calls.iter().enumerate().map(|(i, (id, call))| {
        let mut v = json!({"id": id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}});
        if let Some(first) = first {
            v["index"] = json!(first + i);
        }
        v
    });
    Value::Array(list.collect())
}

/// Takes pieces until every choice has ended.
async fn drain(out: &mut Output, first: Piece, mut rest: Pieces) -> Result<(), RouterError> {
    let mut piece = first;
    loop {
        if let Piece::Token(t) = &piece {
            out.push(t)?;
        }
        if let Some((choice, reason)) = out.ending(&piece)? {
            out.finish(choice, reason)?;
        }
        if out.all_finished() {
            return Ok(());
        }
        piece = next(&mut rest).await?;
    }
}

/// Streams a beam search the way the seeds do (their "fake streaming"): hypotheses are
/// known only when the search ends, so one chunk carries every choice whole, with the
/// usage, then `[DONE]`.
fn stream_whole(mut out: Output, first: Piece, rest: Pieces, in_flight: InFlight) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(2);
    let format = out.state.cfg.error_format;
    tokio::spawn(
        async move {
            let _in_flight = in_flight;
            let body = tokio::select! {
                // The client went away; returning drops `rest`, which cancels the search.
                _ = tx.closed() => return,
                r = drain(&mut out, first, rest) => match r {
                    Ok(()) => out.whole_chunk(),
                    Err(e) => e.body_in(format),
                },
            };
            let _ = tx.send(Ok(Event::default().data(body.to_string()))).await;
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        }
        .instrument(tracing::Span::current()),
    );
    Sse::new(ReceiverStream::new(rx)).into_response()
}

async fn next(rest: &mut Pieces) -> Result<Piece, RouterError> {
    match rest.recv().await {
        Some(p) => p,
        None => Err(RouterError::Internal("the generation ended early".into())),
    }
}

/// Streams the generation as SSE: one chunk per token, a chunk that ends each choice (the
/// last one with the usage), then `[DONE]`. An error after the first token becomes an
/// error event.
fn stream(out: Output, first: Piece, rest: Pieces, in_flight: InFlight) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let format = out.state.cfg.error_format;
    tokio::spawn(
        async move {
            let _in_flight = in_flight;
            let ended = pump(out, first, rest, &tx).await;
            if let Err(e) = ended {
                tracing::warn!(error = %e, "stream failed after its first token");
                let body = e.body_in(format).to_string();
                let _ = tx.send(Ok(Event::default().data(body))).await;
            }
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        }
        .instrument(tracing::Span::current()),
    );
    Sse::new(ReceiverStream::new(rx)).into_response()
}

async fn pump(
    mut out: Output,
    first: Piece,
    mut rest: Pieces,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
) -> Result<(), RouterError> {
    let send = |v: String| tx.send(Ok(Event::default().data(v)));
    let head = out.chunk_head();
    let mut piece = first;
    loop {
        if let Piece::Token(t) = &piece {
            if let Some(part) = out.push(t)? {
                if send(out.token_chunk(&head, t.choice, &part)).await.is_err() {
                    // The client went away; dropping `rest` cancels the generation.
                    return Ok(());
                }
            }
        }
        if let Some((choice, reason)) = out.ending(&piece)? {
            let rest_text = out.finish(choice, reason)?;
            let _ = send(out.finish_chunk(choice, &rest_text).to_string()).await;
        }
        if out.all_finished() {
            return Ok(());
        }
        // Between tokens (a request queued on the decode node may wait long) the client
        // can leave; it is noticed at once, not at the next token.
        piece = tokio::select! {
            p = next(&mut rest) => p?,
            _ = tx.closed() => return Ok(()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_chunk_is_written_as_the_json_tree_would_be() {
        let texts = [
            "",
            " hello",
            "quote \" and back\\slash",
            "line\nbreak\ttab\r\u{1}\u{1f}",
            "中文 and 🙂",
            "</think>{\"name\": 1}",
        ];
        for kind in [Kind::Chat, Kind::Completion] {
            for (index, text) in texts.iter().enumerate() {
                let mut fast = String::new();
                plain_delta(&mut fast, kind, index, text);
                let tree = delta_json(
                    kind,
                    index,
                    text,
                    &Released::default(),
                    &[],
                    Ending::default(),
                );
                assert_eq!(fast, tree.to_string(), "{kind:?} {text:?}");
            }
        }
    }
}
