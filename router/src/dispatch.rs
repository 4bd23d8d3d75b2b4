//! Runs one generation on the workers: prefill node then decode node (PD), or one colocated
//! worker. The HTTP layer sees only a stream of tokens with their timings, then a finish.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::{
    generate_event::Event, FinishReason, GenerateRequest, PrefillRequest, PrefillResponse,
};
use tokio::sync::{mpsc, watch};
use tonic::Streaming;
use tracing::Instrument;

use crate::ending;
use crate::error::RouterError;
use crate::metrics::Culprit;
use crate::placement::Placement;
use crate::state::AppState;
use crate::worker::{Hold, Worker};

/// A tokenized, validated request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The response's id; each attempt's KV transfer is matched by an id made from it.
    pub id: String,
    /// What the nodes log the request as (gRPC metadata): the client's X-Request-Id, else
    /// `id`. It need not be unique, so nothing is matched by it.
    pub log_id: String,
    pub prompt: Vec<u32>,
    pub sampling: proto::v1::SamplingParams,
    /// Completion tokens allowed in all, the prefill node's first one included.
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    /// Alternatives reported with each token.
    pub top_logprobs: usize,
    /// Sequences generated from the prompt (best_of, else n); the beam width with beam
    /// search.
    pub sequences: usize,
    /// Beam search returning this many hypotheses.
    pub beam: Option<usize>,
    /// The prefix-cache partition of the request's API key (empty without keys).
    pub cache_partition: Vec<u8>,
    /// Score every prompt token after the first (echo with logprobs), with `top_logprobs`
    /// alternatives: a [`Piece::Prompt`] before the tokens.
    pub prompt_logprobs: bool,
    /// The choices the client's output has ended (bit i: choice i) while others go on: the
    /// decode node is told to stop decoding them. Only for requests where that can happen
    /// (several sequences and stop strings): watching costs a task per attempt.
    pub ended: Option<watch::Receiver<u128>>,
}

impl GenRequest {
    /// Sequences the workers report back, each ending with its own finish.
    pub fn reported(&self) -> usize {
        self.beam.unwrap_or(self.sequences)
    }

    /// The beam width a decode node is asked for: 0 without beam search.
    fn beam_width(&self) -> u32 {
        if self.beam.is_some() {
            self.sequences as u32
        } else {
            0
        }
    }
}

/// One generated token and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenStat {
    /// Which sequence of the request it belongs to.
    pub choice: u32,
    pub id: u32,
    pub logprob: f32,
    /// The best alternatives (id, logprob), when asked for.
    pub top: Vec<(u32, f32)>,
    /// Milliseconds of the step that made it: the prefill for the first token.
    pub step_ms: f64,
    pub batch_size: u32,
    pub queue_wait_us: u64,
    pub from_prefill: bool,
    pub cached_tokens: u32,
}

/// What a generation yields: tokens, and one finish per sequence after its tokens.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// The log-probability of each prompt token after the first; before any token.
    Prompt(Vec<proto::v1::Token>),
    Token(TokenStat),
    Finish {
        choice: u32,
        reason: FinishReason,
    },
}

/// Pieces after the first.
pub type Pieces = mpsc::Receiver<Result<Piece, RouterError>>;

/// Starts a generation and waits for its first piece, so that a failure before any token
/// becomes a plain HTTP error. Dropping the returned receiver cancels the generation on
/// every worker it reached.
pub async fn start(state: &Arc<AppState>, req: GenRequest) -> Result<(Piece, Pieces), RouterError> {
    let (tx, mut rx) = mpsc::channel(64);
    let state = Arc::clone(state);
    let timeout_ms = state.cfg.request_timeout_ms;
    tokio::spawn(
        async move {
            let run = async {
                let placed = Placement::of(&state.cfg, req.prompt.len());
                state.metrics.placed(placed);
                let result = match placed {
                    Placement::PrefillNode => run_pd(&state, req, &tx).await,
                    Placement::DecodeNode(_) => run_colocated(&state, req, &tx).await,
                };
                if let Err(e) = result {
                    let _ = tx.send(Err(e)).await;
                }
            };
            tokio::select! {
                _ = tx.closed() => tracing::info!("client went away; generation cancelled"),
                r = tokio::time::timeout(Duration::from_millis(timeout_ms), run) => {
                    if r.is_err() {
                        let _ = tx.send(Err(RouterError::Timeout(timeout_ms))).await;
                    }
                }
            }
        }
        .instrument(tracing::Span::current()),
    );
    match rx.recv().await {
        Some(Ok(first)) => Ok((first, rx)),
        Some(Err(e)) => Err(e),
        None => Err(RouterError::Internal(
            "generation ended without a result".into(),
        )),
    }
}

type Tx = mpsc::Sender<Result<Piece, RouterError>>;

