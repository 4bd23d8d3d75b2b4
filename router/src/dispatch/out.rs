//! Where a generation's pieces go, and what they tell a later attempt: a stream whose
//! decode node fails after some tokens moves to another one (stream migration), which
//! resumes after the tokens the client has.

use std::sync::Mutex;

use proto::v1::FinishReason;

use super::{GenRequest, Piece, Tx};

/// The channel to the client's side, remembering the tokens sent on it when the request
/// may move.
pub(super) struct Out {
    tx: Tx,
    /// The tokens sent, for a request that may move; `None` for any other, which has no
    /// use for them.
    delivered: Option<Mutex<Vec<u32>>>,
}

/// How an attempt after a failure starts: afresh, after the tokens delivered, or not at
/// all because the sequence had already ended.
pub(super) enum Resume {
    Afresh,
    After(Box<GenRequest>),
    Ended(FinishReason),
}

impl Out {
    /// `moves`: whether a failure after the first token may move the request (one
    /// sequence, no beam search, `--stream-migration`).
    pub(super) fn new(tx: Tx, moves: bool) -> Self {
        Self {
            tx,
            delivered: moves.then(|| Mutex::new(Vec::new())),
        }
    }

    /// Whether the request may move after its first token.
    pub(super) fn moves(&self) -> bool {
        self.delivered.is_some()
    }

    /// Sends `piece`; false once the client has gone.
    pub(super) async fn send(&self, piece: Piece) -> bool {
        if let (Piece::Token(t), Some(delivered)) = (&piece, &self.delivered) {
            delivered
                .lock()
                .expect("the delivered tokens' lock is never poisoned")
                .push(t.id);
        }
        self.tx.send(Ok(piece)).await.is_ok()
    }

    /// How the next attempt at `req` starts.
    pub(super) fn resume(&self, req: &GenRequest) -> Resume {
        let Some(delivered) = &self.delivered else {
            return Resume::Afresh;
        };
        let delivered = delivered
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
            width: crate::dispatch::Width {
                n: 1,
                best_of: 1,
                beam: false,
            },
            cache_partition: Vec::new(),
            prompt_logprobs: true,
            ended: None,
            resumed: 0,
            spent: None,
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
        let out = Out::new(tx, true);
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
    async fn a_request_that_cannot_move_keeps_no_tokens() {
        let (tx, _rx) = mpsc::channel(8);
        let out = Out::new(tx, false);
        assert!(out.send(token(7)).await);
        assert!(!out.moves());
        assert!(matches!(out.resume(&request()), Resume::Afresh));
    }

    #[tokio::test]
    async fn a_sequence_that_had_ended_is_finished_not_moved() {
        let (tx, _rx) = mpsc::channel(8);
        let stopped = Out::new(tx.clone(), true);
        stopped.send(token(9)).await;
        assert!(matches!(
            stopped.resume(&request()),
            Resume::Ended(FinishReason::Stop)
        ));
        let full = Out::new(tx, true);
        for id in 10..15 {
            full.send(token(id)).await;
        }
        assert!(matches!(
            full.resume(&request()),
            Resume::Ended(FinishReason::Length)
        ));
    }
}
