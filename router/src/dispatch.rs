//! Runs one generation on the workers: prefill node then decode node (PD), or one colocated
//! worker. The HTTP layer sees only a stream of tokens with their timings, then a finish.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::{
    generate_event::Event, FinishReason, GenerateRequest, PrefillRequest, PrefillResponse,
};
use tokio::sync::mpsc;
use tonic::Streaming;
use tracing::Instrument;

use crate::config::Mode;
use crate::error::RouterError;
use crate::state::AppState;

/// A tokenized, validated request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub id: String,
    pub prompt: Vec<u32>,
    pub sampling: engine::SamplingParams,
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
    Token(TokenStat),
    Finish { choice: u32, reason: FinishReason },
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
                let result = match state.cfg.mode {
                    Mode::Pd => run_pd(&state, req, &tx).await,
                    Mode::Colocated => run_colocated(&state, req, &tx).await,
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

async fn run_pd(state: &AppState, req: GenRequest, tx: &Tx) -> Result<(), RouterError> {
    let p = state.prefill.pick()?;
    let d = state.decode.pick()?;
    tracing::debug!(prefill = %p.addr, decode = %d.addr, "picked");
    let sampling = Some(proto::v1::SamplingParams::from(&req.sampling));
    let generate = runtime::with_request_id(
        &req.id,
        GenerateRequest {
            request_id: req.id.clone(),
            prompt: req.prompt.clone(),
            sampling,
            max_new_tokens: (req.max_tokens - 1) as u32,
            stop_token_ids: req.stop_ids.clone(),
            prefill_here: false,
            top_logprobs: req.top_logprobs as u32,
            n: req.reported() as u32,
            beam_width: req.beam_width(),
        },
    );
    let reported = req.reported();
    let beam = req.beam.is_some();
    let prefill = runtime::with_request_id(
        &req.id,
        PrefillRequest {
            request_id: req.id.clone(),
            prompt: req.prompt,
            sampling,
            decode_addr: d.addr.clone(),
            top_logprobs: req.top_logprobs as u32,
            n: req.sequences as u32,
            beam_search: beam,
        },
    );
    let (mut dc, mut pc) = (d.decode(), p.prefill());
    // The decode node waits for the KV cache the prefill node sends it, so both calls go
    // out together.
    let (stream, first) = tokio::join!(dc.generate(generate), pc.prefill(prefill));
    let first = first.map_err(|s| RouterError::worker("prefill", &p.addr, s))?;
    let stream = stream.map_err(|s| RouterError::worker("decode", &d.addr, s))?;
    let first = first.into_inner();
    if first.first.len() != req.sequences {
        return Err(RouterError::Internal(format!(
            "the prefill node sent {} first tokens for {} sequences",
            first.first.len(),
            req.sequences
        )));
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
    forward(
        stream.into_inner(),
        reported,
        Some(&first),
        "decode",
        &d.addr,
        tx,
    )
    .await
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
    let w = state.decode.pick()?;
    let reported = req.reported();
    let beam_width = req.beam_width();
    let generate = runtime::with_request_id(
        &req.id,
        GenerateRequest {
            request_id: req.id.clone(),
            prompt: req.prompt,
            sampling: Some((&req.sampling).into()),
            max_new_tokens: req.max_tokens as u32,
            stop_token_ids: req.stop_ids,
            prefill_here: true,
            top_logprobs: req.top_logprobs as u32,
            n: reported as u32,
            beam_width,
        },
    );
    let stream = w
        .decode()
        .generate(generate)
        .await
        .map_err(|s| RouterError::worker("colocated", &w.addr, s))?;
    forward(
        stream.into_inner(),
        reported,
        None,
        "colocated",
        &w.addr,
        tx,
    )
    .await
}

fn top_of(t: &proto::v1::Token) -> Vec<(u32, f32)> {
    t.top.iter().map(|a| (a.id, a.logprob)).collect()
}

/// Passes a worker's events on until every sequence has finished. A first token that the
/// prefill node `prefill` sampled gets that prefill's figures.
async fn forward(
    mut stream: Streaming<proto::v1::GenerateEvent>,
    sequences: usize,
    prefill: Option<&PrefillResponse>,
    role: &'static str,
    addr: &str,
    tx: &Tx,
) -> Result<(), RouterError> {
    let mut finished = 0;
    while finished < sequences {
        let event = stream
            .message()
            .await
            .map_err(|s| RouterError::worker(role, addr, s))?;
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
            Some(Event::Finish(f)) => {
                finished += 1;
                Piece::Finish {
                    choice: f.choice,
                    reason: FinishReason::try_from(f.reason).unwrap_or(FinishReason::Stop),
                }
            }
            None => {
                return Err(RouterError::Internal(format!(
                    "{role} worker {addr} ended the stream before every sequence finished"
                )))
            }
        };
        if tx.send(Ok(piece)).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}
