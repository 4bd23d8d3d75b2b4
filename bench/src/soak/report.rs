//! What a soak run reports: its kills, each process's figures and every check.

use super::*;

/// A node killed and started again.
#[derive(Debug, Clone, Serialize)]
pub struct KillRecord {
    pub process: String,
    pub addr: String,
    /// It held work (a prompt, or sequences) when it was killed.
    pub busy_at_kill: bool,
    pub killed_at_s: f64,
    /// When the router stopped counting it ready; `None` if it never did.
    pub noticed_at_s: Option<f64>,
    pub restarted_at_s: f64,
    /// When the router counted it ready again; `None` if it never did.
    pub back_at_s: Option<f64>,
}

/// One process's figures at the baseline and at the end.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessReport {
    pub name: String,
    pub kind: Kind,
    pub addr: String,
    /// Killed and started again during the run: compared with the baseline of the process
    /// it replaced (same binary, same flags).
    pub restarted: bool,
    pub baseline: Option<Resources>,
    pub end: Option<Resources>,
    /// Idle gauges not at zero at the end.
    pub busy_at_end: Vec<String>,
    pub exceeded: Vec<String>,
}

/// One pass/fail line of the result.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

/// What a soak measured and whether each check passed.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub duration_s: f64,
    pub warmup_s: f64,
    pub clients: usize,
    pub drop_percent: f64,
    pub model: String,
    pub tolerance: Tolerance,
    /// Requests sent, in all and by outcome (warm-up included).
    pub requests: usize,
    pub outcomes: BTreeMap<String, usize>,
    /// By `<api>/<stream|whole>` and then outcome.
    pub by_kind: BTreeMap<String, BTreeMap<String, usize>>,
    /// Requests per second over the steady run.
    pub throughput_rps: f64,
    pub kills: Vec<KillRecord>,
    /// Seconds the cluster took to settle after the warm-up and after the load.
    pub warmup_settled_s: Option<f64>,
    pub settled_s: Option<f64>,
    pub processes: Vec<ProcessReport>,
    /// The router's `router_requests_total` over the soak, by `endpoint/status`, and what
    /// the clients saw, the same way.
    pub router_counted: BTreeMap<String, u64>,
    pub clients_saw: BTreeMap<String, u64>,
    /// Requests that did not end well outside a kill (the first 100).
    pub unexpected: Vec<RequestRecord>,
    /// What the hostile peers did, with `--hostile`.
    pub hostile: Option<crate::hostile::HostileReport>,
    /// Where the processes' logs are.
    pub logs: String,
    pub checks: Vec<Check>,
    pub passed: bool,
}

impl SoakReport {
    /// A short text of the result: counts, kills, each process's figures and each check.
    pub fn summary(&self) -> String {
        let mib = |b: f64| b / (1024.0 * 1024.0);
        let mut s = format!(
            "soak: {} s steady after {} s warm-up, {} clients, {}% leave mid-stream, model {}\n",
            self.duration_s, self.warmup_s, self.clients, self.drop_percent, self.model
        );
        s += "(times in s from the start of the warm-up)\n";
        s += &format!(
            "requests: {} ({:.1}/s steady): {:?}\n",
            self.requests, self.throughput_rps, self.outcomes
        );
        for k in &self.kills {
            s +=
                &format!(
                "kill -9 {}{} at {:.1} s, router noticed at {}, restarted at {:.1} s, back at {}\n",
                k.process,
                if k.busy_at_kill { " (holding work)" } else { " (idle)" },
                k.killed_at_s,
                k.noticed_at_s
                    .map_or("never".into(), |t| format!("{t:.1} s")),
                k.restarted_at_s,
                k.back_at_s.map_or("never".into(), |t| format!("{t:.1} s")),
            );
        }
        if let Some(h) = &self.hostile {
            s += &format!(
                "hostile: {} forged KV tickets refused ({} accepted), {} silent and {} dripping \
                 KV connections cut (longest {:.1} s), bodiless requests {:?}, {} stalled streams \
                 cut and {} complete, {} never closed\n",
                h.kv_forged_refused,
                h.kv_forged_accepted,
                h.kv_idle_closed,
                h.kv_slow_closed,
                h.kv_longest_open_s,
                h.no_body_statuses,
                h.stalled_cut,
                h.stalled_complete,
                h.never_closed,
            );
        }
        s += &format!(
            "settled in {} after the load\n",
            self.settled_s
                .map_or("(never)".into(), |t| format!("{t:.1} s"))
        );
        s +=
            "| process | RSS MiB (net of caches) base → end | open fds | threads | tokio tasks |\n";
        s += "| --- | ---: | ---: | ---: | ---: |\n";
        for p in &self.processes {
            let pair = |f: &dyn Fn(&Resources) -> f64| match (&p.baseline, &p.end) {
                (Some(b), Some(e)) => format!("{:.0} → {:.0}", f(b), f(e)),
                _ => "-".into(),
            };
            s += &format!(
                "| {}{} | {} | {} | {} | {} |\n",
                p.name,
                if p.restarted { " (restarted)" } else { "" },
                match (&p.baseline, &p.end) {
                    (Some(b), Some(e)) => format!(
                        "{:.1} → {:.1}",
                        mib(b.rss_bytes - b.cache_bytes),
                        mib(e.rss_bytes - e.cache_bytes)
                    ),
                    _ => "-".into(),
                },
                pair(&|r| r.open_fds),
                pair(&|r| r.threads),
                pair(&|r| r.tokio_tasks),
            );
        }
        for c in &self.checks {
            let mark = if c.passed { "PASS" } else { "FAIL" };
            s += &format!("{mark} {}: {}\n", c.name, c.detail);
        }
        s
    }
}
