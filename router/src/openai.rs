//! The OpenAI-style endpoints in the seeds' shapes: chat and text completions, streamed
//! (SSE) and not, with MindIE's usage fields.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use proto::v1::FinishReason;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use crate::dispatch::{self, GenRequest, Piece, Pieces, TokenStat};
use crate::error::RouterError;
use crate::metrics::InFlight;
use crate::params;
use crate::state::AppState;
use crate::stops::{Scan, StopStrings};

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
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Kind::Chat, body).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Kind::Completion, body).await
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

async fn handle(state: Arc<AppState>, kind: Kind, body: Result<Bytes, BytesRejection>) -> Response {
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
    let in_flight = state.metrics.start();
    let response = match run(&state, kind, id, body, in_flight)
        .instrument(span)
        .await
    {
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
    body: Result<Bytes, BytesRejection>,
    in_flight: InFlight,
) -> Result<Response, RouterError> {
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            RouterError::BodyTooLarge(state.cfg.max_body_bytes)
        } else {
            RouterError::InvalidJson(e.body_text())
        }
    })?;
    let o = params::object(&body)?;
    let common = params::common(&o, state.text.config.vocab_size)?;
    if common.model != state.model_name {
        return Err(RouterError::ModelNotFound(common.model));
    }
    let (text, param, logprobs) = match kind {
        Kind::Chat => {
            let chat = params::chat(&o)?;
            let template = state
                .text
                .template
                .as_ref()
                .ok_or(RouterError::NoChatTemplate)?;
            let text = template
                .render(&chat.input)
                .map_err(|e| RouterError::Template(e.to_string()))?;
            (text, "messages", chat.logprobs)
        }
        Kind::Completion => {
            let c = params::completion(&o)?;
            (c.prompt, "prompt", c.logprobs)
        }
    };
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
    };
    let prompt_tokens = req.prompt.len();
    let (first, rest) = dispatch::start(state, req).await?;
    let choices = (0..common.best_of)
        .map(|_| ChoiceOut::new(common.skip_special_tokens))
        .collect();
    let out = Output {
        state: Arc::clone(state),
        kind,
        id,
        created: unix_now(),
        prompt_tokens,
        stop_ids,
        user_stop_ids: common.stop_token_ids,
        stops: StopStrings::new(common.stop, common.include_stop_str_in_output),
        logprobs: logprobs.is_some(),
        n: common.n,
        choices,
        tally: Tally::default(),
    };
    if common.stream {
        Ok(stream(out, first, rest, in_flight))
    } else {
        collect(out, first, rest)
            .await
            .map(|v| Json(v).into_response())
    }
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

/// One sequence's output as it grows.
struct ChoiceOut {
    decoder: engine::IncrementalDecoder,
    /// Decoded text; past a matched stop string it is cut where the output ends.
    text: String,
    text_chars: usize,
    /// Bytes of `text` already released to the client.
    sent: usize,
    stop_reason: Value,
    /// A stop string ended the output: its later tokens are ignored.
    stopped: bool,
    finish: Option<FinishReason>,
    /// Sum of its tokens' logprobs: how best_of ranks sequences.
    cumulative_logprob: f64,
    entries: Vec<LogprobEntry>,
}

