//! The router's Prometheus metrics, rendered at `/metrics`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use runtime::prom::{Counter, Histogram, Registry};

use crate::error::RouterError;
use crate::keys::Key;
use crate::placement::Placement;

/// The router's counters and histograms, and the admission counts its limits take slots
/// from.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by endpoint and status: registered at first use.
    requests: Mutex<HashMap<(&'static str, u16), Counter>>,
    /// Attempts by where their prompt is computed, in [`Placement::ALL`] order.
    placements: [Counter; 4],
    /// Requests in flight: the slots `--max-in-flight` bounds.
    in_flight: AtomicI64,
    /// SSE responses open, from admission to the end of their stream.
    streams: AtomicI64,
    overloaded: Counter,
    streams_refused: Counter,
    prompt_tokens: Counter,
    completion_tokens: Counter,
    retries: Counter,
    /// Streams moved to another decode node after theirs failed mid-way.
    migrations: Counter,
    /// Client connections closed because a response write waited past --client-stall-timeout-ms.
    client_stalls: Counter,
    /// Request bodies that did not arrive within --body-timeout-ms.
    body_timeouts: Counter,
    /// Failed attempts by the kind of worker the failure points at, in
    /// [`Culprit::ALL`] order. Not by worker address: pairs of pod IPs would add label
    /// sets without bound as pods come and go (the log names the workers).
    attempt_failures: [Counter; 5],
    /// From the request's arrival to its first token.
    pub ttft: Histogram,
    /// Per request: the time after its first token over the tokens that followed.
    pub tpot: Histogram,
    /// Per token after a choice's first: the time since that choice's previous token.
    pub itl: Histogram,
}

const ITL: &str = "router_inter_token_latency_seconds";

impl Default for Metrics {
    fn default() -> Self {
        let r = Registry::with_scrape_gauges(&[ITL]);
        let c = |name, help| r.counter(name, help);
        Self {
            requests: Mutex::default(),
            in_flight: AtomicI64::new(0),
            streams: AtomicI64::new(0),
            overloaded: c(
                "router_overloaded_total",
                "Requests refused with 503 because the router was at its in-flight limit.",
            ),
            streams_refused: c(
                "router_streams_refused_total",
                "Streamed requests refused with 503 because --max-streams were open.",
            ),
            prompt_tokens: c(
                "router_prompt_tokens_total",
                "Prompt tokens of served requests.",
            ),
            completion_tokens: c(
                "router_completion_tokens_total",
                "Completion tokens of served requests.",
            ),
            retries: c(
                "router_retries_total",
                "Attempts after a request's first, on another worker pair.",
            ),
            migrations: c(
                "router_stream_migrations_total",
                "Streams moved to another decode node after theirs failed or stopped \
                 answering mid-way (--stream-migration); each also counts as a retry.",
            ),
            client_stalls: c(
                "router_client_stalls_total",
                "Connections closed because a client read nothing of its response for \
                 --client-stall-timeout-ms (its generation cancelled).",
            ),
            body_timeouts: c(
                "router_body_timeouts_total",
                "Requests answered 408 because their body did not arrive within \
                 --body-timeout-ms.",
            ),
            placements: Placement::ALL.map(|p| {
                r.counter_with(
                    "router_prefill_placements_total",
                    "Attempts by where their prompt was computed (placement: prefill_node, \
                     decode_node) and why (reason: disaggregated, no_room, colocated, \
                     short_prompt); a retried request counts once per attempt.",
                    &[("placement", p.as_str()), ("reason", p.reason())],
                )
            }),
            attempt_failures: Culprit::ALL.map(|culprit| {
                r.counter_with(
                    "router_attempt_failures_total",
                    "Failed attempts, by the kind of worker the failure points at (request: \
                     a worker refused the request itself, which counts against no worker).",
                    &[("culprit", culprit.as_str())],
                )
            }),
            ttft: r.histogram(
                "router_time_to_first_token_seconds",
                "Time from a request's arrival to its first token.",
            ),
            tpot: r.histogram(
                "router_time_per_output_token_seconds",
                "Per request, the time after the first token over the tokens that followed.",
            ),
            itl: r.histogram(
                ITL,
                "Per token after a choice's first, the time since that choice's previous token.",
            ),
            registry: r,
        }
    }
}

/// The kind of worker a failed attempt points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Culprit {
    Prefill,
    Decode,
    Colocated,
    /// The request itself, refused by a worker (its arguments, its size, its grammar):
    /// counted against no worker.
    Request,
    /// No one worker (no worker to pick, a timeout).
    None,
}

impl Culprit {
    const ALL: [Culprit; 5] = [
        Culprit::Prefill,
        Culprit::Decode,
        Culprit::Colocated,
        Culprit::Request,
        Culprit::None,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Culprit::Prefill => "prefill",
            Culprit::Decode => "decode",
            Culprit::Colocated => "colocated",
            Culprit::Request => "request",
            Culprit::None => "none",
        }
    }
}