/// Why one attempt at a generation failed.
struct Failed {
    error: RouterError,
    /// The worker the failure points at, when one does.
    culprit: Option<Arc<Worker>>,
    /// True once a piece has gone to the client: the request can no longer move.
    progressed: bool,
}

impl Failed {
    fn on(worker: &Arc<Worker>, error: RouterError) -> Self {
        Self {
            error,
            culprit: Some(Arc::clone(worker)),
            progressed: false,
        }
    }
}

/// Runs attempts until one succeeds or the failure may not be retried: a worker that fails
/// before the first piece reaches the client (down, cut off, draining, full) is avoided and
/// the request tries another pair, within `--max-attempts` and the retry budget. After
/// the first piece, a failure ends the stream with an error.
async fn with_retries<'a, F, Fut>(state: &'a AppState, mut attempt: F) -> Result<(), RouterError>
where
    F: FnMut(usize, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<(), Failed>> + 'a,
{
    state.retry_budget.earn();
    let settings = &state.decode.settings;
    let mut avoid = Vec::new();
    let mut last: Option<RouterError> = None;
    for n in 1.. {
        let failed = match attempt(n - 1, avoid.clone()).await {
            Ok(()) => return Ok(()),
            // No worker left to try: the failure that ruled the last one out says more.
            Err(Failed {
                error: RouterError::NoWorkers(role),
                ..
            }) => return Err(last.unwrap_or(RouterError::NoWorkers(role))),
            Err(f) => f,
        };
        if let Some(w) = &failed.culprit {
            // A full worker is busy, not broken: it is avoided but its breaker stays shut.
            match failed.error {
                RouterError::WorkerBusy { .. } => {}
                RouterError::WorkerUnavailable { .. } => {
                    w.failed(settings);
                    w.mark_down();
                }
                _ => w.failed(settings),
            }
            avoid.push(w.addr.clone());
        }
        let again = !failed.progressed
            && failed.error.retryable()
            && failed.culprit.is_some()
            && n < state.cfg.max_attempts
            && state.retry_budget.spend();
        if !again {
            return Err(failed.error);
        }
        tracing::warn!(attempt = n, error = %failed.error, "retrying on another worker");
        state.metrics.retried();
        last = Some(failed.error);
    }
    unreachable!("the attempts loop returns")
}

async fn run_pd(state: &AppState, req: GenRequest, tx: &Tx) -> Result<(), RouterError> {
    with_retries(state, |retry, avoid| {
        attempt_pd(state, &req, retry, avoid, tx)
    })
    .await
}

/// Try `retry` (0: the first) of a PD generation, on a pair chosen avoiding `avoid`.
async fn attempt_pd(
    state: &AppState,
    req: &GenRequest,
    retry: usize,
    avoid: Vec<String>,
    tx: &Tx,
) -> Result<(), Failed> {
    let no_worker = |error| Failed {
        error,
        culprit: None,
        progressed: false,
    };
    let p = state
        .prefill
        .pick_prefill(&avoid, &req.prompt)
        .map_err(no_worker)?;
    let positions = req.prompt.len() + req.max_tokens;
    let d = state
        .decode
        .pick_decode(&avoid, positions, req.sequences)
        .map_err(no_worker)?;
    tracing::debug!(prefill = %p.addr, decode = %d.addr, "picked");
    let result = pd_on(req, retry, state.cfg.kv_reserve_timeout_ms, &p, &d, tx).await;
    match &result {
        Ok(()) => {
            p.succeeded(&state.prefill.settings);
            d.succeeded(&state.decode.settings);
        }
        Err(f) => state.metrics.attempt_failed(match &f.culprit {
            Some(w) if Arc::ptr_eq(w, &p) => Culprit::Prefill,
            Some(_) => Culprit::Decode,
            None => Culprit::None,
        }),
    }
    result
}

/// One PD generation on prefill node `p` and decode node `d`.
async fn pd_on(
    req: &GenRequest,
    attempt: usize,
    reserve_timeout_ms: u64,
    p: &Arc<Worker>,
    d: &Arc<Worker>,
    tx: &Tx,
) -> Result<(), Failed> {
    // The id the decode node matches the KV transfer by (and the nodes log). A retry gets
    // its own, since the same decode node may still hold the failed attempt's cache until
    // it times out.
    let kv_id = match attempt {
        0 => req.id.clone(),
        n => format!("{}-retry{n}", req.id),
    };
    let sampling = Some(req.sampling.clone());
    let generate = runtime::with_request_id(
        &req.log_id,
        GenerateRequest {
            request_id: kv_id.clone(),
            prompt: req.prompt.clone(),
            sampling: sampling.clone(),
            max_tokens: req.max_tokens as u32,
            stop_token_ids: req.stop_ids.clone(),
            prefill_here: false,
            top_logprobs: req.top_logprobs as u32,
            n: req.reported() as u32,
            beam_width: req.beam_width(),
            // The prefill node scores the prompt; this node never runs it.
            prompt_logprobs: false,
        },
    );
    let reported = req.reported();
    let beam = req.beam.is_some();
    let _decode_hold = Hold::new(
        d,
        0,
        req.sequences as u64,
        decode_blocks(d, req.prompt.len() + req.max_tokens, req.sequences),
    );
    let (mut dc, mut pc) = (d.decode(), p.prefill());
    // The decode node reserves the request's KV memory first (queueing for it if need be)
    // and answers with the ticket of its transfer; only then does the prompt go to the
    // prefill node, which presents the ticket when it pushes the cache. So no cache is
    // computed or sent for a decode node that has no room for it. Both calls are answered
    // before the client sees a token, so a failure of either still leaves the request free
    // to start over on another pair; the first failure drops the other call, and its node
    // frees what it held.
    let decode_failed = |s| Failed::on(d, RouterError::worker("decode", &d.addr, s));
    let mut stream = dc
        .generate(generate)
        .await
        .map_err(decode_failed)?
        .into_inner();
    let _ends = ending::end_sequences(req, d, &kv_id);
    let wait = Duration::from_millis(reserve_timeout_ms);
    let ticket = match tokio::time::timeout(wait, stream.message()).await {
        Ok(Ok(Some(proto::v1::GenerateEvent {
            event: Some(Event::Reserved(r)),
        }))) => r.ticket,
        Ok(Ok(_)) => {
            return Err(Failed::on(
                d,
                RouterError::Internal(format!(
                    "decode worker {} answered without reserving the request's KV memory",
                    d.addr
                )),
            ))
        }
        Ok(Err(s)) => return Err(decode_failed(s)),
        Err(_) => {
            return Err(Failed::on(
                d,
                RouterError::WorkerBusy {
                    role: "decode",
                    addr: d.addr.clone(),
                    message: format!(
                        "it found no KV memory for the request within {reserve_timeout_ms} ms"
                    ),
                },
            ))
        }
    };
    let prefill = runtime::with_request_id(
        &req.log_id,
        PrefillRequest {
            request_id: kv_id.clone(),
            prompt: req.prompt.clone(),
            sampling,
            decode_addr: d.addr.clone(),
            top_logprobs: req.top_logprobs as u32,
            n: req.sequences as u32,
            beam_search: beam,
            max_tokens: req.max_tokens as u32,
            kv_ticket: ticket,
            cache_partition: req.cache_partition.clone(),
            stop_token_ids: req.stop_ids.clone(),
            prompt_logprobs: req.prompt_logprobs,
        },
    );
    let first = {
        let _hold = Hold::new(p, req.prompt.len() as u64, 0, 0);
        pc.prefill(prefill).await.map_err(|s| {
            // A transfer that failed is the decode node's doing as often as not.
            let culprit = match proto::error_reason(&s) {
                proto::v1::ErrorReason::KvTransfer => d,
                _ => p,
            };
            Failed::on(culprit, RouterError::worker("prefill", &p.addr, s))
        })?
    };
    let mut first = first.into_inner();
    if req.prompt_logprobs {
        let scored = std::mem::take(&mut first.prompt_logprobs);
        if tx.send(Ok(Piece::Prompt(scored))).await.is_err() {
            return Ok(());
        }
    }
    if first.first.len() != req.sequences {
        return Err(Failed::on(
            p,
            RouterError::Internal(format!(
                "the prefill node sent {} first tokens for {} sequences",
                first.first.len(),
                req.sequences
            )),
        ));
    }
    // The prefill node's figures go with each first token; with beam search the decode
    // node sends the first tokens of the hypotheses it returns, and they get them there.
    if !beam {
        for (choice, token) in first.first.iter().enumerate() {
            let piece = Piece::Token(prefilled(&first, choice as u32, token));
            if tx.send(Ok(piece)).await.is_err() {
                return Ok(());
            }
        }
    }
    forward(stream, reported, Some(&first), "decode", d, tx, !beam).await
}

/// KV blocks a request holds on decode node `d`: `positions` for each of `sequences`, in
/// the node's blocks (0 while its block size is unknown).
fn decode_blocks(d: &Worker, positions: usize, sequences: usize) -> u64 {
    match d.load().kv_block_tokens {
        0 => 0,
        b => (positions as u64).div_ceil(u64::from(b)) * sequences as u64,
    }
}

/// A first token the prefill node sampled, with the prefill's figures.
fn prefilled(p: &PrefillResponse, choice: u32, token: &proto::v1::Token) -> TokenStat {
    TokenStat {
        choice,
        id: token.id,
        logprob: token.logprob,
        top: top_of(token),
        step_ms: p.prefill_time_ms,
        batch_size: p.batch_size,
        queue_wait_us: p.queue_wait_us,
        from_prefill: true,
        cached_tokens: p.cached_tokens,
    }
}

async fn run_colocated(state: &AppState, req: GenRequest, tx: &Tx) -> Result<(), RouterError> {
    with_retries(state, |_, avoid| attempt_colocated(state, &req, avoid, tx)).await
}

/// One try of a colocated generation on a worker chosen avoiding `avoid`.
async fn attempt_colocated(
    state: &AppState,
    req: &GenRequest,
    avoid: Vec<String>,
    tx: &Tx,
) -> Result<(), Failed> {
    let positions = req.prompt.len() + req.max_tokens;
    let w = state
        .decode
        .pick_decode(&avoid, positions, req.sequences)
        .map_err(|error| Failed {
            error,
            culprit: None,
            progressed: false,
        })?;
    let _hold = Hold::new(
        &w,
        0,
        req.sequences as u64,
        decode_blocks(&w, positions, req.sequences),
    );
    let reported = req.reported();
    let generate = runtime::with_request_id(
        &req.log_id,
        GenerateRequest {
            request_id: req.id.clone(),
            prompt: req.prompt.clone(),
            sampling: Some(req.sampling.clone()),
            max_tokens: req.max_tokens as u32,
            stop_token_ids: req.stop_ids.clone(),
            prefill_here: true,
            top_logprobs: req.top_logprobs as u32,
            n: reported as u32,
            beam_width: req.beam_width(),
            prompt_logprobs: req.prompt_logprobs,
        },
    );
    let result = async {
        let stream = w
            .decode()
            .generate(generate)
            .await
            .map_err(|s| Failed::on(&w, RouterError::worker("colocated", &w.addr, s)))?;
        let _ends = ending::end_sequences(req, &w, &req.id);
        forward(
            stream.into_inner(),
            reported,
            None,
            "colocated",
            &w,
            tx,
            false,
        )
        .await
    }
    .await;
    match &result {
        Ok(()) => w.succeeded(&state.decode.settings),
        Err(f) => state.metrics.attempt_failed(match f.culprit {
            Some(_) => Culprit::Colocated,
            None => Culprit::None,
        }),
    }
    result
}

fn top_of(t: &proto::v1::Token) -> Vec<(u32, f32)> {
    t.top.iter().map(|a| (a.id, a.logprob)).collect()
}

/// Passes a worker's events on until every sequence has finished. A first token that the
/// prefill node `prefill` sampled gets that prefill's figures. `progressed` says whether
/// the client has had a piece already (then a failure cannot be retried).
async fn forward(
    mut stream: Streaming<proto::v1::GenerateEvent>,
    sequences: usize,
    prefill: Option<&PrefillResponse>,
    role: &'static str,
    worker: &Arc<Worker>,
    tx: &Tx,
    mut progressed: bool,
) -> Result<(), Failed> {
    let addr = &worker.addr;
    let mut finished = 0;
    while finished < sequences {
        let event = stream.message().await.map_err(|s| Failed {
            error: RouterError::worker(role, addr, s),
            culprit: Some(Arc::clone(worker)),
            progressed,
        })?;
        let piece = match event.and_then(|e| e.event) {
            Some(Event::Token(t)) => {
                let token = t.token.unwrap_or_default();
                Piece::Token(match prefill {
                    Some(p) if t.from_prefill => prefilled(p, t.choice, &token),
                    _ => TokenStat {
                        choice: t.choice,
                        id: token.id,
                        logprob: token.logprob,
                        top: top_of(&token),
                        step_ms: t.step_time_ms,
                        batch_size: t.batch_size,
                        queue_wait_us: t.queue_wait_us,
                        from_prefill: t.from_prefill,
                        cached_tokens: 0,
                    },
                })
            }
            Some(Event::Prompt(p)) => Piece::Prompt(p.tokens),
            Some(Event::Finish(f)) => {
                finished += 1;
                Piece::Finish {
                    choice: f.choice,
                    reason: FinishReason::try_from(f.reason).unwrap_or(FinishReason::Stop),
                }
            }
            Some(Event::Reserved(_)) => {
                return Err(Failed {
                    error: RouterError::Internal(format!(
                        "{role} worker {addr} reserved KV memory in the middle of a stream"
                    )),
                    culprit: Some(Arc::clone(worker)),
                    progressed,
                })
            }
            None => {
                return Err(Failed {
                    error: RouterError::Internal(format!(
                        "{role} worker {addr} ended the stream before every sequence finished"
                    )),
                    culprit: Some(Arc::clone(worker)),
                    progressed,
                })
            }
        };
        if tx.send(Ok(piece)).await.is_err() {
            return Ok(());
        }
        progressed = true;
    }
    Ok(())
}
