//! Runs one generation on the workers: prefill node then decode node (PD), or one colocated
//! worker. The HTTP layer sees only a stream of tokens with their timings, then a finish.

mod blame;
mod forward;
mod local;
mod out;
mod pd;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use proto::v1::FinishReason;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::config::Mode;
use crate::error::RouterError;
use crate::keys::Spent;
use crate::metrics::Culprit;
use crate::placement::{LocalReason, Placement};
use crate::room::{KvNeed, NoRoom};
use crate::state::AppState;
use crate::worker::Worker;
use blame::{blame, Blame};
use out::{Out, Resume};

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
    /// The parameter that set `sequences` (`n` or `best_of`), for the errors that name it.
    pub sequences_param: &'static str,
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
    /// The prompt's last tokens that are output the client already has: an attempt that
    /// moved the stream from a failed decode node.
    pub resumed: usize,
    /// The least its API key is charged, raised to the prompt when a worker takes it.
    pub spent: Option<Spent>,
}

impl GenRequest {
    /// Counts the prompt as spent: a worker is about to compute it.
    fn prompt_taken(&self) {
        if let Some(s) = &self.spent {
            s.at_least(self.prompt.len() as u64);
        }
    }

    /// Sequences the workers report back, each ending with its own finish.
    pub fn reported(&self) -> usize {
        self.beam.unwrap_or(self.sequences)
    }

