//! A worker's stream of events, passed on to the client's side as pieces.

use std::sync::Arc;

use proto::v1::{generate_event::Event, FinishReason, PrefillResponse};
use tonic::Streaming;

use super::out::Out;
use super::{Failed, Piece, TokenStat};
use crate::error::RouterError;
use crate::placement::Placement;
use crate::worker::{Hold, Worker};

/// Where a stream's events come from.
pub(super) struct Source<'a> {
    /// The worker's role, for errors.
    pub role: &'static str,
    pub worker: &'a Arc<Worker>,
    /// The prefill whose figures go with the first tokens that a prefill node sampled.
    pub prefill: Option<&'a PrefillResponse>,
    /// Where the request's prompt was computed.
    pub placement: Placement,
}

fn top_of(t: &proto::v1::Token) -> Vec<(u32, f32)> {
    t.top.iter().map(|a| (a.id, a.logprob)).collect()
}

/// Passes a worker's events on until every sequence has finished. A first token that the
/// prefill node sampled gets that prefill's figures. `progressed` says whether the client
/// has had a piece already (then a failure cannot be retried). `computing`, the prompt
/// tokens the worker computes for this request, is let go at its first event.
pub(super) async fn forward(
    mut stream: Streaming<proto::v1::GenerateEvent>,
    sequences: usize,
    src: Source<'_>,
    out: &Out,
    mut progressed: bool,
    mut computing: Option<Hold>,
) -> Result<(), Failed> {
    let mut finished = 0;
    while finished < sequences {
        let failed = |error| Failed {
            error,
            culprit: Some(Arc::clone(src.worker)),
            progressed,
        };
        let event = stream
            .message()
            .await
            .map_err(|s| failed(RouterError::worker(src.role, &src.worker.addr, s)))?;
        drop(computing.take());
        let piece = piece_of(event.and_then(|e| e.event), &src).map_err(failed)?;
        finished += usize::from(matches!(piece, Piece::Finish { .. }));
        if !out.send(piece).await {
            return Ok(());
        }
        progressed = true;
    }
    Ok(())
}

/// The piece a worker's event stands for, or why the event is the worker's fault.
fn piece_of(event: Option<Event>, src: &Source<'_>) -> Result<Piece, RouterError> {
    let (role, addr) = (src.role, &src.worker.addr);
    Ok(match event {
        Some(Event::Token(t)) => {
            let token = t.token.unwrap_or_default();
            Piece::Token(match src.prefill {
                Some(p) if t.from_prefill => prefilled(p, t.choice, &token, src.placement),
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
                    placement: src.placement,
                },
            })
        }
        Some(Event::Prompt(p)) => Piece::Prompt(p.tokens),
        Some(Event::Finish(f)) => Piece::Finish {
            choice: f.choice,
            reason: FinishReason::try_from(f.reason).unwrap_or(FinishReason::Stop),
        },
        Some(Event::Reserved(_)) => {
            return Err(RouterError::Internal(format!(
                "{role} worker {addr} reserved KV memory in the middle of a stream"
            )))
        }
        None => {
            return Err(RouterError::Internal(format!(
                "{role} worker {addr} ended the stream before every sequence finished"
            )))
        }
    })
}

/// A first token the prefill node sampled, with the prefill's figures.
pub(super) fn prefilled(
    p: &PrefillResponse,
    choice: u32,
    token: &proto::v1::Token,
    placement: Placement,
) -> TokenStat {
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
        placement,
    }
}
