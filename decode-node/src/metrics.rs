//! The decode node's Prometheus metrics, served at `/metrics` on its gRPC port.

use std::sync::atomic::{AtomicU64, Ordering};

use runtime::prom::{Counter, Gauge, Histogram, Registry};

/// Counters and histograms the service and the compute thread update, and the two gauges
/// of the compute thread that health replies read too.
#[derive(Debug)]
pub struct DecodeMetrics {
    registry: Registry,
    /// Sequences in the running batch.
    pub running_sequences: AtomicU64,
    /// Requests the compute thread has queued for KV blocks or a batch slot.
    pub waiting_requests: AtomicU64,
    pub generated_tokens: Counter,
    pub steps: Counter,
    /// Sum over steps of the sequences in each: over `steps`, the mean batch size.
    pub step_sequences: Counter,
    pub admitted: Counter,
    pub rejected: Counter,
    /// Requests that could not start at once for want of KV blocks or a batch slot.
    pub delayed: Counter,
    /// Sequences that ended with a finish (a beam search counts its returned hypotheses).
    pub finished_sequences: Counter,
    /// Sequences, beam searches and queued requests dropped because their caller left.
    pub cancellations: Counter,
    /// Requests failed by an error of the node.
    pub failures: Counter,
    pub transfers: Counter,
    pub transfer_bytes: Counter,
    pub transfer_failures: Counter,
    /// KV connections refused before a ticket was redeemed.
    pub kv_refused: Counter,
    /// Sampled tokens put off because their request's grammar time was spent.
    pub grammar_deferred: Counter,
    /// Each decode step's wall time.
    pub step_duration: Histogram,
    /// Each admitted request's wait for KV blocks or a batch slot.
    pub queue_wait: Histogram,
    /// Each received transfer, from its header to its first tokens.
    pub transfer_duration: Histogram,
    kv_blocks: [Gauge; 3],
    held: [Gauge; 4],
}

/// What the budget and the data plane hold at the moment of a scrape.
#[derive(Debug, Clone, Copy, Default)]
pub struct Held {
    /// Blocks the budget holds.
    pub capacity: usize,
    /// Blocks reserved.
    pub used_blocks: usize,
    /// Reservations waiting for blocks.
    pub reserving: usize,
    /// Transfers being received.
    pub receiving: usize,
    /// Tickets issued whose transfer has not begun.
    pub tickets: usize,
}

const STEP_DURATION: &str = "decode_step_duration_seconds";

impl DecodeMetrics {
    /// The node's metrics, with blocks of `block_tokens` positions.
    pub fn new(block_tokens: usize) -> Self {
        let r = Registry::new(&[STEP_DURATION]);
        r.gauge("decode_kv_block_tokens", "Positions per KV block.")
            .set(block_tokens as f64);
        let requests = |outcome| {
            r.counter_with(
                "decode_requests_total",
                "Requests admitted to the batch, or refused (no room ever, or the queue full).",
                &[("outcome", outcome)],
            )
        };
        Self {
            running_sequences: AtomicU64::new(0),
            waiting_requests: AtomicU64::new(0),
            generated_tokens: r.counter("decode_generated_tokens_total", "Tokens decoded."),
            steps: r.counter("decode_steps_total", "Batched decode steps."),
            step_sequences: r.counter(
                "decode_step_sequences_total",
                "Sequences summed over steps (over steps: the mean batch size).",
            ),
            admitted: requests("admitted"),
            rejected: requests("rejected"),
            delayed: r.counter(
                "decode_delayed_requests_total",
                "Requests that waited for KV blocks or a batch slot.",
            ),
            finished_sequences: r.counter(
                "decode_finished_sequences_total",
                "Sequences that ended with a finish.",
            ),
            cancellations: r.counter(
                "decode_cancellations_total",
                "Sequences, beam searches and queued requests dropped because their caller left.",
            ),
            failures: r.counter(
                "decode_failures_total",
                "Requests failed by an error of the node.",
            ),
            transfers: r.counter("decode_transfers_total", "KV transfers received whole."),
            transfer_bytes: r.counter("decode_transfer_bytes_total", "KV bytes received."),
            transfer_failures: r.counter(
                "decode_transfer_failures_total",
                "KV transfers that broke or were refused after their ticket was redeemed.",
            ),
            kv_refused: r.counter(
                "decode_kv_refused_total",
                "KV connections refused before a ticket was redeemed: no ticket, a wrong or \
                 spent one, a bad or late header.",
            ),
            grammar_deferred: r.counter(
                "decode_grammar_deferred_total",
                "Tokens put off to a later step because their request's grammar masks had \
                 taken its share of the steps.",
            ),
            step_duration: r.histogram(STEP_DURATION, "Wall time of each batched decode step."),
            queue_wait: r.histogram(
                "decode_queue_wait_duration_seconds",
                "Time each admitted request waited for KV blocks or a batch slot.",
            ),
            transfer_duration: r.histogram(
                "decode_kv_transfer_duration_seconds",
                "Time from each received KV transfer's header to its first tokens.",
            ),
            kv_blocks: [
                r.gauge("decode_kv_blocks_capacity", "KV blocks the budget holds."),
                r.gauge(
                    "decode_kv_blocks_used",
                    "KV blocks reserved: running and queued sequences, caches being received \
                     or awaited.",
                ),
                r.gauge("decode_kv_blocks_free", "KV blocks free."),
            ],
            held: [
                r.gauge(
                    "decode_running_sequences",
                    "Sequences in the running batch.",
                ),
                r.gauge(
                    "decode_waiting_requests",
                    "Requests queued for KV blocks or a batch slot.",
                ),
                r.gauge("decode_held_transfers", "KV transfers being received."),
                r.gauge(
                    "decode_awaited_transfers",
                    "Generate calls holding a ticket whose transfer has not begun.",
                ),
            ],
            registry: r,
        }
    }

    /// Folds histogram samples into their buckets between scrapes; needs a tokio runtime.
    pub fn spawn_upkeep(&self) {
        self.registry.spawn_upkeep();
    }

    /// The Prometheus text exposition, with what `held` says is held now.
    pub fn render(&self, held: Held) -> String {
        let [capacity, used, free] = &self.kv_blocks;
        capacity.set(held.capacity as f64);
        used.set(held.used_blocks as f64);
        free.set(held.capacity.saturating_sub(held.used_blocks) as f64);
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let [running, waiting, receiving, tickets] = &self.held;
        running.set(get(&self.running_sequences));
        waiting.set(get(&self.waiting_requests) + held.reserving as f64);
        receiving.set(held.receiving as f64);
        tickets.set(held.tickets as f64);
        self.registry.render()
    }
}
