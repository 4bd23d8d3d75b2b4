//! The decode node's Prometheus metrics, served at `/metrics` on its gRPC port.

use std::sync::atomic::{AtomicU64, Ordering};

use runtime::prom::{self, Histogram, StepHistogram};

/// Counters and gauges the service and the compute thread update.
#[derive(Debug, Default)]
pub struct DecodeMetrics {
    pub kv_blocks_capacity: AtomicU64,
    pub kv_block_tokens: AtomicU64,
    pub running_sequences: AtomicU64,
    pub waiting_requests: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub steps: AtomicU64,
    /// Sum over steps of the sequences in each: over `steps`, the mean batch size.
    pub step_sequences: AtomicU64,
    pub step_micros: AtomicU64,
    pub queue_wait_micros: AtomicU64,
    pub admitted: AtomicU64,
    pub rejected: AtomicU64,
    /// Requests that could not start at once for want of KV blocks or a batch slot.
    pub delayed: AtomicU64,
    /// Sequences that ended with a finish (a beam search counts its returned hypotheses).
    pub finished_sequences: AtomicU64,
    /// Sequences, beam searches and queued requests dropped because their caller left.
    pub cancellations: AtomicU64,
    /// Requests failed by an error of the node.
    pub failures: AtomicU64,
    pub transfers: AtomicU64,
    pub transfer_bytes: AtomicU64,
    /// Time from a transfer's header to its first tokens, summed.
    pub transfer_micros: AtomicU64,
    pub transfer_failures: AtomicU64,
    /// KV connections refused before a ticket was redeemed.
    pub kv_refused: AtomicU64,
    /// Each decode step's wall time.
    pub step_duration: StepHistogram,
    /// Each admitted request's wait for KV blocks or a batch slot.
    pub queue_wait: Histogram,
    /// Each received transfer, from its header to its first tokens.
    pub transfer_duration: Histogram,
}

/// What the budget and the data plane hold at the moment of a scrape.
#[derive(Debug, Clone, Copy, Default)]
pub struct Held {
    /// Blocks reserved.
    pub used_blocks: usize,
    /// Reservations waiting for blocks.
    pub reserving: usize,
    /// Transfers being received.
    pub receiving: usize,
    /// Tickets issued whose transfer has not begun.
    pub tickets: usize,
}

impl DecodeMetrics {
    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        Self::add(counter, 1);
    }

    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The Prometheus text exposition, with what `held` says is held now.
    pub fn render(&self, held: Held) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let secs = |a: &AtomicU64| g(a) / 1e6;
        let cap = g(&self.kv_blocks_capacity);
        let used = held.used_blocks as f64;
        let mut out = String::new();
        prom::all(
            &mut out,
            "gauge",
            &[
                (
                    "decode_kv_blocks_capacity",
                    "KV blocks the budget holds.",
                    cap,
                ),
                (
                    "decode_kv_blocks_used",
                    "KV blocks reserved: running and queued sequences, caches being received or awaited.",
                    used,
                ),
                (
                    "decode_kv_blocks_free",
                    "KV blocks free.",
                    (cap - used).max(0.0),
                ),
                (
                    "decode_kv_block_tokens",
                    "Positions per KV block.",
                    g(&self.kv_block_tokens),
                ),
                (
                    "decode_running_sequences",
                    "Sequences in the running batch.",
                    g(&self.running_sequences),
                ),
                (
                    "decode_waiting_requests",
                    "Requests queued for KV blocks or a batch slot.",
                    g(&self.waiting_requests) + held.reserving as f64,
                ),
                (
                    "decode_held_transfers",
                    "KV transfers being received.",
                    held.receiving as f64,
                ),
                (
                    "decode_awaited_transfers",
                    "Generate calls holding a ticket whose transfer has not begun.",
                    held.tickets as f64,
                ),
            ],
        );
        prom::all(
            &mut out,
            "counter",
            &[
                ("decode_generated_tokens_total", "Tokens decoded.", g(&self.generated_tokens)),
                ("decode_steps_total", "Batched decode steps.", g(&self.steps)),
                ("decode_step_sequences_total", "Sequences summed over steps (over steps: the mean batch size).", g(&self.step_sequences)),
                ("decode_step_seconds_total", "Time spent in decode steps.", secs(&self.step_micros)),
                ("decode_queue_wait_seconds_total", "Time admitted requests waited in the queue.", secs(&self.queue_wait_micros)),
                ("decode_delayed_requests_total", "Requests that waited for KV blocks or a batch slot.", g(&self.delayed)),
                ("decode_finished_sequences_total", "Sequences that ended with a finish.", g(&self.finished_sequences)),
                ("decode_cancellations_total", "Sequences, beam searches and queued requests dropped because their caller left.", g(&self.cancellations)),
                ("decode_failures_total", "Requests failed by an error of the node.", g(&self.failures)),
                ("decode_transfers_total", "KV transfers received whole.", g(&self.transfers)),
                ("decode_transfer_failures_total", "KV transfers that broke or were refused after their ticket was redeemed.", g(&self.transfer_failures)),
                ("decode_kv_refused_total", "KV connections refused before a ticket was redeemed: no ticket, a wrong or spent one, a bad or late header.", g(&self.kv_refused)),
                ("decode_transfer_seconds_total", "Time from each received transfer's header to its first tokens.", secs(&self.transfer_micros)),
                ("decode_transfer_bytes_total", "KV bytes received.", g(&self.transfer_bytes)),
            ],
        );
        let name = "decode_requests_total";
        prom::header(
            &mut out,
            name,
            "counter",
            "Requests admitted to the batch, or refused (no room ever, or the queue full).",
        );
        for (outcome, n) in [("admitted", &self.admitted), ("rejected", &self.rejected)] {
            prom::sample(&mut out, name, &[("outcome", outcome)], g(n));
        }
        self.step_duration.render(
            &mut out,
            "decode_step_duration_seconds",
            "Wall time of each batched decode step.",
        );
        self.queue_wait.render(
            &mut out,
            "decode_queue_wait_duration_seconds",
            "Time each admitted request waited for KV blocks or a batch slot.",
        );
        self.transfer_duration.render(
            &mut out,
            "decode_kv_transfer_duration_seconds",
            "Time from each received KV transfer's header to its first tokens.",
        );
        runtime::process::render(&mut out);
        out
    }
}