impl ChoiceOut {
    fn new(skip_special: bool) -> Self {
        Self {
            decoder: engine::IncrementalDecoder::new(skip_special),
            text: String::new(),
            text_chars: 0,
            sent: 0,
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

    /// The text now free to go out; `all` at the end of the output.
    fn release(&mut self, stops: &StopStrings, all: bool) -> String {
        let upto = if all || self.stopped {
            self.text.len()
        } else {
            match stops.scan(&self.text, self.text.len()) {
                Scan::Release(n) => n,
                Scan::Stop { end, .. } => end,
            }
        };
        let upto = upto.max(self.sent);
        let out = self.text[self.sent..upto].to_string();
        self.sent = upto;
        out
    }
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

    /// Counts a token and returns the text it releases for its choice ("" while a character
    /// is split or the text could still become a stop string), or `None` when that choice
    /// has already ended.
    fn push(&mut self, t: &TokenStat) -> Result<Option<String>, RouterError> {
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

    /// Ends a choice: returns the text it still held back.
    fn finish(&mut self, choice: u32, reason: FinishReason) -> Result<String, RouterError> {
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
        self.state
            .metrics
            .tokens(self.prompt_tokens, self.tally.completion_tokens);
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

    /// Choice `index` (as shown) of sequence `c`, carrying `content` and the logprobs of
    /// `entries`, finished or not.
    fn choice_json(
        &self,
        index: usize,
        c: &ChoiceOut,
        content: &str,
        entries: &[LogprobEntry],
        finish: Option<FinishReason>,
        chunk: bool,
    ) -> Value {
        let logprobs = self.logprobs_json(entries);
        let stop_reason = if finish.is_some() {
            c.stop_reason.clone()
        } else {
            Value::Null
        };
        let finish = finish.map(finish_str);
        match (self.kind, chunk) {
            (Kind::Chat, false) => json!({"index": index,
                "message": {"role": "assistant", "content": content, "tool_calls": []},
                "logprobs": logprobs, "finish_reason": finish}),
            (Kind::Chat, true) => json!({"index": index,
                "delta": {"role": "assistant", "content": content}, "logprobs": logprobs,
                "finish_reason": finish}),
            (Kind::Completion, _) => json!({"index": index, "text": content,
                "logprobs": logprobs, "stop_reason": stop_reason, "finish_reason": finish}),
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

    /// The chunk for a token of `choice` that released `piece`.
    fn token_chunk(&self, choice: u32, piece: &str) -> Value {
        let c = &self.choices[choice as usize];
        let content = if self.state.cfg.full_text_enabled {
            &c.text[..c.sent]
        } else {
            piece
        };
        let newest = c.entries.len().saturating_sub(1);
        let mut m = self.head(true);
        m.insert(
            "choices".into(),
            json!([self.choice_json(
                choice as usize,
                c,
                content,
                &c.entries[newest..],
                None,
                true
            )]),
        );
        Value::Object(m)
    }

    /// The chunk that ends `choice`; the last one to end also carries the usage.
    fn finish_chunk(&self, choice: u32, rest: &str) -> Value {
        let c = &self.choices[choice as usize];
        let full = self.state.cfg.full_text_enabled;
        let content = if full { c.text.as_str() } else { rest };
        let mut m = self.head(true);
        if full {
            m.insert("full_text".into(), json!(c.text));
        }
        if self.all_finished() {
            m.insert("usage".into(), self.usage());
        }
        m.insert(
            "choices".into(),
            json!([self.choice_json(choice as usize, c, content, &[], c.finish, true)]),
        );
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
                self.choice_json(index, c, &c.text, &c.entries, c.finish, false)
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

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// Waits for the whole generation and builds the non-streamed body. Returning drops
/// `rest`, which cancels what the workers still generate (after stop strings ended every
/// choice).
async fn collect(mut out: Output, first: Piece, mut rest: Pieces) -> Result<Value, RouterError> {
    let mut piece = first;
    loop {
        if let Piece::Token(t) = &piece {
            out.push(t)?;
        }
        if let Some((choice, reason)) = out.ending(&piece)? {
            out.finish(choice, reason)?;
        }
        if out.all_finished() {
            return Ok(out.response());
        }
        piece = next(&mut rest).await?;
    }
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
    let send = |v: Value| tx.send(Ok(Event::default().data(v.to_string())));
    let mut piece = first;
    loop {
        if let Piece::Token(t) = &piece {
            if let Some(text) = out.push(t)? {
                if send(out.token_chunk(t.choice, &text)).await.is_err() {
                    // The client went away; dropping `rest` cancels the generation.
                    return Ok(());
                }
            }
        }
        if let Some((choice, reason)) = out.ending(&piece)? {
            let rest_text = out.finish(choice, reason)?;
            let _ = send(out.finish_chunk(choice, &rest_text)).await;
        }
        if out.all_finished() {
            return Ok(());
        }
        piece = next(&mut rest).await?;
    }
}
