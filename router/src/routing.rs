//! Routing policies: which ready worker takes a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::workers::Worker;

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
                return (0, running);
            }
            let block = u64::from(load.kv_block_tokens.max(1));
            let need = (tokens as u64).div_ceil(block) * sequences as u64;
            let used = (load.kv_blocks_capacity - load.kv_blocks_free)
                .max(w.blocks.load(Ordering::Relaxed));
            let share = (used + need) * 1000 / load.kv_blocks_capacity;
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
