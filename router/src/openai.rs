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

use crate::api;
use crate::api::json::JsonBudget;
use crate::dispatch::{self, GenRequest, Piece, Pieces};
use crate::error::{ErrorFormat, RouterError};
use crate::intake::{
    client_request_id, off_the_io_threads, on_the_blocking_pool, REQUEST_ID_HEADER,
};
use crate::keys::{Key, QuotaHold};
use crate::metrics::InFlight;
use crate::output::{ChoiceOut, Echo, Kind, Output, Tally};
use crate::params;
use crate::state::AppState;
use crate::stops::StopStrings;
use proto::limits::MAX_STOP_TOKEN_IDS;
use text::structured::Parser;

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
    let span = tracing::info_span!("request", req_id = %log_id, endpoint = kind.endpoint(),
        prompt_tokens = tracing::field::Empty);
    let admitted = state.metrics.start(
        state.cfg.max_in_flight,
        key.clone(),
        state.cfg.max_in_flight_per_key,
    );
    let result = match admitted {
        Ok(in_flight) => {
            run(&state, kind, (id, log_id.clone()), key, body, in_flight)
                .instrument(span)
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
    state
        .metrics
        .finished(kind.endpoint(), response.status().as_u16());
    response
}

async fn run(
    state: &Arc<AppState>,
    kind: Kind,
    (id, log_id): (String, String),
    key: Option<Arc<Key>>,
    body: (HeaderMap, Body),
    mut in_flight: InFlight,
) -> Result<Response, RouterError> {
    let arrived = Instant::now();
    // Seed 001: `created` is "推理请求时间戳，精确到秒" (the inference request's timestamp, to
    // the second), so it is taken on arrival, not when the first token comes.
    let created = unix_now();
    let body = read_body(state, body).await?;
    let Prepared {
        mut common,
        prompt,
        logprobs,
        parser,
        echo,
    } = off_the_io_threads(state, body, move |st, body| prepare(st, kind, body)).await?;
    if let Some(c) = common.grammar.take() {
        let checked = on_the_blocking_pool(state, move |st| c.checked(&st.grammar_vocab));
        common.sampling.grammar = Some(checked.await?);
    }
    if common.stream {
        // Held by the streaming task with the in-flight slot, so both end with the stream.
        in_flight.open_stream(state.cfg.max_streams)?;
    }
    let stop_ids = stop_ids(state, &common)?;
    // Only a choice among several can end while others go on.
    let (ended, ended_rx) = if common.best_of > 1 && !common.stop.is_empty() {
        let (tx, rx) = tokio::sync::watch::channel(0u128);
        (Some(Arc::new(tx)), Some(rx))
    } else {
        (None, None)
    };
    let mut req = GenRequest {
        id: id.clone(),
        log_id,
        max_tokens: state.completion_budget(common.max_tokens, prompt.len()),
        prompt,
        sampling: common.sampling,
        stop_ids: stop_ids.clone(),
        top_logprobs: logprobs.unwrap_or(0),
        prompt_logprobs: echo.is_some() && logprobs.is_some(),
        ended: ended_rx,
        sequences: common.best_of,
        sequences_param: if common.best_of > common.n {
            "best_of"
        } else {
            "n"
        },
        beam: common.beam.then_some(common.n),
        resumed: 0,
        cache_partition: key
            .as_ref()
            .map_or_else(Vec::new, |k| k.cache_partition().to_vec()),
        spent: None,
    };
    let prompt_tokens = req.prompt.len();
    let echo = echo.map(|text| Echo::new(text, req.prompt.clone()));
    // Beam search returns its n best hypotheses; sampling all best_of sequences.
    let sequences = req.reported();
    let worst = prompt_tokens + req.max_tokens * req.sequences.max(sequences);
    let hold = key.as_ref().map(|k| k.hold(worst as u64)).transpose()?;
    req.spent = hold.as_ref().map(QuotaHold::spent);
    // A non-streamed request has sent nothing yet when a worker fails mid-way, so it can
    // start over (same seed, same tokens) where a stream has to end with an error.
    let restart = (!common.stream).then(|| req.clone());
    let (mut first, mut rest) = dispatch::start(state, req).await?;
    let output = |first_at| Output {
        state: Arc::clone(state),
        kind,
        id: id.clone(),
        created,
        prompt_tokens,
        stop_ids: stop_ids.clone(),
        user_stop_ids: common.stop_token_ids.clone(),
        stops: StopStrings::new(
            common.stop.clone(),
            common.include_stop_str_in_output,
            common.min_tokens,
        ),
        logprobs: logprobs.is_some(),
        n: common.n,
        choices: (0..sequences)
            .map(|_| {
                let mut c = ChoiceOut::new(common.skip_special_tokens, parser.clone());
                if let Some(e) = &echo {
                    c.content.clone_from(&e.text);
                }
                c
            })
            .collect(),
        tally: Tally::default(),
        first_at,
        hold: None,
        include_usage: common.include_usage,
        echo: echo.clone(),
        ended: ended.clone(),
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
                // The new attempt's choices all start again.
                if let Some(ended) = &ended {
                    ended.send_replace(0);
                }
                (first, rest) = dispatch::start(state, req.clone()).await?;
                out = output(Instant::now());
                out.hold = hold;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The tokens that end a request's sequences: the model's end tokens (unless `ignore_eos`)
/// and the request's `stop_token_ids`, each once, within the limit the nodes hold them to.
fn stop_ids(state: &AppState, common: &params::Common) -> Result<Vec<u32>, RouterError> {
    let mut ids = if common.ignore_eos {
        Vec::new()
    } else {
        state.text.config.eos_token_ids.clone()
    };
    ids.extend(&common.stop_token_ids);
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

/// A request of either endpoint, as typed.
enum Request {
    Chat(api::chat::ChatRequest),
    Completion(api::completions::CompletionRequest),
}

/// A request parsed, validated, templated and tokenized.
struct Prepared {
    common: params::Common,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
    parser: Option<Parser>,
    /// `echo`: the prompt's text, shown before each choice's.
    echo: Option<String>,
}

/// Parses and validates a request's body, renders its chat template and tokenizes its
/// prompt: the work whose cost grows with the input, run on the blocking pool. Text longer
/// than any prompt of `max_prompt_tokens` can be is refused before it is tokenized.
fn prepare(state: &AppState, kind: Kind, body: Bytes) -> Result<Prepared, RouterError> {
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
    let (text, tokens, param, logprobs, parser, echo) = match request {
        Request::Chat(r) => {
            let chat = params::chat(r, &json)?;
            let (text, parser) = crate::chat::prompt(state, &chat, &mut common)?;
            (text, None, "messages", chat.logprobs, parser, false)
        }
        Request::Completion(r) => {
            let c = params::completion(&r, vocab)?;
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
            (text, tokens, "prompt", c.logprobs, None, c.echo)
        }
    };
    if state.cfg.log_prompts {
        // Inside the request's span, so the line carries its req_id.
        tracing::info!(prompt = ?crate::chat::shown(state, &text), "prompt");
    }
    if tokens.is_none() && text.len() > state.max_prompt_bytes {
        return Err(RouterError::param(
            param,
            format!(
                "the prompt is {} bytes, more than {} tokens (the limit) can be",
                text.len(),
                state.max_prompt_tokens
            ),
        ));
    }
    let prompt = match (tokens, kind) {
        (Some(ids), _) => ids,
        (None, Kind::Chat) => crate::chat::encode(state, &text)?,
        (None, Kind::Completion) => state
            .text
            .tokenizer
            .encode(&text)
            .map_err(|e| RouterError::param(param, e.to_string()))?,
    };
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
        echo: echo.then_some(text),
    })
}

/// Takes pieces until every choice has ended.
async fn drain(out: &mut Output, first: Piece, mut rest: Pieces) -> Result<(), RouterError> {
    let mut piece = first;
    loop {
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
                    Err(e) => e.body_in(format).to_json(),
                },
            };
            let ended = out.all_finished();
            let _ = tx.send(Ok(Event::default().data(body))).await;
            if ended && out.include_usage {
                let _ = tx.send(Ok(Event::default().data(out.usage_chunk()))).await;
            }
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
fn stream(mut out: Output, first: Piece, rest: Pieces, in_flight: InFlight) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let format = out.state.cfg.error_format;
    tokio::spawn(
        async move {
            let _in_flight = in_flight;
            let ended = pump(&mut out, first, rest, &tx).await;
            if let Err(e) = ended {
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
    first: Piece,
    mut rest: Pieces,
    tx: &mpsc::Sender<Result<Event, Infallible>>,
) -> Result<(), RouterError> {
    let send = |v: String| tx.send(Ok(Event::default().data(v)));
    let head = out.chunk_head();
    let mut piece = first;
    loop {
        match &piece {
            Piece::Token(t) => {
                if let Some(part) = out.push(t)? {
                    if send(out.token_chunk(&head, t.choice, &part)).await.is_err() {
                        // The client went away; dropping `rest` cancels the generation.
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
            if out.include_usage {
                let _ = send(out.usage_chunk()).await;
            }
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
