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
    let response = run(&state, kind, id, body, in_flight)
        .instrument(span)
        .await
        .unwrap_or_else(IntoResponse::into_response);
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
    let (text, param) = match kind {
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
            (text, "messages")
        }
        Kind::Completion => (params::completion(&o)?, "prompt"),
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
    };
    let prompt_tokens = req.prompt.len();
    let (first, rest) = dispatch::start(state, req).await?;
    let out = Output {
        state: Arc::clone(state),
        kind,
        id,
        created: unix_now(),
        prompt_tokens,
        decoder: engine::IncrementalDecoder::new(common.skip_special_tokens),
        stop_ids,
        text: String::new(),
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

/// Per-token figures the usage reports.
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

/// One request's output as it grows.
struct Output {
    state: Arc<AppState>,
    kind: Kind,
    id: String,
    created: u64,
    prompt_tokens: usize,
    decoder: engine::IncrementalDecoder,
    stop_ids: Vec<u32>,
    text: String,
    tally: Tally,
}

impl Output {
    /// Counts a token and returns the text it completes ("" while a character is split).
    fn push(&mut self, t: &TokenStat) -> Result<String, RouterError> {
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
        // A stop token ends the output and is not part of its text.
        if self.stop_ids.contains(&t.id) {
            return Ok(String::new());
        }
        let piece = self
            .decoder
            .push(&self.state.text.tokenizer, t.id)
            .map_err(|e| RouterError::Internal(e.to_string()))?
            .unwrap_or_default();
        self.text.push_str(&piece);
        Ok(piece)
    }

    /// Text held back at the end.
    fn flush(&mut self) -> Result<String, RouterError> {
        let rest = self
            .decoder
            .flush(&self.state.text.tokenizer)
            .map_err(|e| RouterError::Internal(e.to_string()))?
            .unwrap_or_default();
        self.text.push_str(&rest);
        Ok(rest)
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

    /// A choice carrying `content`, finished or not.
    fn choice(&self, content: &str, finish: Option<FinishReason>, chunk: bool) -> Value {
        let finish = finish.map(finish_str);
        match (self.kind, chunk) {
            (Kind::Chat, false) => json!({"index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": []},
                "logprobs": null, "finish_reason": finish}),
            (Kind::Chat, true) => json!({"index": 0,
                "delta": {"role": "assistant", "content": content}, "finish_reason": finish}),
            (Kind::Completion, _) => json!({"index": 0, "text": content, "logprobs": null,
                "stop_reason": null, "finish_reason": finish}),
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

    fn token_chunk(&self, piece: &str) -> Value {
        let content = if self.state.cfg.full_text_enabled {
            self.text.as_str()
        } else {
            piece
        };
        let mut m = self.head(true);
        m.insert("choices".into(), json!([self.choice(content, None, true)]));
        Value::Object(m)
    }

    fn last_chunk(&self, rest: &str, finish: FinishReason) -> Value {
        let full = self.state.cfg.full_text_enabled;
        let content = if full { self.text.as_str() } else { rest };
        let mut m = self.head(true);
        if full {
            m.insert("full_text".into(), json!(self.text));
        }
        m.insert("usage".into(), self.usage());
        m.insert(
            "choices".into(),
            json!([self.choice(content, Some(finish), true)]),
        );
        Value::Object(m)
    }

    fn response(&self, finish: FinishReason) -> Value {
        let mut m = self.head(false);
        m.insert(
            "choices".into(),
            json!([self.choice(&self.text, Some(finish), false)]),
        );
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

/// Waits for the whole generation and builds the non-streamed body.
async fn collect(mut out: Output, first: Piece, mut rest: Pieces) -> Result<Value, RouterError> {
    let mut piece = first;
    loop {
        match piece {
            Piece::Token(t) => {
                out.push(&t)?;
            }
            Piece::Finish(f) => {
                out.flush()?;
                out.record();
                return Ok(out.response(f));
            }
        }
        piece = match rest.recv().await {
            Some(p) => p?,
            None => return Err(RouterError::Internal("the generation ended early".into())),
        };
    }
}

/// Streams the generation as SSE: one chunk per token, a last chunk with the finish and
/// usage, then `[DONE]`. An error after the first token becomes an error event.
fn stream(out: Output, first: Piece, rest: Pieces, in_flight: InFlight) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(
        async move {
            let _in_flight = in_flight;
            let ended = pump(out, first, rest, &tx).await;
            if let Err(e) = ended {
                tracing::warn!(error = %e, "stream failed after its first token");
                let _ = tx
                    .send(Ok(Event::default().data(e.body().to_string())))
                    .await;
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
    let mut piece = first;
    loop {
        let event = match piece {
            Piece::Token(t) => {
                let text = out.push(&t)?;
                out.token_chunk(&text)
            }
            Piece::Finish(f) => {
                let rest_text = out.flush()?;
                out.record();
                let last = out.last_chunk(&rest_text, f);
                let _ = tx.send(Ok(Event::default().data(last.to_string()))).await;
                return Ok(());
            }
        };
        if tx
            .send(Ok(Event::default().data(event.to_string())))
            .await
            .is_err()
        {
            // The client went away; dropping `rest` cancels the generation.
            return Ok(());
        }
        piece = match rest.recv().await {
            Some(p) => p?,
            None => return Err(RouterError::Internal("the generation ended early".into())),
        };
    }
}
