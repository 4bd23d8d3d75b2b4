//! Runs one generation on the workers: prefill node then decode node (PD), or one colocated
//! worker. The HTTP layer sees only a stream of tokens with their timings, then a finish.

mod blame;
mod ending;
mod forward;
mod local;
mod out;
mod pd;
mod request;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use proto::v1::FinishReason;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::config::Mode;
use crate::error::RouterError;
use crate::metrics::Culprit;
use crate::placement::{LocalReason, Placement};
use crate::room::{KvNeed, NoRoom};
use crate::state::AppState;
use crate::worker::{PoolSettings, Worker};
use blame::{blame, Blame};
pub use ending::EndedChoices;
use out::{Out, Resume};
use pd::Pair;
pub use request::{AttemptId, GenRequest, Width};

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

/// A generation under way, its first piece already in. Dropping it cancels the
/// generation on every worker it reached.
pub struct Generation {
    first: Option<Piece>,
    rest: mpsc::Receiver<Result<Piece, RouterError>>,
}

impl Generation {
    /// The next piece: the first, then the others in order. Cancel-safe: a piece is taken
    /// only by the call that returns it.
    pub async fn next(&mut self) -> Result<Piece, RouterError> {
        if let Some(first) = self.first.take() {
            return Ok(first);
        }
        match self.rest.recv().await {
            Some(p) => p,
            None => Err(RouterError::Internal("the generation ended early".into())),
        }
    }
}

/// Starts a generation and waits for its first piece, so that a failure before any token
/// becomes a plain HTTP error.
pub async fn start(state: &Arc<AppState>, req: GenRequest) -> Result<Generation, RouterError> {
    room_for(state, &req)?;
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
        Some(Ok(first)) => Ok(Generation {
            first: Some(first),
            rest: rx,
        }),
        Some(Err(e)) => Err(e),
        None => Err(RouterError::Internal(
            "generation ended without a result".into(),
        )),
    }
}

/// Refuses a request that no decode node could ever hold: more KV memory than the largest
/// has, or more sequences than the widest batches.
fn room_for(state: &AppState, req: &GenRequest) -> Result<(), RouterError> {
    let need = KvNeed {
        positions: req.prompt.len() + req.max_tokens,
        sequences: req.sequences(),
    };
    match state.decode.fits_some(need) {
        Ok(()) => Ok(()),
        Err(NoRoom::Kv { largest }) => Err(RouterError::NeverFits {
            param: if req.sequences() > 1 {
                req.width.param()
            } else {
                "max_tokens"
            },
            positions: need.positions,
            sequences: need.sequences,
            largest,
        }),
        Err(NoRoom::Batch { widest }) => Err(RouterError::TooWide {
            param: req.width.param(),
            sequences: req.sequences(),
            widest,
        }),
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

/// One attempt at a generation: the request, its id on the workers, where its prompt is
/// computed, and where its pieces go.
struct Attempt<'a> {
    req: &'a GenRequest,
    id: AttemptId,
    placed: Placement,
    out: &'a Out,
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
            count(w, b, settings);
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

/// Counts a failure against worker `w`. A full worker is busy, not broken: it is avoided
/// but its breaker stays shut.
fn count(w: &Worker, b: Blame, settings: &PoolSettings) {
    match b {
        Blame::Down => {
            w.failed(settings);
            w.mark_down();
        }
        Blame::Fault => w.failed(settings),
        Blame::Busy | Blame::Request => {}
    }
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
        .pick_decode(&avoid, positions, req.sequences())
        .map_err(no_worker)?;
    let placed = Placement::under_pd(
        &state.cfg,
        req.prompt.len(),
        &d,
        decode_blocks(&d, positions, req.sequences()),
    );
    let at = Attempt {
        req,
        id: AttemptId::new(req, retry),
        placed,
        out,
    };
    if let Placement::DecodeNode(_) = placed {
        tracing::debug!(decode = %d.addr, "picked to prefill locally");
        return local_attempt(state, &at, &d).await;
    }
    let p = state
        .prefill
        .pick_prefill(&avoid, &req.prompt)
        .map_err(no_worker)?;
    state.metrics.placed(placed);
    placed_on(placed, Some(&p), &d);
    tracing::debug!(prefill = %p.addr, decode = %d.addr, "picked");
    let pair = Pair {
        prefill: &p,
        decode: &d,
    };
    let wait = Duration::from_millis(state.cfg.kv_reserve_timeout_ms);
    let result = pd::pd_on(&at, pair, wait).await;
    match &result {
        Ok(()) => {
            p.succeeded(&state.prefill.settings);
            d.succeeded(&state.decode.settings);
        }
        Err(f) => state.metrics.attempt_failed(pd_culprit(f, &p)),
    }
    result
}

/// What a failed PD attempt on prefill node `p` is counted against in the metrics.
fn pd_culprit(f: &Failed, p: &Arc<Worker>) -> Culprit {
    match (&f.culprit, f.counted()) {
        (None, _) => Culprit::None,
        (Some(_), None) => Culprit::Request,
        (Some(w), _) if Arc::ptr_eq(w, p) => Culprit::Prefill,
        (Some(_), _) => Culprit::Decode,
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
        .pick_decode(&avoid, req.prompt.len() + req.max_tokens, req.sequences())
        .map_err(|error| Failed {
            error,
            culprit: None,
            progressed: false,
        })?;
    let at = Attempt {
        req,
        id: AttemptId::new(req, retry),
        placed: Placement::DecodeNode(LocalReason::Colocated),
        out,
    };
    local_attempt(state, &at, &w).await
}

/// Records in the request's span where its latest attempt runs, by the workers' names
/// (never their addresses), for the access log (crate::access).
fn placed_on(placed: Placement, prefill: Option<&Worker>, decode: &Worker) {
    let span = tracing::Span::current();
    span.record("placement", placed.as_str());
    span.record("prefill", prefill.map_or("none", |p| p.name.as_str()));
    span.record("decode", decode.name.as_str());
}

/// An attempt on worker `w`, which computes the prompt itself (`at.placed` says why), with
/// its outcome counted.
async fn local_attempt(state: &AppState, at: &Attempt<'_>, w: &Arc<Worker>) -> Result<(), Failed> {
    let placed = at.placed;
    state.metrics.placed(placed);
    placed_on(placed, None, w);
    let result = local::local_on(at, w).await;
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
