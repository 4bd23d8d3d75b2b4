//! How much of a step grammar masks may take. A mask is computed on the compute thread
//! between a sequence's forward pass and its sampling, and its cost is the grammar's (a
//! 16 KiB `const` costs about 6 ms a token, a step of 16 sequences about 75 ms): left
//! alone, one request's grammar would stall every sequence of the batch.
//!
//! So each request with a grammar holds an account of mask time. Every step earns the
//! batch [`GRAMMAR_SHARE`] of its forward pass's time, split between the requests with a
//! grammar; a mask spends what it took, into debt if it must. A sequence whose request's
//! account is not in credit keeps its logits and sits out the steps until it is: it is then
//! sampled from them, exactly as it would have been at once (sampling depends on the seed and
//! the position, not on when), and joins the next forward pass. A request alone on the node
//! never waits, and nor does a sequence when nothing else would run.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

/// The share of a step's forward time that the grammars of its batch may add to it.
pub const GRAMMAR_SHARE: f64 = 0.15;

/// One request's mask time: in credit (positive) or in debt, in seconds. Its sequences share
/// it; it lives on the compute thread only.
#[derive(Debug, Clone, Default)]
pub(super) struct Account(Rc<Cell<f64>>);

impl Account {
    /// Whether a mask may be computed now.
    pub(super) fn in_credit(&self) -> bool {
        self.0.get() > 0.0
    }

    /// Adds `earned` seconds; credit never grows past one step's earnings, so a request
    /// cannot save up a burst.
    pub(super) fn earn(&self, earned: f64) {
        self.0.set((self.0.get() + earned).min(earned));
    }

    /// Takes the time a mask took.
    pub(super) fn spend(&self, took: Duration) {
        self.0.set(self.0.get() - took.as_secs_f64());
    }

    /// Clears the account: a request alone on the node owes nothing for the time it took
    /// while no one waited for it.
    pub(super) fn forgive(&self) {
        self.0.set(0.0);
    }

    /// Whether `self` and `other` are the one request's.
    pub(super) fn same(&self, other: &Account) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }
}

/// What each of `requests` requests with a grammar earns from a forward pass of `forward`.
pub(super) fn earnings(forward: Duration, requests: usize) -> f64 {
    GRAMMAR_SHARE * forward.as_secs_f64() / requests.max(1) as f64
}

/// Earns each distinct account of `accounts` its part of a forward pass of `forward`.
pub(super) fn earn_all<'a>(accounts: impl Iterator<Item = &'a Account>, forward: Duration) {
    let mut distinct: Vec<&Account> = Vec::new();
    for a in accounts {
        if !distinct.iter().any(|d| d.same(a)) {
            distinct.push(a);
        }
    }
    let each = earnings(forward, distinct.len());
    distinct.iter().for_each(|a| a.earn(each));
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEP: Duration = Duration::from_millis(100);

    /// Of `steps` steps, how many a request whose every mask takes `mask` computes one in,
    /// beside `others` requests whose masks cost nothing.
    fn masked_steps(mask: Duration, others: usize, steps: usize) -> usize {
        let hostile = Account::default();
        let plain: Vec<Account> = (0..others).map(|_| Account::default()).collect();
        let mut masked = 0;
        for _ in 0..steps {
            earn_all(std::iter::once(&hostile).chain(&plain), STEP);
            if hostile.in_credit() {
                hostile.spend(mask);
                masked += 1;
            }
            assert!(
                plain.iter().all(Account::in_credit),
                "cheap grammars never wait"
            );
        }
        masked
    }

    #[test]
    fn a_grammar_within_its_share_masks_every_step() {
        assert_eq!(masked_steps(Duration::from_millis(5), 1, 100), 100);
    }

    #[test]
    fn a_costly_grammar_adds_at_most_its_share_to_the_steps() {
        // 60 ms masks against a 7.5 ms share (two requests): one step in eight.
        let masked = masked_steps(Duration::from_millis(60), 1, 800);
        assert!((99..=101).contains(&masked), "{masked}");
        let added = masked as f64 * 0.060 / (800.0 * STEP.as_secs_f64());
        assert!(added <= GRAMMAR_SHARE / 2.0 + 1e-3, "{added}");
    }

    #[test]
    fn credit_is_not_saved_up() {
        let a = Account::default();
        for _ in 0..10 {
            earn_all(std::iter::once(&a), STEP);
        }
        a.spend(STEP.mul_f64(GRAMMAR_SHARE) + Duration::from_micros(1));
        assert!(!a.in_credit());
    }

    #[test]
    fn sequences_of_one_request_share_its_account() {
        let a = Account::default();
        let (b, c) = (a.clone(), Account::default());
        earn_all([&a, &b, &c].into_iter(), STEP);
        assert_eq!(a.0.get(), earnings(STEP, 2));
        b.spend(STEP);
        assert!(!a.in_credit() && c.in_credit());
    }
}
