//! Where a generation's pieces go, and what they tell a later attempt: a stream whose
//! decode node fails after some tokens moves to another one (stream migration), which
//! resumes after the tokens the client has.

use std::sync::Mutex;

use proto::v1::FinishReason;

use super::{GenRequest, Piece, Tx};

/// The channel to the client's side, remembering the tokens of sequence 0 sent on it.
pub(super) struct Out {
    tx: Tx,
    delivered: Mutex<Vec<u32>>,
}

/// How an attempt after a failure starts: afresh, after the tokens delivered, or not at
/// all because the sequence had already ended.
pub(super) enum Resume {
    Afresh,
    After(Box<GenRequest>),
    Ended(FinishReason),
}

impl Out {
    pub(super) fn new(tx: Tx) -> Self {
        Self {
            tx,
            delivered: Mutex::new(Vec::new()),
        }
    }

    /// Sends `piece`; false once the client has gone.
    pub(super) async fn send(&self, piece: Piece) -> bool {
        if let Piece::Token(t) = &piece {
            if t.choice == 0 {
                self.delivered
                    .lock()
                    .expect("the delivered tokens' lock is never poisoned")
                    .push(t.id);
            }
        }
        self.tx.send(Ok(piece)).await.is_ok()
    }

    /// How the next attempt at `req` starts. Only a single sequence moves, so only then
    /// is anything delivered when an attempt begins.
    pub(super) fn resume(&self, req: &GenRequest) -> Resume {
        let delivered = self
            .delivered
            .lock()
            .expect("the delivered tokens' lock is never poisoned");
        let Some(last) = delivered.last() else {
            return Resume::Afresh;
        };
        // The node failed between the sequence's last token and its finish.
        if req.stop_ids.contains(last) {
            return Resume::Ended(FinishReason::Stop);
        }
        if delivered.len() >= req.max_tokens {
            return Resume::Ended(FinishReason::Length);
        }
        let mut moved = req.clone();
        moved.prompt.extend_from_slice(&delivered);
        moved.max_tokens -= delivered.len();
        moved.resumed = delivered.len();
        // The prompt's logprobs went out before its first token.
        moved.prompt_logprobs = false;
        Resume::After(Box::new(moved))
    }

    /// Ends sequence 0 with `reason`, for an attempt that found it ended.
    pub(super) async fn finish(&self, reason: FinishReason) {
        let _ = self.send(Piece::Finish { choice: 0, reason }).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::TokenStat;
    use crate::placement::{Placement, RemoteReason};
    use tokio::sync::mpsc;

    fn request() -> GenRequest {
        GenRequest {
            id: "r".into(),
            log_id: "r".into(),
            prompt: vec![1, 2, 3],
            sampling: Default::default(),
            max_tokens: 5,
            stop_ids: vec![9],
            top_logprobs: 0,
            sequences: 1,
            beam: None,
            cache_partition: Vec::new(),
            prompt_logprobs: true,
            ended: None,
            resumed: 0,
        }
    }

    fn token(id: u32) -> Piece {
        Piece::Token(TokenStat {
            choice: 0,
            id,
            logprob: 0.0,
            top: Vec::new(),
            step_ms: 0.0,
            batch_size: 1,
            queue_wait_us: 0,
            from_prefill: false,
            cached_tokens: 0,
            placement: Placement::PrefillNode(RemoteReason::Disaggregated),
        })
    }

    #[tokio::test]
    async fn a_moved_request_resumes_after_what_the_client_has() {
        let (tx, _rx) = mpsc::channel(8);
        let out = Out::new(tx);
        let req = request();
        assert!(matches!(out.resume(&req), Resume::Afresh));
        assert!(out.send(token(7)).await && out.send(token(8)).await);
        let Resume::After(moved) = out.resume(&req) else {
            panic!("not resumed");
        };
        assert_eq!(moved.prompt, [1, 2, 3, 7, 8]);
        assert_eq!((moved.max_tokens, moved.resumed), (3, 2));
        assert!(
            !moved.prompt_logprobs,
            "the prompt's logprobs were sent already"
        );
    }

    #[tokio::test]
    async fn a_sequence_that_had_ended_is_finished_not_moved() {
        let (tx, _rx) = mpsc::channel(8);
        let stopped = Out::new(tx.clone());
        stopped.send(token(9)).await;
        assert!(matches!(
            stopped.resume(&request()),
            Resume::Ended(FinishReason::Stop)
        ));
        let full = Out::new(tx);
        for id in 10..15 {
            full.send(token(id)).await;
        }
        assert!(matches!(
            full.resume(&request()),
            Resume::Ended(FinishReason::Length)
        ));
    }
}
