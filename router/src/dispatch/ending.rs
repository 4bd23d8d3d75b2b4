//! Choices the client's output ends early: with n > 1 the router meets a stop string in one
//! sequence while the others go on, and tells the decode node (EndSequence) to stop decoding
//! it, which frees its memory and its share of each step.

use std::sync::Arc;

use proto::limits::MAX_SEQUENCES;
use proto::v1::EndSequenceRequest;
use tracing::Instrument;

use super::{AttemptId, GenRequest};
use crate::worker::Worker;

/// Choices of a request that the client's output ended early: one bit for each sequence a
/// request may have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndedChoices(u128);

const _: () = assert!(MAX_SEQUENCES <= u128::BITS as usize);

impl EndedChoices {
    /// These and `choice`.
    pub fn with(self, choice: u32) -> Self {
        match 1u128.checked_shl(choice) {
            Some(bit) => Self(self.0 | bit),
            None => self,
        }
    }

    /// The choices among these that are not among `sent`.
    fn beyond(self, sent: Self) -> impl Iterator<Item = u32> {
        let new = self.0 & !sent.0;
        (0..u128::BITS).filter(move |c| new >> c & 1 == 1)
    }
}

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
        let mut sent = EndedChoices::default();
        loop {
            let now = *ended.borrow_and_update();
            let new = now.beyond(sent);
            sent = now;
            for choice in new {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_choices_not_yet_sent_are_sent() {
        let sent = EndedChoices::default().with(0).with(5);
        let now = sent.with(127).with(3);
        assert_eq!(now.beyond(sent).collect::<Vec<_>>(), [3, 127]);
        assert_eq!(sent.beyond(now).count(), 0);
        // Past the contract's limit there is no choice to end.
        assert_eq!(now.with(128), now);
    }
}
