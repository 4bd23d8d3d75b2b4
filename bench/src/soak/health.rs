//! What a process holds (memory, descriptors, threads, tasks, busy gauges) and how far it
//! may drift from its baseline.

use super::*;

/// What a process is, as far as its checks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Router,
    Prefill,
    Decode,
}

impl Kind {
    /// Gauges that read zero when the process holds no request.
    pub(super) fn idle_gauges(self) -> &'static [&'static str] {
        match self {
            Kind::Router => &["router_requests_in_flight"],
            Kind::Prefill => &[
                "prefill_kv_bytes_held",
                "prefill_running_prompts",
                "prefill_queue_depth",
            ],
            Kind::Decode => &[
                "decode_kv_blocks_used",
                "decode_running_sequences",
                "decode_waiting_requests",
                "decode_held_transfers",
            ],
        }
    }

    /// The kind of a worker, from the metrics its page carries.
    pub(super) fn of_worker(page: &str) -> Option<Self> {
        if metric(page, "decode_kv_blocks_used", "").is_some() {
            Some(Kind::Decode)
        } else if metric(page, "prefill_kv_bytes_held", "").is_some() {
            Some(Kind::Prefill)
        } else {
            None
        }
    }
}

/// The idle gauges of `kind` on `page` that are not zero (or absent), as `name=value`.
pub(super) fn busy(kind: Kind, page: &str) -> Vec<String> {
    kind.idle_gauges()
        .iter()
        .filter_map(|name| match metric(page, name, "") {
            Some(0.0) => None,
            Some(v) => Some(format!("{name}={v}")),
            None => Some(format!("{name} absent")),
        })
        .collect()
}

/// A process's resource figures from its metrics page.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Resources {
    pub rss_bytes: f64,
    /// Bytes the process keeps by design, up to a configured budget (the prefill node's
    /// prefix cache); resident memory is compared net of them.
    pub cache_bytes: f64,
    pub open_fds: f64,
    pub threads: f64,
    pub tokio_tasks: f64,
}

impl Resources {
    /// The figures on `page`; `None` when one is missing.
    pub fn from_page(page: &str) -> Option<Self> {
        let m = |name| metric(page, name, "");
        Some(Self {
            rss_bytes: m("process_resident_memory_bytes")?,
            cache_bytes: m("prefill_prefix_cache_bytes").unwrap_or(0.0),
            open_fds: m("process_open_fds")?,
            threads: m("process_threads")?,
            tokio_tasks: m("tokio_alive_tasks")?,
        })
    }
}

/// How far each figure may end above its baseline.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tolerance {
    /// Resident memory (net of caches): this share of the baseline or `rss_bytes`,
    /// whichever is more.
    pub rss_fraction: f64,
    pub rss_bytes: f64,
    pub fds: f64,
    pub threads: f64,
    pub tasks: f64,
}

impl Tolerance {
    /// The figures of `now` that are past their limit over `base`, described.
    pub fn exceeded(&self, base: &Resources, now: &Resources) -> Vec<String> {
        let mib = |b: f64| b / (1024.0 * 1024.0);
        let mut out = Vec::new();
        let (base_rss, now_rss) = (
            base.rss_bytes - base.cache_bytes,
            now.rss_bytes - now.cache_bytes,
        );
        let rss_limit = base_rss + (self.rss_fraction * base_rss).max(self.rss_bytes);
        if now_rss > rss_limit {
            out.push(format!(
                "RSS net of caches {:.1} MiB > {:.1} MiB (baseline {:.1})",
                mib(now_rss),
                mib(rss_limit),
                mib(base_rss)
            ));
        }
        for (what, b, n, slack) in [
            ("open fds", base.open_fds, now.open_fds, self.fds),
            ("threads", base.threads, now.threads, self.threads),
            ("tokio tasks", base.tokio_tasks, now.tokio_tasks, self.tasks),
        ] {
            if n > b + slack {
                out.push(format!("{what} {n} > {b} + {slack}"));
            }
        }
        out
    }
}

/// One process the soak watches.
#[derive(Debug, Clone)]
pub(super) struct Tracked {
    pub(super) name: String,
    pub(super) kind: Kind,
    pub(super) addr: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(rss_mb: f64, cache_mb: f64, fds: f64, threads: f64, tasks: f64) -> Resources {
        Resources {
            rss_bytes: rss_mb * 1024.0 * 1024.0,
            cache_bytes: cache_mb * 1024.0 * 1024.0,
            open_fds: fds,
            threads,
            tokio_tasks: tasks,
        }
    }

    #[test]
    fn tolerance_bounds_each_figure_above_its_baseline() {
        let tol = Tolerance {
            rss_fraction: 0.25,
            rss_bytes: 64.0 * 1024.0 * 1024.0,
            fds: 16.0,
            threads: 4.0,
            tasks: 16.0,
        };
        let base = res(100.0, 0.0, 30.0, 10.0, 20.0);
        // 64 MiB is more than 25% of 100 MiB, so it is the limit.
        assert!(tol
            .exceeded(&base, &res(163.0, 0.0, 46.0, 14.0, 36.0))
            .is_empty());
        // Lower is always fine.
        assert!(tol
            .exceeded(&base, &res(50.0, 0.0, 5.0, 2.0, 3.0))
            .is_empty());
        let over = tol.exceeded(&base, &res(165.0, 0.0, 47.0, 15.0, 37.0));
        assert_eq!(over.len(), 4, "{over:?}");
        // A cache grown up to its budget is not counted as a leak.
        assert!(tol
            .exceeded(&base, &res(400.0, 300.0, 30.0, 10.0, 20.0))
            .is_empty());
        // Above 256 MiB the share is the larger slack.
        let big = res(1000.0, 0.0, 30.0, 10.0, 20.0);
        assert!(tol
            .exceeded(&big, &res(1240.0, 0.0, 30.0, 10.0, 20.0))
            .is_empty());
        assert_eq!(
            tol.exceeded(&big, &res(1260.0, 0.0, 30.0, 10.0, 20.0))
                .len(),
            1
        );
    }

    #[test]
    fn idle_gauges_must_be_present_and_zero() {
        let page =
            "decode_kv_blocks_used 0\ndecode_running_sequences 2\ndecode_waiting_requests 0\n";
        assert_eq!(
            busy(Kind::Decode, page),
            vec![
                "decode_running_sequences=2".to_string(),
                "decode_held_transfers absent".to_string()
            ]
        );
        assert_eq!(Kind::of_worker(page), Some(Kind::Decode));
        assert_eq!(
            Kind::of_worker("prefill_kv_bytes_held 0\n"),
            Some(Kind::Prefill)
        );
        assert_eq!(Kind::of_worker("router_requests_in_flight 0\n"), None);
    }
}
