//! A generation whose prompt its decode node computes: colocated mode, and short prompts
//! under PD.

use std::sync::Arc;

use proto::v1::GenerateRequest;

use super::forward::{forward, Source};
use super::out::Out;
use super::{decode_blocks, Failed, GenRequest};
use crate::ending;
use crate::error::RouterError;
use crate::placement::{LocalReason, Placement};
use crate::worker::{Hold, Worker};

/// One generation on worker `w`, which computes the prompt itself; `id` is the attempt's
/// id on the worker.
pub(super) async fn local_on(
    req: &GenRequest,
    id: String,
    placed: Placement,
    w: &Arc<Worker>,
    out: &Out,
) -> Result<(), Failed> {
    let positions = req.prompt.len() + req.max_tokens;
    let _hold = Hold::new(
        w,
        0,
        req.sequences as u64,
        decode_blocks(w, positions, req.sequences),
    );
    // The prompt tokens it computes count until its first event: the room check of the
    // next short prompt (crate::placement) sees them.
    let computing = Hold::new(w, req.prompt.len() as u64, 0, 0);
    let reported = req.reported();
    let role = match placed {
        Placement::DecodeNode(LocalReason::Colocated) => "colocated",
        _ => "decode",
    };
    let generate = runtime::with_request_id(
        &req.log_id,
        GenerateRequest {
            request_id: id.clone(),
            prompt: req.prompt.clone(),
            sampling: Some(req.sampling.clone()),
            max_tokens: req.max_tokens as u32,
            stop_token_ids: req.stop_ids.clone(),
            prefill_here: true,
            top_logprobs: req.top_logprobs as u32,
            n: reported as u32,
            beam_width: req.beam_width(),
            prompt_logprobs: req.prompt_logprobs,
            resumed: req.resumed as u32,
        },
    );
    req.prompt_taken();
    let stream = w
        .decode()
        .generate(generate)
        .await
        .map_err(|s| Failed::on(w, RouterError::worker(role, &w.addr, s)))?;
    let _ends = ending::end_sequences(req, w, &id);
    let src = Source {
        role,
        worker: w,
        prefill: None,
        placement: placed,
    };
    forward(
        stream.into_inner(),
        reported,
        src,
        out,
        false,
        Some(computing),
    )
    .await
}
