//! What a step runs, decided apart from running it: which queued requests start, which
//! parked sequences are sampled, whether a sequence is done, whether a transfer's first
//! tokens can start its request. Pure functions of the scheduler's state, tested here; the
//! scheduler applies them.

use engine::Sampled;
use proto::v1::FinishReason;

use crate::error::DecodeError;

/// Whether the oldest queued request, of `sequences`, starts beside the `batch` sequences
/// in the next step: when it fits (`max_batch`), and into an empty batch whatever its width
/// (the service refuses a request wider than the batch). The queue starts in order: one
/// that does not fit holds back the ones behind it, so none waits forever behind
/// narrower ones.
pub(super) fn starts(batch: usize, sequences: usize, max_batch: usize) -> bool {
    batch == 0 || batch + sequences <= max_batch
}

/// Where a parked sequence stands when the step decides whether to sample it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ParkedTurn {
    /// Every sequence on the node is its request's: its grammar waits for no one's sake.
    pub alone: bool,
    /// Nothing but parked sequences is on the node, and this one has waited longest: it
    /// runs in any case, so that the node never idles.
    pub oldest_with_nothing_else: bool,
    /// Its request's grammar time is in credit.
    pub in_credit: bool,
}

/// Whether a parked sequence is sampled from its kept logits this step.
pub(super) fn samples_now(t: ParkedTurn) -> bool {
    t.alone || t.oldest_with_nothing_else || t.in_credit
}

/// Where a sequence stands after its newest token.
#[derive(Debug, Clone, Copy)]
pub(super) struct Progress<'a> {
    /// Its newest token.
    pub last: u32,
    pub stop_ids: &'a [u32],
    /// Its grammar accepts no more output.
    pub grammar_finished: bool,
    /// Tokens this node produced for it, and may.
    pub produced: usize,
    pub max_new: usize,
    /// Positions in its cache, and in the model's context.
    pub positions: usize,
    pub max_positions: usize,
}

/// Why a sequence stops after its newest token, if it does: a stop token or a finished
/// grammar before the length bounds, as the router reports them.
pub(super) fn finish(p: Progress<'_>) -> Option<FinishReason> {
    if p.stop_ids.contains(&p.last) || p.grammar_finished {
        Some(FinishReason::Stop)
    } else if p.produced >= p.max_new || p.positions >= p.max_positions {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Whether a prefill node's first tokens can start a request of `width` sequences on a
/// model of `vocab` tokens: one per sequence, every id (alternatives included) inside the
/// vocabulary, since an id outside it would fail the whole batch's next forward pass, not
/// just this request.
pub(super) fn check_first_tokens(
    first: &[Sampled],
    width: usize,
    vocab: usize,
) -> Result<(), DecodeError> {
    if first.len() != width {
        return Err(DecodeError::InvalidRequest(format!(
            "{} first tokens arrived for {width} sequences",
            first.len(),
        )));
    }
    let outside = first
        .iter()
        .flat_map(|s| std::iter::once(s.token).chain(s.top.iter().map(|t| t.token)))
        .find(|&t| t as usize >= vocab);
    match outside {
        Some(t) => Err(DecodeError::BadTransfer(format!(
            "first token {t} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::sampling::TokenLogprob;

    #[test]
    fn a_request_starts_when_it_fits_or_the_batch_is_empty() {
        assert!(starts(0, 3, 4) && starts(3, 1, 4) && starts(2, 2, 4));
        assert!(!starts(4, 1, 4) && !starts(2, 3, 4));
        assert!(starts(0, 6, 4), "alone, whatever its width");
    }

    #[test]
    fn a_parked_sequence_samples_alone_in_credit_or_when_nothing_else_runs() {
        let turn = |alone, oldest_with_nothing_else, in_credit| ParkedTurn {
            alone,
            oldest_with_nothing_else,
            in_credit,
        };
        assert!(
            !samples_now(turn(false, false, false)),
            "in debt, others run"
        );
        assert!(samples_now(turn(false, false, true)));
        assert!(samples_now(turn(true, false, false)));
        assert!(samples_now(turn(false, true, false)));
    }

    #[test]
    fn a_sequence_stops_on_a_stop_token_or_grammar_before_its_lengths() {
        let p = Progress {
            last: 5,
            stop_ids: &[2, 7],
            grammar_finished: false,
            produced: 3,
            max_new: 10,
            positions: 8,
            max_positions: 16,
        };
        assert_eq!(finish(p), None);
        let stop = Some(FinishReason::Stop);
        let length = Some(FinishReason::Length);
        assert_eq!(finish(Progress { last: 7, ..p }), stop);
        let grammar = Progress {
            grammar_finished: true,
            ..p
        };
        assert_eq!(finish(grammar), stop);
        let last = Progress { produced: 10, ..p };
        assert_eq!(finish(last), length);
        assert_eq!(finish(Progress { last: 2, ..last }), stop, "stop wins");
        let full = Progress { positions: 16, ..p };
        assert_eq!(finish(full), length);
    }

    #[test]
    fn first_tokens_must_match_the_width_and_the_vocabulary() {
        let sampled = |token, alternative| Sampled {
            token,
            logprob: -1.0,
            top: vec![TokenLogprob {
                token: alternative,
                logprob: -1.0,
            }],
        };
        assert!(check_first_tokens(&[sampled(1, 2), sampled(3, 4)], 2, 10).is_ok());
        assert!(matches!(
            check_first_tokens(&[sampled(1, 2)], 2, 10),
            Err(DecodeError::InvalidRequest(m)) if m == "1 first tokens arrived for 2 sequences"
        ));
        for bad in [sampled(10, 1), sampled(1, 10)] {
            assert!(matches!(
                check_first_tokens(&[bad], 1, 10),
                Err(DecodeError::BadTransfer(m)) if m == "first token 10 is outside the vocabulary of 10"
            ));
        }
    }
}