    /// Whether a failure after some tokens can move the generation to other workers: one
    /// sequence, no beam search (see `out`).
    fn movable(&self) -> bool {
        self.reported() == 1 && self.beam.is_none()
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
    /// Where the request's prompt was computed.
    pub placement: Placement,
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
    let need = KvNeed {
        positions: req.prompt.len() + req.max_tokens,
        sequences: req.sequences,
    };
    match state.decode.fits_some(need) {
        Ok(()) => {}
        Err(NoRoom::Kv { largest }) => {
            return Err(RouterError::NeverFits {
                param: if req.sequences > 1 {
                    req.sequences_param
                } else {
                    "max_tokens"
                },
                positions: need.positions,
                sequences: need.sequences,
                largest,
            })
        }
        Err(NoRoom::Batch { widest }) => {
            return Err(RouterError::TooWide {
                param: req.sequences_param,
                sequences: req.sequences,
                widest,
            })
        }
    }
    let (tx, mut rx) = mpsc::channel(64);
    let state = Arc::clone(state);
    let timeout_ms = state.cfg.request_timeout_ms;
    tokio::spawn(
        async move {
            let run = async {
                let moves = req.movable() && state.cfg.stream_migration;
                let (state, out) = (&*state, &Out::new(tx.clone(), moves));
                let result = with_retries(state, &req, out, |req, retry, avoid| async move {
                    match state.cfg.mode {
                        Mode::Pd => attempt_pd(state, req, retry, avoid, out).await,
                        Mode::Colocated => attempt_colocated(state, req, retry, avoid, out).await,
                    }
                })
                .await;
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
    /// True once a piece has gone to the client: the request can no longer start afresh,
    /// only move (stream migration).
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

    /// The worker the failure counts against, and how; `None` when it counts against no
    /// worker.
    fn counted(&self) -> Option<(&Arc<Worker>, Blame)> {
        let w = self.culprit.as_ref()?;
        match blame(&self.error, self.progressed) {
            Blame::Request => None,
            b => Some((w, b)),
        }
    }
}

/// Runs attempts until one succeeds or the failure may not be retried: a worker that fails
/// before the first piece reaches the client (down, cut off, draining, full) is avoided and
/// the request tries another pair, within `--max-attempts` and the retry budget. After
/// the first piece, a request that `out` says moves (`--stream-migration`): the next attempt
/// resumes after the tokens the client has, within `--max-attempts` but outside the retry
/// budget, since a decode node's death moves every stream it held at once. Otherwise the
/// failure ends the stream with an error.
async fn with_retries<'a, F, Fut>(
    state: &'a AppState,
    req: &'a GenRequest,
    out: &'a Out,
    mut attempt: F,
) -> Result<(), RouterError>
where
    F: FnMut(Cow<'a, GenRequest>, usize, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<(), Failed>> + 'a,
{
    state.retry_budget.earn();
    let settings = &state.decode.settings;
    let mut avoid = Vec::new();
    let mut last: Option<RouterError> = None;
    let mut progressed = false;
    for n in 1.. {
        let this = match out.resume(req) {
            Resume::Afresh => Cow::Borrowed(req),
            Resume::After(moved) => Cow::Owned(*moved),
            Resume::Ended(reason) => {
                out.finish(reason).await;
                return Ok(());
            }
        };
        let failed = match attempt(this, n - 1, avoid.clone()).await {
            Ok(()) => return Ok(()),
            // No worker left to try: the failure that ruled the last one out says more.
            Err(Failed {
                error: RouterError::NoWorkers(role),
                ..
            }) => return Err(last.unwrap_or(RouterError::NoWorkers(role))),
            Err(f) => f,
        };
        if let Some((w, b)) = failed.counted() {
            // A full worker is busy, not broken: it is avoided but its breaker stays shut.
            match b {
                Blame::Down => {
                    w.failed(settings);
                    w.mark_down();
                }
                Blame::Fault => w.failed(settings),
                Blame::Busy | Blame::Request => {}
            }
            avoid.push(w.addr.clone());
        }
        progressed |= failed.progressed;
        let worth_it =
            failed.error.retryable() && failed.culprit.is_some() && n < state.cfg.max_attempts;
        let again = match progressed {
            false => worth_it && state.retry_budget.spend(),
            true => worth_it && out.moves(),
        };
        if !again {
            return Err(failed.error);
        }
        if progressed {
            tracing::warn!(attempt = n, error = %failed.error,
                "moving the stream to another decode node");
            state.metrics.migrated();
        } else {
            tracing::warn!(attempt = n, error = %failed.error, "retrying on another worker");
        }
        state.metrics.retried();
        last = Some(failed.error);
    }
    unreachable!("the attempts loop returns")
}

/// Try `retry` (0: the first) of a PD generation, on a pair chosen avoiding `avoid`.
async fn attempt_pd(
    state: &AppState,
    req: Cow<'_, GenRequest>,
    retry: usize,
    avoid: Vec<String>,
    out: &Out,
) -> Result<(), Failed> {
    let req = &*req;
    let no_worker = |error| Failed {
        error,
        culprit: None,
        progressed: false,
    };
    let positions = req.prompt.len() + req.max_tokens;
    let d = state
        .decode
        .pick_decode(&avoid, positions, req.sequences)
        .map_err(no_worker)?;
    let placed = Placement::under_pd(
        &state.cfg,
        req.prompt.len(),
        &d,
        decode_blocks(&d, positions, req.sequences),
    );
    let kv_id = attempt_id(req, retry);
    if let Placement::DecodeNode(_) = placed {
        tracing::debug!(decode = %d.addr, "picked to prefill locally");
        return local_attempt(state, req, kv_id, placed, &d, out).await;
    }
    let p = state
        .prefill
        .pick_prefill(&avoid, &req.prompt)
        .map_err(no_worker)?;
    state.metrics.placed(placed);
    tracing::debug!(prefill = %p.addr, decode = %d.addr, "picked");
    let result = pd::pd_on(
        req,
        kv_id,
        placed,
        state.cfg.kv_reserve_timeout_ms,
        &p,
        &d,
        out,
    )
    .await;
    match &result {
        Ok(()) => {
            p.succeeded(&state.prefill.settings);
            d.succeeded(&state.decode.settings);
        }
        Err(f) => state
            .metrics
            .attempt_failed(match (&f.culprit, f.counted()) {
                (None, _) => Culprit::None,
                (Some(_), None) => Culprit::Request,
                (Some(w), _) if Arc::ptr_eq(w, &p) => Culprit::Prefill,
                (Some(_), _) => Culprit::Decode,
            }),
    }
    result
}

/// The id attempt `retry` (0: the first) of `req` has on its workers, which match its KV
/// transfer and its ended sequences by it (and log it). A retry gets its own, since the
/// same decode node may still hold the failed attempt's cache until it times out.
fn attempt_id(req: &GenRequest, retry: usize) -> String {
    match retry {
        0 => req.id.clone(),
        n => format!("{}-retry{n}", req.id),
    }
}

/// KV blocks a request holds on decode node `d`: `positions` for each of `sequences`, in
/// the node's blocks (0 while its block size is unknown).
fn decode_blocks(d: &Worker, positions: usize, sequences: usize) -> u64 {
    match d.load().kv_block_tokens {
        0 => 0,
        b => (positions as u64).div_ceil(u64::from(b)) * sequences as u64,
    }
}

/// One try of a colocated generation on a worker chosen avoiding `avoid`.
async fn attempt_colocated(
    state: &AppState,
    req: Cow<'_, GenRequest>,
    retry: usize,
    avoid: Vec<String>,
    out: &Out,
) -> Result<(), Failed> {
    let req = &*req;
    let w = state
        .decode
        .pick_decode(&avoid, req.prompt.len() + req.max_tokens, req.sequences)
        .map_err(|error| Failed {
            error,
            culprit: None,
            progressed: false,
        })?;
    let placed = Placement::DecodeNode(LocalReason::Colocated);
    local_attempt(state, req, attempt_id(req, retry), placed, &w, out).await
}

/// An attempt on worker `w`, which computes the prompt itself (`placed` says why), with
/// its outcome counted.
async fn local_attempt(
    state: &AppState,
    req: &GenRequest,
    id: String,
    placed: Placement,
    w: &Arc<Worker>,
    out: &Out,
) -> Result<(), Failed> {
    state.metrics.placed(placed);
    let result = local::local_on(req, id, placed, w, out).await;
    match &result {
        Ok(()) => w.succeeded(&state.decode.settings),
        Err(f) => state
            .metrics
            .attempt_failed(match (&f.culprit, f.counted(), placed) {
                (None, _, _) => Culprit::None,
                (Some(_), None, _) => Culprit::Request,
                (Some(_), _, Placement::DecodeNode(LocalReason::Colocated)) => Culprit::Colocated,
                (Some(_), _, _) => Culprit::Decode,
            }),
    }
    result
}
