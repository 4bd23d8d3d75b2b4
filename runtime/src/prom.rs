//! Prometheus metrics through the `metrics` crate, rendered by metrics-exporter-prometheus.
//!
//! Each process part keeps a recorder of its own rather than the global one: a test binary
//! runs several routers and nodes side by side, and each must count apart. Handles are
//! registered once and kept in the metric structs, so recording is an atomic operation with
//! no key lookup.
//!
//! Histograms have fixed buckets. The exporter keeps each observation until the next render
//! or upkeep folds it into them, so [`Registry::spawn_upkeep`] folds them every few seconds:
//! without a scraper the samples would otherwise pile up.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use metrics::{Key, KeyName, Label, Level, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use metrics_util::MetricKindMask;

pub use metrics::{Counter, Gauge, Histogram};

/// Bucket bounds in seconds for latencies from a millisecond to a minute.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Bucket bounds in seconds for steps of work from 100 µs to a second: a decode step, the
/// gap between two streamed tokens, a transfer's tail.
pub const STEP_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// How often histogram samples are folded into their buckets between scrapes.
const UPKEEP: Duration = Duration::from_secs(5);

const METADATA: Metadata<'static> = Metadata::new("tandem", Level::INFO, None);

/// The metrics of one process part (a router, a prefill node, a decode node).
pub struct Registry {
    recorder: Arc<PrometheusRecorder>,
    /// Held from setting a render's gauges to the end of the render: with scrape gauges,
    /// a second scrape between the two would find them unset and drop them.
    rendering: Mutex<()>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl Registry {
    /// A registry whose histograms named in `steps` take [`STEP_BUCKETS`], the others
    /// [`LATENCY_BUCKETS`].
    pub fn new(steps: &[&str]) -> Self {
        Self::build(steps, PrometheusBuilder::new())
    }

    /// Like [`Registry::new`], for a part that sets every gauge in [`Registry::render_with`],
    /// looking each up there: a gauge not set since the last render leaves the page (and the
    /// registry, so a gauge handle kept from before would write where nothing reads). The
    /// router's gauges labelled by worker need it: a recorder never forgets a label set, so
    /// the series of workers long gone would otherwise stay, and grow as pods come and go.
    pub fn with_scrape_gauges(steps: &[&str]) -> Self {
        let builder =
            PrometheusBuilder::new().idle_timeout(MetricKindMask::GAUGE, Some(Duration::ZERO));
        Self::build(steps, builder)
    }

    fn build(steps: &[&str], mut builder: PrometheusBuilder) -> Self {
        builder = builder
            .set_buckets(LATENCY_BUCKETS)
            .expect("the bucket list is not empty");
        for name in steps {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name.to_string()), STEP_BUCKETS)
                .expect("the bucket list is not empty");
        }
        Self {
            recorder: Arc::new(builder.build_recorder()),
            rendering: Mutex::default(),
        }
    }

    /// Folds histogram samples into their buckets every few seconds while the registry
    /// lives. Needs a tokio runtime.
    pub fn spawn_upkeep(&self) {
        let weak: Weak<PrometheusRecorder> = Arc::downgrade(&self.recorder);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(UPKEEP);
            loop {
                tick.tick().await;
                let Some(recorder) = weak.upgrade() else {
                    return;
                };
                recorder.handle().run_upkeep();
            }
        });
    }

    /// A counter, described by `help`.
    pub fn counter(&self, name: &'static str, help: &'static str) -> Counter {
        self.counter_with(name, help, &[])
    }

    /// A counter with labels.
    pub fn counter_with(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Counter {
        self.recorder
            .describe_counter(KeyName::from(name), None, SharedString::from(help));
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
    }

    /// A gauge, described by `help`.
    pub fn gauge(&self, name: &'static str, help: &'static str) -> Gauge {
        self.gauge_with(name, help, &[])
    }

    /// A gauge with labels.
    pub fn gauge_with(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Gauge {
        self.recorder
            .describe_gauge(KeyName::from(name), None, SharedString::from(help));
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    /// A histogram of seconds, described by `help`.
    pub fn histogram(&self, name: &'static str, help: &'static str) -> Histogram {
        self.recorder
            .describe_histogram(KeyName::from(name), None, SharedString::from(help));
        self.recorder.register_histogram(&key(name, &[]), &METADATA)
    }

    /// The text exposition, with the process-wide figures (memory, threads, TLS refusals)
    /// read now.
    pub fn render(&self) -> String {
        self.render_with(|_| {})
    }

    /// The text exposition after `set` has set the gauges read at scrape time.
    pub fn render_with(&self, set: impl FnOnce(&Registry)) -> String {
        let _one = self.rendering.lock().unwrap_or_else(|e| e.into_inner());
        set(self);
        self.process_figures();
        self.recorder.handle().render()
    }

    fn process_figures(&self) {
        self.gauge_with(
            "tandem_build_info",
            "The build this process runs: always 1, its labels name it.",
            &[("version", crate::VERSION)],
        )
        .set(1.0);
        match crate::process::read() {
            Ok(s) => {
                for (name, help, value) in [
                    (
                        "process_resident_memory_bytes",
                        "Resident memory size in bytes.",
                        s.resident_memory_bytes,
                    ),
                    ("process_open_fds", "Open file descriptors.", s.open_fds),
                    ("process_threads", "OS threads.", s.threads),
                ] {
                    self.gauge(name, help).set(value as f64);
                }
            }
            // A scrape must still answer; the figures are simply absent.
            Err(e) => tracing::debug!(error = %e, "process figures unavailable"),
        }
        if let Some(tasks) = crate::process::tokio_alive_tasks() {
            self.gauge(
                "tokio_alive_tasks",
                "Tokio tasks spawned and not yet finished.",
            )
            .set(tasks as f64);
        }
        self.counter(
            "tls_handshakes_refused_total",
            "TLS handshakes refused or timed out on this process's listeners (bad or missing \
             certificates, plain text on a TLS port, probes).",
        )
        .absolute(tls::handshakes_refused());
        self.counter(
            "tls_role_refusals_total",
            "Calls refused because the caller's certificate lacks the role the service takes \
             (a URI SAN spiffe://tandem/<role>).",
        )
        .absolute(crate::role_refusals());
    }
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect();
    Key::from_parts(name, labels)
}

/// Durations recorded as seconds.
pub trait Observe {
    fn observe(&self, d: Duration);
}

impl Observe for Histogram {
    fn observe(&self, d: Duration) {
        self.record(d.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(page: &'a str, prefix: &str) -> &'a str {
        page.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{page}"))
    }

    #[test]
    fn counts_apart_and_writes_the_text_format() {
        let (a, b) = (Registry::new(&[]), Registry::new(&[]));
        a.counter_with("x_total", "By kind.", &[("kind", "a\"b")])
            .increment(2);
        b.gauge("x_used", "Used.").set(3.0);
        let (pa, pb) = (a.render(), b.render());
        assert!(
            pa.contains("# HELP x_total By kind.\n# TYPE x_total counter\n"),
            "{pa}"
        );
        assert_eq!(line(&pa, "x_total{"), "x_total{kind=\"a\\\"b\"} 2");
        assert!(!pa.contains("x_used"), "{pa}");
        assert_eq!(line(&pb, "x_used "), "x_used 3");
        assert!(!pb.contains("x_total"), "{pb}");
    }

    #[test]
    fn every_page_names_the_build() {
        let page = Registry::with_scrape_gauges(&[]).render();
        let want = format!("tandem_build_info{{version=\"{}\"}} 1", crate::VERSION);
        assert_eq!(line(&page, "tandem_build_info{"), want);
    }

    #[test]
    fn histograms_are_cumulative_over_their_buckets() {
        let r = Registry::new(&["s_seconds"]);
        let h = r.histogram("x_seconds", "X.");
        for ms in [50, 500, 3000] {
            h.observe(Duration::from_millis(ms));
        }
        r.histogram("s_seconds", "S.")
            .observe(Duration::from_micros(150));
        let page = r.render();
        assert_eq!(
            line(&page, "x_seconds_bucket{le=\"0.05\"}"),
            "x_seconds_bucket{le=\"0.05\"} 1"
        );
        assert_eq!(
            line(&page, "x_seconds_bucket{le=\"1\"}"),
            "x_seconds_bucket{le=\"1\"} 2"
        );
        assert_eq!(
            line(&page, "x_seconds_bucket{le=\"+Inf\"}"),
            "x_seconds_bucket{le=\"+Inf\"} 3"
        );
        assert_eq!(line(&page, "x_seconds_sum"), "x_seconds_sum 3.55");
        assert_eq!(line(&page, "x_seconds_count"), "x_seconds_count 3");
        assert_eq!(
            line(&page, "s_seconds_bucket{le=\"0.0001\"}"),
            "s_seconds_bucket{le=\"0.0001\"} 0"
        );
        assert_eq!(
            line(&page, "s_seconds_bucket{le=\"0.00025\"}"),
            "s_seconds_bucket{le=\"0.00025\"} 1"
        );
    }

    #[test]
    fn renders_the_tokio_figure_only_inside_a_runtime() {
        let outside = Registry::new(&[]).render();
        assert!(!outside.contains("tokio_alive_tasks"), "{outside}");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let inside = rt.block_on(async {
            let _task = tokio::spawn(std::future::pending::<()>());
            Registry::new(&[]).render()
        });
        assert_eq!(line(&inside, "tokio_alive_tasks "), "tokio_alive_tasks 1");
        #[cfg(target_os = "linux")]
        for name in [
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_threads ",
        ] {
            line(&inside, name);
        }
        line(&inside, "tls_handshakes_refused_total ");
    }

    #[test]
    fn scrape_gauges_not_set_again_leave_the_page() {
        let r = Registry::with_scrape_gauges(&[]);
        let first = r.render_with(|r| {
            for w in ["a", "b"] {
                r.gauge_with("w", "W.", &[("worker", w)]).set(1.0);
            }
        });
        assert!(first.contains("w{worker=\"a\"} 1"), "{first}");
        // Only b is set again for the next render: a is gone from the page.
        let page = r.render_with(|r| r.gauge_with("w", "W.", &[("worker", "b")]).set(1.0));
        assert!(!page.contains("worker=\"a\""), "{page}");
        assert!(page.contains("w{worker=\"b\"} 1"), "{page}");
    }
}
