//! A generation split across a prefill node and a decode node.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::{generate_event::Event, GenerateEvent, PrefillResponse};
use tonic::Streaming;

use super::ending::{end_sequences, EndSequences};
use super::forward::{forward, prefilled, Source};
use super::request::PromptOn;
use super::{decode_blocks, Attempt, Failed, Piece};
use crate::error::RouterError;
use crate::worker::{Hold, Worker};

/// The workers of a PD attempt.
pub(super) struct Pair<'a> {
    pub(super) prefill: &'a Arc<Worker>,
    pub(super) decode: &'a Arc<Worker>,
}

/// One PD generation on `pair`. The decode node reserves the request's KV memory first
/// (queueing for it up to `reserve_wait`) and answers with the ticket of its transfer; only
/// then does the prompt go to the prefill node, which presents the ticket when it pushes
/// the cache. So no cache is computed or sent for a decode node that has no room for it.
/// Both calls are answered before the client sees a token, so a failure of either still
/// leaves the request free to start over on another pair; the first failure drops the
/// other call, and its node frees what it held.
pub(super) async fn pd_on(
    at: &Attempt<'_>,
    pair: Pair<'_>,
    reserve_wait: Duration,
) -> Result<(), Failed> {
    let (req, d) = (at.req, pair.decode);
    let _decode_hold = Hold::new(
        d,
        0,
        req.sequences() as u64,
        decode_blocks(d, req.prompt.len() + req.max_tokens, req.sequences()),
    );
    let reserved = reserve(at, d, reserve_wait).await?;
    let mut first = prefill(at, &pair, reserved.ticket).await?;
    if req.prompt_logprobs {
        let scored = std::mem::take(&mut first.prompt_logprobs);
        if !at.out.send(Piece::Prompt(scored)).await {
            return Ok(());
        }
    }
    // The prefill node's figures go with each first token; with beam search the decode
    // node sends the first tokens of the hypotheses it returns, and they get them there.
    let beam = req.width.beam;
    if !beam {
        for (choice, token) in first.first.iter().enumerate() {
            let piece = Piece::Token(prefilled(&first, choice as u32, token, at.placed));
            if !at.out.send(piece).await {
                return Ok(());
            }
        }
    }
    let src = Source {
        role: "decode",
        worker: d,
        prefill: Some(&first),
        placement: at.placed,
    };
    forward(reserved.stream, req.reported(), src, at.out, !beam, None).await
}

/// A decode node's answer to an attempt: its memory is reserved.
struct Reserved {
    /// The node's events for the attempt.
    stream: Streaming<GenerateEvent>,
    /// What the prefill node presents when it pushes the cache.
    ticket: Vec<u8>,
    /// Tells the node of choices ended early, while the attempt lasts.
    _ends: Option<EndSequences>,
}

/// Asks decode node `d` to run the attempt and waits up to `wait` for the ticket of its
/// reserved KV memory.
async fn reserve(at: &Attempt<'_>, d: &Arc<Worker>, wait: Duration) -> Result<Reserved, Failed> {
    let decode_failed = |s| Failed::on(d, RouterError::worker("decode", &d.addr, s));
    let mut stream = d
        .decode()
        .generate(at.req.generate(&at.id, PromptOn::PrefillNode))
        .await
        .map_err(decode_failed)?
        .into_inner();
    let ends = end_sequences(at.req, d, &at.id);
    let ticket = match tokio::time::timeout(wait, stream.message()).await {
        Ok(Ok(Some(GenerateEvent {
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
                        "it found no KV memory for the request within {} ms",
                        wait.as_millis()
                    ),
                },
            ))
        }
    };
    Ok(Reserved {
        stream,
        ticket,
        _ends: ends,
    })
}

/// Runs the prompt on the pair's prefill node, which ships the cache to the decode node
/// with `ticket`, and checks it sampled a first token for every sequence.
async fn prefill(
    at: &Attempt<'_>,
    pair: &Pair<'_>,
    ticket: Vec<u8>,
) -> Result<PrefillResponse, Failed> {
    let (req, p, d) = (at.req, pair.prefill, pair.decode);
    let call = req.prefill(&at.id, &d.addr, ticket);
    let first = {
        let _hold = Hold::new(p, req.prompt.len() as u64, 0, 0);
        req.prompt_taken();
        p.prefill().prefill(call).await.map_err(|s| {
            // A transfer that failed is the decode node's doing as often as not.
            let culprit = match proto::error_reason(&s) {
                proto::v1::ErrorReason::KvTransfer => d,
                _ => p,
            };
            Failed::on(culprit, RouterError::worker("prefill", &p.addr, s))
        })?
    };
    let first = first.into_inner();
    if first.first.len() != req.sequences() {
        return Err(Failed::on(
            p,
            RouterError::Internal(format!(
                "the prefill node sent {} first tokens for {} sequences",
                first.first.len(),
                req.sequences()
            )),
        ));
    }
    Ok(first)
}
