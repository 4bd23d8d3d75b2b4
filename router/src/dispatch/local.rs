//! A generation whose prompt its decode node computes: colocated mode, and short prompts
//! under PD.

use std::sync::Arc;

use super::ending::end_sequences;
use super::forward::{forward, Source};
use super::request::PromptOn;
use super::{decode_blocks, Attempt, Failed};
use crate::error::RouterError;
use crate::placement::{LocalReason, Placement};
use crate::worker::{Hold, Worker};

/// One generation on worker `w`, which computes the prompt itself.
pub(super) async fn local_on(at: &Attempt<'_>, w: &Arc<Worker>) -> Result<(), Failed> {
    let req = at.req;
    let positions = req.prompt.len() + req.max_tokens;
    let _hold = Hold::new(
        w,
        0,
        req.sequences() as u64,
        decode_blocks(w, positions, req.sequences()),
    );
    // The prompt tokens it computes count until its first event: the room check of the
    // next short prompt (crate::placement) sees them.
    let computing = Hold::new(w, req.prompt.len() as u64, 0, 0);
    let role = match at.placed {
        Placement::DecodeNode(LocalReason::Colocated) => "colocated",
        _ => "decode",
    };
    let generate = req.generate(&at.id, PromptOn::DecodeNode);
    req.prompt_taken();
    let stream = w
        .decode()
        .generate(generate)
        .await
        .map_err(|s| Failed::on(w, RouterError::worker(role, &w.addr, s)))?;
    let _ends = end_sequences(req, w, &at.id);
    let src = Source {
        role,
        worker: w,
        prefill: None,
        placement: at.placed,
    };
    forward(
        stream.into_inner(),
        req.reported(),
        src,
        at.out,
        false,
        Some(computing),
    )
    .await
}
