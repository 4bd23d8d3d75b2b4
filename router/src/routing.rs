//! Routing policies: which ready worker takes a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::worker::Worker;

/// Chooses a worker among ready ones (never an empty list; rotated by the pool, so that
/// returning the first of equals spreads load).
pub trait Policy: Send + Sync {
    /// The index of the prefill worker for a prompt whose whole blocks hash to `blocks`.
    fn prefill(&self, ready: &[Arc<Worker>], blocks: &[u64]) -> usize;
    /// The index of the decode worker for `sequences` sequences of up to `tokens`
    /// positions each.
    fn decode(&self, ready: &[Arc<Worker>], tokens: usize, sequences: usize) -> usize;
}

/// Which policy the router uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyKind {
    /// Each worker in turn, whatever it holds: the baseline.
    RoundRobin,
    /// Prefill: the fewest outstanding prompt tokens, preferring the worker that already
    /// holds the prompt's prefix unless it is overloaded. Decode: the most free KV blocks,
    /// then the fewest running sequences.
    LeastLoad,
}

impl PolicyKind {
    /// The policy, with `affinity_slack` the extra outstanding prompt tokens a prefill
    /// worker may have over the least loaded one and still get a prompt whose prefix it
    /// holds.
    pub fn build(self, affinity_slack: u64) -> Arc<dyn Policy> {
        match self {
            PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
            PolicyKind::LeastLoad => Arc::new(LeastLoad { affinity_slack }),
        }
    }
}

/// Each worker in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    fn turn(&self, n: usize) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % n
    }
}

impl Policy for RoundRobin {
    fn prefill(&self, ready: &[Arc<Worker>], _blocks: &[u64]) -> usize {
        self.turn(ready.len())
    }
    fn decode(&self, ready: &[Arc<Worker>], _tokens: usize, _sequences: usize) -> usize {
        self.turn(ready.len())
    }
}

/// Load-aware choice, with prefix affinity for prefill.
#[derive(Debug)]
pub struct LeastLoad {
    affinity_slack: u64,
}

/// Outstanding prompt tokens: what this router sent, or what the worker reports queued and
/// running (other routers' work) when that is more, counted in prompts of a nominal size.
fn prefill_load(w: &Worker) -> u64 {
    /// What one queued prompt of another router's weighs when all we know is its count.
    const NOMINAL_PROMPT: u64 = 256;
    let own = w.prefill_tokens.load(Ordering::Relaxed);
    let load = w.load();
    own.max(u64::from(load.waiting + load.running) * NOMINAL_PROMPT)
}

impl Policy for LeastLoad {
    fn prefill(&self, ready: &[Arc<Worker>], blocks: &[u64]) -> usize {
        let loads: Vec<u64> = ready.iter().map(|w| prefill_load(w)).collect();
        let (least, &min) = loads
            .iter()
            .enumerate()
            .min_by_key(|(_, l)| **l)
            .expect("ready is not empty");
        let affine = ready
            .iter()
            .enumerate()
            .map(|(i, w)| (i, w.prefix_blocks(blocks)))
            .filter(|(_, n)| *n > 0)
            .max_by_key(|(i, n)| (*n, std::cmp::Reverse(loads[*i])));
        match affine {
            Some((i, _)) if loads[i] <= min + self.affinity_slack => i,
            _ => least,
        }
    }

    fn decode(&self, ready: &[Arc<Worker>], tokens: usize, sequences: usize) -> usize {
        // Lower is better: the share of the KV budget in use once this request is placed
        // (what the node reports, or what this router placed there when that is more),
        // then the sequences running.
        let score = |w: &Arc<Worker>| {
            let load = w.load();
            let own_seqs = w.sequences.load(Ordering::Relaxed);
            let running = own_seqs.max(u64::from(load.running + load.waiting));
            if load.kv_blocks_capacity == 0 {
                return (0u128, running);
            }
            // A worker's report is a peer's word: free past capacity, or counts near the
            // type's end, must not wrap the arithmetic.
            let block = u64::from(load.kv_block_tokens.max(1));
            let need = (tokens as u64)
                .div_ceil(block)
                .saturating_mul(sequences as u64);
            let used = load
                .kv_blocks_capacity
                .saturating_sub(load.kv_blocks_free)
                .max(w.blocks.load(Ordering::Relaxed));
            let share =
                (u128::from(used) + u128::from(need)) * 1000 / u128::from(load.kv_blocks_capacity);
            (share, running)
        };
        ready
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| score(w))
            .map(|(i, _)| i)
            .expect("ready is not empty")
    }
}

/// Retries to spend: each request earns a fifth of one, a burst may spend ten before any
/// are earned, and no more than a hundred are saved, so retries stay a bounded share of
/// requests however badly a pool fails.
#[derive(Debug)]
pub struct RetryBudget(Mutex<u32>);

impl RetryBudget {
    /// The budget counts fifths of a retry, so that a request's share is exact.
    const RETRY: u32 = 5;
    const START: u32 = 10 * Self::RETRY;
    const MAX: u32 = 100 * Self::RETRY;

