//! Prometheus text exposition, written by hand: a few lines per metric need no library.

use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The HELP and TYPE lines of a metric.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One sample of a metric, with its labels.
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: impl Display) {
    out.push_str(name);
    if !labels.is_empty() {
        let inner: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        let _ = write!(out, "{{{}}}", inner.join(","));
    }
    let _ = writeln!(out, " {value}");
}

/// The process-wide TLS counters, which every binary exports beside its own.
pub fn tls(out: &mut String) {
    all(
        out,
        "counter",
        &[
            (
                "tls_handshakes_refused_total",
                "TLS handshakes refused or timed out on this process's listeners (bad or missing \
             certificates, plain text on a TLS port, probes).",
                tls::handshakes_refused() as f64,
            ),
            (
                "tls_role_refusals_total",
                "Calls refused because the caller's certificate lacks the role the service takes \
             (a URI SAN spiffe://tandem/<role>).",
                crate::role_refusals() as f64,
            ),
        ],
    );
}

/// Unlabelled metrics of one kind (`gauge` or `counter`), each `(name, help, value)`.
pub fn all(out: &mut String, kind: &str, metrics: &[(&str, &str, f64)]) {
    for (name, help, value) in metrics {
        header(out, name, kind, help);
        sample(out, name, &[], value);
    }
}

/// A histogram of seconds with fixed buckets, safe to observe from any thread.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative), then above the last.
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

/// Bucket bounds in seconds for latencies from a millisecond to a minute.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl Default for Histogram {
    fn default() -> Self {
        Self::new(LATENCY_BUCKETS)
    }
}

/// Bucket bounds in seconds for steps of work from 100 µs to a second: a decode step, the
/// gap between two streamed tokens, a transfer's tail.
pub const STEP_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A [`Histogram`] over [`STEP_BUCKETS`], by default.
#[derive(Debug)]
pub struct StepHistogram(Histogram);

impl Default for StepHistogram {
    fn default() -> Self {
        Self(Histogram::new(STEP_BUCKETS))
    }
}

impl std::ops::Deref for StepHistogram {
    type Target = Histogram;

    fn deref(&self) -> &Histogram {
        &self.0
    }
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Appends the histogram in the text format.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, "histogram", help);
        let mut cumulative = 0;
        for (i, bound) in self.bounds.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            sample(
                out,
                &format!("{name}_bucket"),
                &[("le", &bound.to_string())],
                cumulative,
            );
        }
        cumulative += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        sample(
            out,
            &format!("{name}_bucket"),
            &[("le", "+Inf")],
            cumulative,
        );
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        sample(out, &format!("{name}_sum"), &[], sum);
        sample(out, &format!("{name}_count"), &[], cumulative);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_text_format() {
        let mut out = String::new();
        all(&mut out, "gauge", &[("x_used", "Used.", 3.0)]);
        header(&mut out, "x_total", "counter", "By kind.");
        sample(&mut out, "x_total", &[("kind", "a\"b")], 1.5);
        assert_eq!(
            out,
            "# HELP x_used Used.\n# TYPE x_used gauge\nx_used 3\n\
             # HELP x_total By kind.\n# TYPE x_total counter\nx_total{kind=\"a\\\"b\"} 1.5\n"
        );
    }

    #[test]
    fn histograms_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(3));
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "X.");
        assert!(out.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"1\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_seconds_sum 3.55\n"), "{out}");
        assert!(out.contains("x_seconds_count 3\n"), "{out}");
    }
}
