//! The prefill node's Prometheus metrics, served at `/metrics` on its gRPC port.

use std::sync::atomic::{AtomicU64, Ordering};

use runtime::prom::{Counter, Gauge, Histogram, Registry};

/// Counters, gauges and histograms the service and the compute thread update.
#[derive(Debug)]
pub struct PrefillMetrics {
    registry: Registry,
    /// Prompts being computed; health replies read it too.
    pub running: AtomicU64,
    /// Bytes of KV cache held by prompts being computed.
    pub kv_bytes_held: Gauge,
    pub prefix_cache_bytes: Gauge,
    pub completed: Counter,
    pub failed: Counter,
    pub rejected: Counter,
    pub cancelled: Counter,
    pub prompt_tokens: Counter,
    pub transfer_bytes: Counter,
    pub prefix_hits: Counter,
    pub cached_tokens: Counter,
    /// Each prompt's wait for the compute thread.
    pub queue_wait: Histogram,
    /// Each prompt's computation, from its first piece to its first tokens.
    pub compute_duration: Histogram,
    /// Each compute step's wall time (a batch of prompt pieces): the sum is the time the
    /// compute thread was busy.
    pub step_duration: Histogram,
    /// Each transfer's tail: from the prompt's last layer to the decode node's
    /// acknowledgement of its KV.
    pub transfer_tail: Histogram,
    running_gauge: Gauge,
    queue_depth: Gauge,
}

const TRANSFER_TAIL: &str = "prefill_kv_transfer_tail_duration_seconds";

impl Default for PrefillMetrics {
    fn default() -> Self {
        let r = Registry::new(&[TRANSFER_TAIL]);
        let requests = |outcome| {
            r.counter_with(
                "prefill_requests_total",
                "Prefill requests by outcome.",
                &[("outcome", outcome)],
            )
        };
        Self {
            running: AtomicU64::new(0),
            kv_bytes_held: r.gauge(
                "prefill_kv_bytes_held",
                "KV cache bytes held by prompts being computed.",
            ),
            prefix_cache_bytes: r.gauge(
                "prefill_prefix_cache_bytes",
                "KV bytes the prefix cache holds.",
            ),
            completed: requests("completed"),
            failed: requests("failed"),
            rejected: requests("rejected"),
            cancelled: requests("cancelled"),
            prompt_tokens: r.counter("prefill_prompt_tokens_total", "Prompt tokens computed."),
            transfer_bytes: r.counter(
                "prefill_transfer_bytes_total",
                "KV bytes acknowledged by decode nodes.",
            ),
            prefix_hits: r.counter(
                "prefill_prefix_cache_hits_total",
                "Prompts that reused a cached prefix.",
            ),
            cached_tokens: r.counter(
                "prefill_cached_tokens_total",
                "Prompt tokens whose KV came from the prefix cache.",
            ),
            queue_wait: r.histogram(
                "prefill_queue_wait_duration_seconds",
                "Time each prompt waited for the compute thread.",
            ),
            compute_duration: r.histogram(
                "prefill_compute_duration_seconds",
                "Time from each prompt's first computed piece to its first tokens.",
            ),
            step_duration: r.histogram(
                "prefill_step_duration_seconds",
                "Wall time of each compute step (a batch of prompt pieces).",
            ),
            transfer_tail: r.histogram(
                TRANSFER_TAIL,
                "Time from each prompt's last computed layer to the decode node's \
                 acknowledgement of its KV.",
            ),
            running_gauge: r.gauge("prefill_running_prompts", "Prompts being computed."),
            queue_depth: r.gauge(
                "prefill_queue_depth",
                "Prompts waiting for the compute thread.",
            ),
            registry: r,
        }
    }
}

impl PrefillMetrics {
    /// Folds histogram samples into their buckets between scrapes; needs a tokio runtime.
    pub fn spawn_upkeep(&self) {
        self.registry.spawn_upkeep();
    }

    /// The Prometheus text exposition, with the queue's depth now.
    pub fn render(&self, queued: usize) -> String {
        self.queue_depth.set(queued as f64);
        self.running_gauge
            .set(self.running.load(Ordering::Relaxed) as f64);
        self.registry.render()
    }
}
