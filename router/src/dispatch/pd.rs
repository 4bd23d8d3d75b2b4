//! A generation split across a prefill node and a decode node.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::{generate_event::Event, GenerateRequest, PrefillRequest, PrefillResponse};

use super::forward::{forward, top_of, Source};
use super::out::Out;
use super::{decode_blocks, Failed, GenRequest, Piece, TokenStat};
use crate::ending;
use crate::error::RouterError;
use crate::placement::Placement;
use crate::worker::{Hold, Worker};

/// One PD generation on prefill node `p` and decode node `d`.
pub(super) async fn pd_on(
    req: &GenRequest,
    kv_id: String,
    placed: Placement,
    reserve_timeout_ms: u64,
    p: &Arc<Worker>,
    d: &Arc<Worker>,
    out: &Out,
) -> Result<(), Failed> {
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
            resumed: req.resumed as u32,
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
            resumed: req.resumed as u32,
        },
    );
    let first = {
        let _hold = Hold::new(p, req.prompt.len() as u64, 0, 0);
        req.prompt_taken();
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
        if !out.send(Piece::Prompt(scored)).await {
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
            let piece = Piece::Token(prefilled(&first, choice as u32, token, placed));
            if !out.send(piece).await {
                return Ok(());
            }
        }
    }
    let src = Source {
        role: "decode",
        worker: d,
        prefill: Some(&first),
        placement: placed,
    };
    forward(stream, reported, src, out, !beam, None).await
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
