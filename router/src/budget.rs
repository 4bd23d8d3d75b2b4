//! The token budget: how many tokens a request may get, in the one meaning the contracts
//! give it (`max_tokens`: each sequence's tokens in all, its first included). The seeds'
//! maxIterTimes + 1 rule lives here and nowhere else.

use crate::config::Mode;

/// Tokens each sequence of a request may have in all.
///
/// maxIterTimes bounds what a decode node makes for one request. Under PD the prefill node
/// samples the first token, so a request that asks for no less gets maxIterTimes + 1 (the
/// seeds' rule); colocated, the decode node makes them all. An explicit `max_tokens` at or
/// below maxIterTimes is never exceeded. `room`, the context left after the prompt
/// (maxSeqLen), caps both, and every request gets at least one token.
pub fn completion_budget(
    mode: Mode,
    max_iter_times: usize,
    room: usize,
    max_tokens: Option<u64>,
) -> usize {
    let wanted = match (mode, max_tokens) {
        (_, Some(m)) if m as usize <= max_iter_times => m as usize,
        (Mode::Pd, _) => max_iter_times + 1,
        (Mode::Colocated, _) => max_iter_times,
    };
    wanted.min(room).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pd_adds_the_prefill_nodes_token_to_max_iter_times() {
        assert_eq!(completion_budget(Mode::Pd, 512, 10_000, None), 513);
        assert_eq!(completion_budget(Mode::Pd, 512, 10_000, Some(600)), 513);
        assert_eq!(completion_budget(Mode::Colocated, 512, 10_000, None), 512);
        assert_eq!(
            completion_budget(Mode::Colocated, 512, 10_000, Some(600)),
            512
        );
    }

    #[test]
    fn an_explicit_max_tokens_within_max_iter_times_is_kept() {
        for mode in [Mode::Pd, Mode::Colocated] {
            assert_eq!(completion_budget(mode, 512, 10_000, Some(512)), 512);
            assert_eq!(completion_budget(mode, 512, 10_000, Some(1)), 1);
        }
    }

    #[test]
    fn the_context_caps_the_budget_and_one_token_is_the_least() {
        assert_eq!(completion_budget(Mode::Pd, 512, 100, None), 100);
        assert_eq!(completion_budget(Mode::Pd, 512, 100, Some(200)), 100);
        assert_eq!(completion_budget(Mode::Colocated, 512, 0, Some(5)), 1);
    }
}
