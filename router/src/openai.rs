//! The OpenAI-style endpoints in the seeds' shapes: chat and text completions, streamed
//! (SSE) and not, with MindIE's usage fields. A request is read and validated (`api`,
//! `params`), dispatched (`dispatch`), and its output (`output`) answered whole or streamed.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use runtime::prom::Observe;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use crate::access::Access;
use crate::api;
use crate::dispatch::{self, GenRequest, Generation, Piece};
use crate::error::{ErrorFormat, RouterError};
use crate::intake::{
    client_request_id, off_the_io_threads, on_the_blocking_pool, REQUEST_ID_HEADER,
};
use crate::keys::{Key, QuotaHold};
use crate::metrics::InFlight;
use crate::output::{Kind, Output};
use crate::params;
use crate::state::AppState;
use crate::valid::{prepare, Parts, Stamp};

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
pub(crate) async fn read_body(
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
    let mut limited = http_body_util::Limited::new(body, max);
    // Into one buffer of the announced size as the frames arrive: collecting the frames
    // first and then joining them held the body twice.
    let mut bytes = Vec::with_capacity(announced.map_or(0, |n| n as usize));
    let read = async {
        while let Some(frame) = limited.frame().await {
            if let Ok(data) = frame?.into_data() {
                bytes.extend_from_slice(&data);
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };
    match tokio::time::timeout(std::time::Duration::from_millis(limit), read).await {
        Ok(Ok(())) => Ok(Bytes::from(bytes)),
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
pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let created = unix_now() - state.started.elapsed().as_secs();
    Json(api::models::ModelList {
        object: "list",
        data: vec![api::models::Model {
            id: &state.model_name,
            object: "model",
            created,
            owned_by: "tandem",
            max_model_len: state.max_seq_len,
        }],
    })
    .into_response()
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
    let log_id = client_request_id(&body.0).unwrap_or_else(|| id.clone());
    // The dispatcher records where the request runs (crate::dispatch::placed_on).
    let span = tracing::info_span!("request", req_id = %log_id, endpoint = kind.endpoint(),
        prompt_tokens = tracing::field::Empty, placement = tracing::field::Empty,
        prefill = tracing::field::Empty, decode = tracing::field::Empty);
    // In the trace the client names, if it names one (the W3C `traceparent` header).
    runtime::otel::follow_headers(&span, &body.0);
    let access = Access::start(key.as_ref().map(|k| k.id()));
    let admitted = state.metrics.start(
        state.cfg.max_in_flight,
        key.clone(),
        state.cfg.max_in_flight_per_key,
    );
    let stamp = Stamp {
        kind,
        id,
        created: unix_now(),
    };
    let result = match admitted {
        Ok(in_flight) => {
            run(&state, stamp, log_id.clone(), key, body, in_flight, &access)
                .instrument(span.clone())
                .await
        }
        Err(e) => Err(e),
    };
    let mut response = match result {
        Ok(r) => r,
        Err(e) => state.error_response(e),
    };
    if let Ok(v) = HeaderValue::from_str(&log_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    let status = response.status().as_u16();
    state.metrics.finished(kind.endpoint(), status);
    access.update(|f| f.status = status);
    // The line is the request span's event (a stream's task may write it instead).
    span.in_scope(|| drop(access));
    response
}

async fn run(
    state: &Arc<AppState>,
    stamp: Stamp,
    log_id: String,
    key: Option<Arc<Key>>,
    body: (HeaderMap, Body),
    mut in_flight: InFlight,
    access: &Access,
) -> Result<Response, RouterError> {
    let arrived = Instant::now();
    let body = read_body(state, body).await?;
    let mut valid =
        off_the_io_threads(state, body, move |st, body| prepare(st, stamp, body)).await?;
    if let Some(c) = valid.grammar.take() {
        let checked = on_the_blocking_pool(state, move |st| c.checked(&st.grammar_vocab));
        valid.sampling.grammar = Some(checked.await?);
    }
    if valid.stream {
        // Held by the streaming task with the in-flight slot, so both end with the stream.
        in_flight.open_stream(state.cfg.max_streams)?;
    }
    let partition = key
        .as_ref()
        .map_or_else(Vec::new, |k| k.cache_partition().to_vec());
    let hold = key
        .as_ref()
        .map(|k| k.hold(valid.worst_case()))
        .transpose()?;
    let streamed = valid.stream;
    let beam = valid.width.beam;
    let Parts {
        mut request,
        output,
    } = valid.into_parts(log_id, partition);
    request.spent = hold.as_ref().map(QuotaHold::spent);
    // A non-streamed request has sent nothing yet when a worker fails mid-way, so it can
    // start over (same seed, same tokens) where a stream has to end with an error.
    let restart = (!streamed).then(|| request.clone());
    let generation = dispatch::start(state, request).await?;
    let mut out = Output::new(output, state.render.clone(), hold);
    state.metrics.ttft.observe(Instant::now() - arrived);
    access.first_token();
    access.update(|f| f.streamed = streamed);
    out.access = Some(access.clone());
    let format = state.cfg.error_format;
    Ok(match restart {
        None if beam => stream_whole(out, generation, in_flight, format),
        None => stream(out, generation, in_flight, format),
        Some(req) => answer(state, out, req, generation).await?,
    })
}

/// The non-streamed answer, started again (up to `--max-attempts`, within the retry
/// budget) when a worker fails before it is whole.
async fn answer(
    state: &Arc<AppState>,
    mut out: Output,
    req: GenRequest,
    mut generation: Generation,
) -> Result<Response, RouterError> {
    let mut restarts = 0;
    loop {
        match drain(&mut out, &mut generation).await {
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
                out.restart();
                // What is left of the failed attempt goes before the next one starts.
                drop(generation);
                generation = dispatch::start(state, req.clone()).await?;
                out.first_token_now();
            }
            Err(e) => return Err(e),
        }
    }
}

/// Takes pieces until every choice has ended.
async fn drain(out: &mut Output, generation: &mut Generation) -> Result<(), RouterError> {
    loop {
        let piece = generation.next().await?;
        match &piece {
            Piece::Token(t) => {
                out.push(t)?;
            }
            Piece::Prompt(scored) => out.scored_prompt(scored)?,
            Piece::Finish { .. } => {}
        }
        if let Some((choice, reason)) = out.ending(&piece)? {
            out.finish(choice, reason)?;
        }
        if out.all_finished() {
            return Ok(());
        }
    }
}

/// Streams a beam search the way the seeds do (their "fake streaming"): hypotheses are
/// known only when the search ends, so one chunk carries every choice whole, with the
/// usage, then `[DONE]`.
fn stream_whole(
    mut out: Output,
    mut generation: Generation,
    in_flight: InFlight,
    format: ErrorFormat,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(2);
    tokio::spawn(
        async move {
            let _in_flight = in_flight;
            let body = tokio::select! {
                // The client went away; returning drops the generation, which cancels the
                // search.
                _ = tx.closed() => return,
                r = drain(&mut out, &mut generation) => match r {
                    Ok(()) => out.whole_chunk(),
                    Err(e) => e.body_in(format).to_json(),
                },
            };
            let ended = out.all_finished();
            let _ = tx.send(Ok(Event::default().data(body))).await;
            if ended && out.include_usage() {
                let _ = tx.send(Ok(Event::default().data(out.usage_chunk()))).await;
            }
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        }
        .instrument(tracing::Span::current()),
    );
    Sse::new(ReceiverStream::new(rx)).into_response()
}

/// Streams the generation as SSE: one chunk per token, a chunk that ends each choice (the
/// last one with the usage), then `[DONE]`. An error after the first token becomes an
/// error event.
fn stream(
    mut out: Output,
    generation: Generation,
    in_flight: InFlight,
    format: ErrorFormat,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(
        async move {
            let _in_flight = in_flight;
            let ended = pump(&mut out, generation, &tx).await;
            if let Err(e) = ended {
                if let Some(a) = &out.access {
                    a.update(|f| f.stream_error = Some(e.http_status().as_u16()));
                }
                tracing::warn!(error = %e, "stream failed after its first token");
                if format == ErrorFormat::Provider {
                    // The provider's clients read a cut stream the seeds' way: each open
                    // choice ends (stop, no output) with err_msg.
                    for chunk in out.error_chunks(&e.public_message()) {
                        let _ = tx.send(Ok(Event::default().data(chunk))).await;
                    }
                }
                let body = e.body_in(format).to_json();
                let _ = tx.send(Ok(Event::default().data(body))).await;
            }
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        }
        .instrument(tracing::Span::current()),
    );
    Sse::new(ReceiverStream::new(rx)).into_response()
}

async fn pump(
    out: &mut Output,
    mut generation: Generation,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
) -> Result<(), RouterError> {
    let send = |v: String| tx.send(Ok(Event::default().data(v)));
    let head = out.chunk_head();
    loop {
        // Between tokens (a request queued on the decode node may wait long) the client
        // can leave; it is noticed at once, not at the next token. Returning drops the
        // generation, which cancels it.
        let piece = tokio::select! {
            p = generation.next() => p?,
            _ = tx.closed() => return Ok(()),
        };
        match &piece {
            Piece::Token(t) => {
                if let Some(part) = out.push(t)? {
                    if send(out.token_chunk(&head, t.choice, &part)).await.is_err() {
                        return Ok(());
                    }
                }
            }
            Piece::Prompt(scored) => out.scored_prompt(scored)?,
            Piece::Finish { .. } => {}
        }
        if let Some((choice, reason)) = out.ending(&piece)? {
            let rest_text = out.finish(choice, reason)?;
            let _ = send(out.finish_chunk(choice, &rest_text)).await;
        }
        if out.all_finished() {
            if out.include_usage() {
                let _ = send(out.usage_chunk()).await;
            }
            return Ok(());
        }
    }
}
