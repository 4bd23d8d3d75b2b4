//! Prometheus counters of the router, rendered as text at `/metrics`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use runtime::prom::{self, Histogram};

use crate::error::RouterError;
use crate::keys::Key;

/// The router's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    in_flight: AtomicI64,
    overloaded: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    retries: AtomicU64,
    /// Failed attempts by (prefill, decode) address; the prefill one is empty in colocated
    /// mode.
    pair_failures: Mutex<BTreeMap<(String, String), u64>>,
    /// From the request's arrival to its first token.
    pub ttft: Histogram,
    /// Per request: the time after its first token over the tokens that followed.
    pub tpot: Histogram,
}

/// Counts a request as in flight (in all, and for its API key) until dropped.
pub struct InFlight {
    metrics: Arc<Metrics>,
    key: Option<Arc<Key>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(k) = &self.key {
            k.end();
        }
    }
}

impl Metrics {
    /// Marks a request as started, unless `max` are in flight already or its key is at its
    /// own limit: the request is then refused at once rather than queued without bound.
    pub fn start(
        self: &Arc<Self>,
        max: usize,
        key: Option<Arc<Key>>,
        key_max: usize,
    ) -> Result<InFlight, RouterError> {
        let before = self.in_flight.fetch_add(1, Ordering::Relaxed);
        if before >= max as i64 {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            self.overloaded.fetch_add(1, Ordering::Relaxed);
            return Err(RouterError::Overloaded(max));
        }
        // Built first, so a refusal by the key gives the router's slot back on drop.
        let mut guard = InFlight {
            metrics: Arc::clone(self),
            key: None,
        };
        if let Some(k) = key {
            if !k.begin(key_max) {
                return Err(RouterError::KeyBusy(key_max));
            }
            guard.key = Some(k);
        }
        Ok(guard)
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

    /// Counts an attempt after a request's first.
    pub fn retried(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a failed attempt on a prefill/decode pair.
    pub fn pair_failed(&self, prefill: &str, decode: &str) {
        *self
            .pair_failures
            .lock()
            .expect("metrics lock")
            .entry((prefill.to_string(), decode.to_string()))
            .or_default() += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let name = "router_requests_total";
        prom::header(
            &mut out,
            name,
            "counter",
            "Requests answered, by endpoint and HTTP status.",
        );
        for ((endpoint, status), n) in self.requests.lock().expect("metrics lock").iter() {
            let status = status.to_string();
            prom::sample(
                &mut out,
                name,
                &[("endpoint", endpoint), ("status", &status)],
                n,
            );
        }
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        prom::all(
            &mut out,
            "gauge",
            &[(
                "router_requests_in_flight",
                "Requests being served.",
                self.in_flight.load(Ordering::Relaxed) as f64,
            )],
        );
        prom::all(
            &mut out,
            "counter",
            &[
                (
                    "router_overloaded_total",
                    "Requests refused with 503 because the router was at its in-flight limit.",
                    g(&self.overloaded),
                ),
                (
                    "router_prompt_tokens_total",
                    "Prompt tokens of served requests.",
                    g(&self.prompt_tokens),
                ),
                (
                    "router_completion_tokens_total",
                    "Completion tokens of served requests.",
                    g(&self.completion_tokens),
                ),
                (
                    "router_retries_total",
                    "Attempts after a request's first, on another worker pair.",
                    g(&self.retries),
                ),
            ],
        );
        let name = "router_pair_failures_total";
        prom::header(
            &mut out,
            name,
            "counter",
            "Failed attempts by prefill and decode worker.",
        );
        for ((p, d), n) in self.pair_failures.lock().expect("metrics lock").iter() {
            prom::sample(&mut out, name, &[("prefill", p), ("decode", d)], n);
        }
        self.ttft.render(
            &mut out,
            "router_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        self.tpot.render(
            &mut out,
            "router_time_per_output_token_seconds",
            "Per request, the time after the first token over the tokens that followed.",
        );
        out
    }
}
