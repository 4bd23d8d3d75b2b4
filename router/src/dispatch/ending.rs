//! Choices the client's output ends early: with n > 1 the router meets a stop string in one
//! sequence while the others go on, and tells the decode node (EndSequence) to stop decoding
//! it, which frees its memory and its share of each step.

use std::sync::Arc;

use proto::v1::EndSequenceRequest;
use tracing::Instrument;

use super::{AttemptId, GenRequest};
use crate::worker::Worker;

/// Passes the choices the client's output ends early (a stop string met while the request's
/// other choices go on) to decode node `d` as EndSequence calls, until dropped.
pub(super) struct EndSequences(tokio::task::JoinHandle<()>);

impl Drop for EndSequences {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts passing the choices of attempt `id` of `req` that the client's output ends early
/// to decode node `d`; `None` for a request where none can end early.
pub(super) fn end_sequences(
    req: &GenRequest,
    d: &Arc<Worker>,
    id: &AttemptId,
) -> Option<EndSequences> {
    let mut ended = req.ended.clone()?;
    let (d, id, log_id) = (Arc::clone(d), id.clone(), req.log_id.clone());
    let task = async move {
        let mut sent = 0u128;
        loop {
            let new = *ended.borrow_and_update() & !sent;
            sent |= new;
            for choice in (0..128u32).filter(|c| new >> c & 1 == 1) {
                let call = EndSequenceRequest {
                    request_id: id.as_str().to_string(),
                    choice,
                };
                let call = runtime::with_request_id(&log_id, call);
                if let Err(s) = d.decode().end_sequence(call).await {
                    tracing::debug!(status = %s, choice, "the decode node did not end a sequence");
                }
            }
            if ended.changed().await.is_err() {
                return;
            }
        }
    };
    Some(EndSequences(tokio::spawn(
        task.instrument(tracing::Span::current()),
    )))
}

