//! The prefill node's Prometheus metrics, served at `/metrics` on its gRPC port.

use std::sync::atomic::{AtomicU64, Ordering};

use runtime::prom::{self, Histogram, StepHistogram};

/// Counters and gauges the service and the compute thread update.
#[derive(Debug, Default)]
pub struct PrefillMetrics {
    /// Prompts being computed (0 or 1: one compute thread).
    pub running: AtomicU64,
    /// Bytes of KV cache held by prompts being computed.
    pub kv_bytes_held: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub rejected: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub compute_micros: AtomicU64,
    pub queue_wait_micros: AtomicU64,
    /// Time from each prompt's last computed layer to its transfer's acknowledgement.
    pub kv_tail_micros: AtomicU64,
    pub transfer_bytes: AtomicU64,
    pub prefix_cache_bytes: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// Each prompt's wait for the compute thread.
    pub queue_wait: Histogram,
    /// Each prompt's computation, from its first piece to its first tokens.
    pub compute_duration: Histogram,
    /// Each transfer's tail: from the prompt's last layer to the decode node's
    /// acknowledgement of its KV.
    pub transfer_tail: StepHistogram,
}

impl PrefillMetrics {
    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The Prometheus text exposition, with the queue's depth now.
    pub fn render(&self, queued: usize) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let secs = |a: &AtomicU64| g(a) / 1e6;
        let mut out = String::new();
        prom::all(
            &mut out,
            "gauge",
            &[
                (
                    "prefill_queue_depth",
                    "Prompts waiting for the compute thread.",
                    queued as f64,
                ),
                (
                    "prefill_running_prompts",
                    "Prompts being computed.",
                    g(&self.running),
                ),
                (
                    "prefill_kv_bytes_held",
                    "KV cache bytes held by prompts being computed.",
                    g(&self.kv_bytes_held),
                ),
                (
                    "prefill_prefix_cache_bytes",
                    "KV bytes the prefix cache holds.",
                    g(&self.prefix_cache_bytes),
                ),
            ],
        );
        prom::all(
            &mut out,
            "counter",
            &[
                (
                    "prefill_prompt_tokens_total",
                    "Prompt tokens computed.",
                    g(&self.prompt_tokens),
                ),
                (
                    "prefill_compute_seconds_total",
                    "Time the compute thread spent on prompts.",
                    secs(&self.compute_micros),
                ),
                (
                    "prefill_queue_wait_seconds_total",
                    "Time prompts waited for the compute thread.",
                    secs(&self.queue_wait_micros),
                ),
                (
                    "prefill_kv_transfer_tail_seconds_total",
                    "Time from prompts' last computed layer to the decode node's acknowledgement of their KV.",
                    secs(&self.kv_tail_micros),
                ),
                (
                    "prefill_transfer_bytes_total",
                    "KV bytes acknowledged by decode nodes.",
                    g(&self.transfer_bytes),
                ),
                (
                    "prefill_prefix_cache_hits_total",
                    "Prompts that reused a cached prefix.",
                    g(&self.prefix_hits),
                ),
                (
                    "prefill_cached_tokens_total",
                    "Prompt tokens whose KV came from the prefix cache.",
                    g(&self.cached_tokens),
                ),
            ],
        );
        let name = "prefill_requests_total";
        prom::header(&mut out, name, "counter", "Prefill requests by outcome.");
        for (outcome, n) in [
            ("completed", &self.completed),
            ("failed", &self.failed),
            ("rejected", &self.rejected),
            ("cancelled", &self.cancelled),
        ] {
            prom::sample(&mut out, name, &[("outcome", outcome)], g(n));
        }
        self.queue_wait.render(
            &mut out,
            "prefill_queue_wait_duration_seconds",
            "Time each prompt waited for the compute thread.",
        );
        self.compute_duration.render(
            &mut out,
            "prefill_compute_duration_seconds",
            "Time from each prompt's first computed piece to its first tokens.",
        );
        self.transfer_tail.render(
            &mut out,
            "prefill_kv_transfer_tail_duration_seconds",
            "Time from each prompt's last computed layer to the decode node's acknowledgement of its KV.",
        );
        runtime::process::render(&mut out);
        out
    }
}