    /// Credits one request's share.
    pub fn earn(&self) {
        let mut b = self.0.lock().expect("budget lock");
        *b = (*b + 1).min(Self::MAX);
    }

    /// Takes one retry; false when the budget is spent.
    pub fn spend(&self) -> bool {
        let mut b = self.0.lock().expect("budget lock");
        match b.checked_sub(Self::RETRY) {
            Some(left) => {
                *b = left;
                true
            }
            None => false,
        }
    }
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self(Mutex::new(Self::START))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::{block_hashes, test_settings, Worker};

    fn workers(n: usize) -> Vec<Arc<Worker>> {
        let s = test_settings(3, 1000);
        (0..n)
            .map(|i| {
                Arc::new(Worker::new_for_tests(
                    &format!("127.0.0.1:{}", 1000 + i),
                    &s,
                ))
            })
            .collect()
    }

    #[tokio::test]
    async fn round_robin_takes_each_in_turn() {
        let ws = workers(3);
        let p = RoundRobin::default();
        let picks: Vec<usize> = (0..6).map(|_| p.decode(&ws, 10, 1)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[tokio::test]
    async fn least_load_prefill_prefers_fewer_outstanding_tokens() {
        let ws = workers(3);
        ws[0].prefill_tokens.store(500, Ordering::Relaxed);
        ws[1].prefill_tokens.store(100, Ordering::Relaxed);
        ws[2].prefill_tokens.store(300, Ordering::Relaxed);
        let p = LeastLoad { affinity_slack: 0 };
        assert_eq!(p.prefill(&ws, &[]), 1);
    }

    #[tokio::test]
    async fn prefix_affinity_wins_unless_the_worker_is_overloaded() {
        let ws = workers(2);
        let prompt: Vec<u32> = (0..64).collect();
        let hashes = block_hashes(&prompt);
        ws[0].remember_prefix(&hashes);
        ws[0].prefill_tokens.store(1000, Ordering::Relaxed);
        let p = LeastLoad {
            affinity_slack: 2000,
        };
        assert_eq!(
            p.prefill(&ws, &hashes),
            0,
            "holds the prefix, within the slack"
        );
        ws[0].prefill_tokens.store(5000, Ordering::Relaxed);
        assert_eq!(p.prefill(&ws, &hashes), 1, "too far above the least loaded");
        let other: Vec<u32> = (100..164).collect();
        ws[0].prefill_tokens.store(0, Ordering::Relaxed);
        ws[1].prefill_tokens.store(10, Ordering::Relaxed);
        assert_eq!(
            p.prefill(&ws, &block_hashes(&other)),
            0,
            "no affinity: least load"
        );
    }

    #[tokio::test]
    async fn least_load_decode_weighs_free_blocks_then_sequences() {
        let ws = workers(2);
        ws[0].set_load_for_tests(proto::v1::WorkerLoad {
            running: 1,
            kv_blocks_capacity: 100,
            kv_blocks_free: 10,
            kv_block_tokens: 16,
            ..Default::default()
        });
        ws[1].set_load_for_tests(proto::v1::WorkerLoad {
            running: 5,
            kv_blocks_capacity: 100,
            kv_blocks_free: 80,
            kv_block_tokens: 16,
            ..Default::default()
        });
        let p = LeastLoad { affinity_slack: 0 };
        assert_eq!(
            p.decode(&ws, 160, 1),
            1,
            "more free KV wins over fewer sequences"
        );
        // This router's own placements count when they exceed what the node last said.
        ws[1].blocks.store(95, Ordering::Relaxed);
        assert_eq!(p.decode(&ws, 160, 1), 0);
    }

    #[tokio::test]
    async fn a_load_report_that_makes_no_sense_does_not_wrap() {
        let ws = workers(2);
        // More free than capacity, and counts at the type's end.
        ws[0].set_load_for_tests(proto::v1::WorkerLoad {
            kv_blocks_capacity: 10,
            kv_blocks_free: 1000,
            kv_block_tokens: 1,
            ..Default::default()
        });
        ws[1].set_load_for_tests(proto::v1::WorkerLoad {
            kv_blocks_capacity: u64::MAX,
            kv_blocks_free: 0,
            kv_block_tokens: 1,
            ..Default::default()
        });
        let p = LeastLoad { affinity_slack: 0 };
        // Worker 0 counts as empty, worker 1 as full; neither overflows.
        assert_eq!(p.decode(&ws, 4, 1), 0);
        assert_eq!(p.decode(&ws, usize::MAX, 128), 1, "worker 0 cannot hold it");
    }
}

#[test]
fn the_retry_budget_bounds_retries_to_a_share_of_requests() {
    let b = RetryBudget::default();
    let burst = std::iter::from_fn(|| b.spend().then_some(())).count();
    assert_eq!(burst, 10, "a burst spends the starting budget");
    for _ in 0..10 {
        b.earn();
    }
    assert!(b.spend(), "ten requests earn two retries");
    assert!(b.spend());
    assert!(!b.spend());
    for _ in 0..10_000 {
        b.earn();
    }
    let saved = std::iter::from_fn(|| b.spend().then_some(())).count();
    assert_eq!(saved, 100, "no more than a hundred saved");
}
