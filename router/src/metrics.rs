//! Prometheus counters of the router, rendered as text at `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The router's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    in_flight: AtomicI64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
}

/// Counts a request as in flight until dropped.
pub struct InFlight(Arc<Metrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    /// Marks a request as started.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// Counts a finished (or failed) request of `endpoint` with its HTTP status.
    pub fn finished(&self, endpoint: &'static str, status: u16) {
        *self
            .requests
            .lock()
            .expect("metrics lock")
            .entry((endpoint, status))
            .or_default() += 1;
    }

    /// Adds a served request's token counts.
    pub fn tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP router_requests_total Requests answered, by endpoint and HTTP status.\n",
        );
        out.push_str("# TYPE router_requests_total counter\n");
        for ((endpoint, status), n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "router_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let gauges = [
            (
                "router_requests_in_flight",
                "gauge",
                "Requests being served.",
                self.in_flight.load(Ordering::Relaxed),
            ),
            (
                "router_prompt_tokens_total",
                "counter",
                "Prompt tokens of served requests.",
                self.prompt_tokens.load(Ordering::Relaxed) as i64,
            ),
            (
                "router_completion_tokens_total",
                "counter",
                "Completion tokens of served requests.",
                self.completion_tokens.load(Ordering::Relaxed) as i64,
            ),
        ];
        for (name, kind, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        out
    }
}