/// Counts a request as in flight (in all, for its API key, and as an open stream once it
/// is one) until dropped.
pub struct InFlight {
    metrics: Arc<Metrics>,
    key: Option<Arc<Key>>,
    stream: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(k) = &self.key {
            k.end();
        }
        if self.stream {
            self.metrics.streams.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl InFlight {
    /// Counts the request as an open stream too, unless `max` (0: no limit) are open: a
    /// stream holds a connection and a task for as long as it runs, so past the limit it is
    /// refused at once. The slot goes back when the guard is dropped, which the streaming
    /// task does when the stream ends for any reason (finished, failed, client gone).
    pub fn open_stream(&mut self, max: usize) -> Result<(), RouterError> {
        if self.stream {
            return Ok(());
        }
        let m = &self.metrics;
        let before = m.streams.fetch_add(1, Ordering::Relaxed);
        if max > 0 && before >= max as i64 {
            m.streams.fetch_sub(1, Ordering::Relaxed);
            m.streams_refused.increment(1);
            return Err(RouterError::TooManyStreams(max));
        }
        self.stream = true;
        Ok(())
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
            self.overloaded.increment(1);
            return Err(RouterError::Overloaded(max));
        }
        // Built first, so a refusal by the key gives the router's slot back on drop.
        let mut guard = InFlight {
            metrics: Arc::clone(self),
            key: None,
            stream: false,
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
        self.requests
            .lock()
            .expect("metrics lock")
            .entry((endpoint, status))
            .or_insert_with(|| {
                self.registry.counter_with(
                    "router_requests_total",
                    "Requests answered, by endpoint and HTTP status.",
                    &[("endpoint", endpoint), ("status", &status.to_string())],
                )
            })
            .increment(1);
    }

    /// Adds a served request's token counts.
    pub fn tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens.increment(prompt as u64);
        self.completion_tokens.increment(completion as u64);
    }

    /// Counts a connection closed on a client that stopped reading.
    pub fn client_stalled(&self) {
        self.client_stalls.increment(1);
    }

    /// Counts a request whose body did not arrive in time.
    pub fn body_timed_out(&self) {
        self.body_timeouts.increment(1);
    }

    /// Counts where a request's prompt is computed, and why.
    pub fn placed(&self, p: Placement) {
        self.placements[p.index()].increment(1);
    }

    /// Counts an attempt after a request's first.
    pub fn retried(&self) {
        self.retries.increment(1);
    }

    /// Counts a stream moved to another decode node.
    pub fn migrated(&self) {
        self.migrations.increment(1);
    }

    /// Counts a failed attempt, by the kind of worker it points at.
    pub fn attempt_failed(&self, culprit: Culprit) {
        self.attempt_failures[culprit as usize].increment(1);
    }

    /// Folds histogram samples into their buckets between scrapes; needs a tokio runtime.
    pub fn spawn_upkeep(&self) {
        self.registry.spawn_upkeep();
    }

    /// The Prometheus text exposition, after `set` has set the gauges of the router's
    /// state (its pools, discovery) on the registry.
    pub fn render_with(&self, set: impl FnOnce(&Registry)) -> String {
        self.registry.render_with(|r| {
            let now = |a: &AtomicI64| a.load(Ordering::Relaxed) as f64;
            r.gauge("router_requests_in_flight", "Requests being served.")
                .set(now(&self.in_flight));
            r.gauge(
                "router_streams_open",
                "Streamed (SSE) responses open, counted against --max-streams.",
            )
            .set(now(&self.streams));
            set(r);
        })
    }

    /// The exposition of the router's own figures alone.
    pub fn render(&self) -> String {
        self.render_with(|_| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streams(m: &Metrics) -> i64 {
        m.streams.load(Ordering::Relaxed)
    }

    #[test]
    fn streams_are_bounded_and_given_back_on_drop() {
        let m = Arc::new(Metrics::default());
        let mut a = m.start(8, None, 0).unwrap();
        let mut b = m.start(8, None, 0).unwrap();
        a.open_stream(2).unwrap();
        b.open_stream(2).unwrap();
        // Asking twice for one request holds one slot, not two.
        b.open_stream(2).unwrap();
        assert_eq!(streams(&m), 2);
        let mut c = m.start(8, None, 0).unwrap();
        assert!(matches!(
            c.open_stream(2),
            Err(RouterError::TooManyStreams(2))
        ));
        assert_eq!(streams(&m), 2, "a refusal holds no slot");
        assert!(m.render().contains("router_streams_refused_total 1\n"));
        drop(a);
        assert_eq!(streams(&m), 1);
        c.open_stream(2).unwrap();
        drop((b, c));
        assert_eq!(streams(&m), 0);
        assert_eq!(m.in_flight.load(Ordering::Relaxed), 0);
        assert!(m.render().contains("router_streams_open 0\n"));
    }

    #[test]
    fn zero_streams_means_no_limit() {
        let m = Arc::new(Metrics::default());
        let held: Vec<InFlight> = (0..3)
            .map(|_| {
                let mut g = m.start(8, None, 0).unwrap();
                g.open_stream(0).unwrap();
                g
            })
            .collect();
        assert_eq!(streams(&m), 3);
        drop(held);
        assert_eq!(streams(&m), 0);
    }

    #[test]
    fn attempt_failures_have_one_label_set_per_kind_of_worker() {
        let m = Metrics::default();
        m.attempt_failed(Culprit::Decode);
        m.attempt_failed(Culprit::Decode);
        m.attempt_failed(Culprit::None);
        let page = m.render();
        let mut lines: Vec<_> = page
            .lines()
            .filter(|l| l.starts_with("router_attempt_failures_total{"))
            .collect();
        lines.sort();
        assert_eq!(
            lines,
            [
                "router_attempt_failures_total{culprit=\"colocated\"} 0",
                "router_attempt_failures_total{culprit=\"decode\"} 2",
                "router_attempt_failures_total{culprit=\"none\"} 1",
                "router_attempt_failures_total{culprit=\"prefill\"} 0",
                "router_attempt_failures_total{culprit=\"request\"} 0",
            ]
        );
    }
}
