//! What a prefill step runs, decided apart from running it: which queued prompt starts,
//! how far each started prompt gets in the next step, and which prompt tokens a step's rows
//! score. Pure functions, tested here; the compute thread (`worker`) applies them.

/// Whether a prompt of `tokens` starts beside started prompts holding `held` tokens: when
/// all fit in `max_active_tokens` (each started prompt holds a cache of its whole length,
/// so this bounds the node's KV memory), and with nothing started whatever its length.
pub fn starts(held: usize, started: usize, tokens: usize, max_active_tokens: usize) -> bool {
    started == 0 || held + tokens <= max_active_tokens
}

/// The tokens each started prompt computes in the next step, oldest first, given the
/// tokens each has left (`remaining`): a prompt gets at most `chunk_tokens`, the step at
/// most `step_tokens` (both at least 1). Every prompt in the step gets at least one token,
/// so the step is a prefix of the started prompts; a long prompt takes several steps and
/// does not hold the short ones behind it back for its whole length.
pub fn takes(
    remaining: impl IntoIterator<Item = usize>,
    step_tokens: usize,
    chunk_tokens: usize,
) -> Vec<usize> {
    let mut budget = step_tokens.max(1);
    let chunk = chunk_tokens.max(1);
    let mut takes = Vec::new();
    for left in remaining {
        if budget == 0 {
            break;
        }
        let take = left.min(chunk).min(budget);
        takes.push(take);
        budget -= take;
    }
    takes
}

/// The prompt tokens that `rows` logit rows score, for a piece computed from position
/// `from` of `prompt`: row i (position from + i) scores the token after it, so the piece's
/// last row scores the next piece's first token, and the prompt's last position scores
/// nothing (its row gives the first generated token).
pub fn scored_tokens(prompt: &[u32], from: usize, rows: usize) -> &[u32] {
    let end = (from + rows + 1).min(prompt.len());
    &prompt[(from + 1).min(end)..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_starts_while_the_started_ones_leave_room() {
        assert!(
            starts(0, 0, 10_000, 64),
            "the first starts whatever its length"
        );
        assert!(starts(40, 2, 24, 64));
        assert!(!starts(40, 2, 25, 64));
    }

    #[test]
    fn a_step_takes_chunks_of_the_oldest_prompts_within_its_budget() {
        assert_eq!(takes([100, 30, 5], 64, 32), [32, 30, 2]);
        assert_eq!(takes([10, 5], 64, 32), [10, 5], "all of short prompts");
        assert_eq!(
            takes([100, 100, 100], 40, 32),
            [32, 8],
            "the budget ends the step"
        );
        assert_eq!(takes([3, 3], 0, 0), [1], "bounds of 0 read as 1");
        assert!(takes([], 64, 32).is_empty());
    }

    #[test]
    fn rows_score_the_token_after_their_position() {
        let prompt = [10, 11, 12, 13, 14];
        assert_eq!(scored_tokens(&prompt, 0, 2), [11, 12]);
        assert_eq!(
            scored_tokens(&prompt, 2, 3),
            [13, 14],
            "the last row scores nothing"
        );
        assert_eq!(scored_tokens(&prompt, 4, 1), [] as [u32; 0]);
    }
}
