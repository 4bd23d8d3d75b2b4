//! The endurance run: a router, two prefill and two decode nodes found through a real etcd
//! (or a cluster already running), a steady mixed load for a long time with a share of
//! clients leaving mid-stream, one prefill and one decode node killed (-9) and started again
//! during it, and at the end the checks that nothing leaked: every request ended (finished,
//! a clean error, or left by its client), KV held nowhere, and each process's memory,
//! descriptors, threads and tokio tasks back near their values after warm-up. It only drives
//! the cluster and reads its `/metrics`; it never reaches into a process.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{metric, workers_in, Fleet, Proc, Role, Worker};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::load::{self, Api, Rng, Shape};

mod cluster;
mod health;
mod report;
mod traffic;

use cluster::*;
use health::*;
pub use report::*;
use traffic::*;
pub use traffic::{Outcome, RequestRecord};

/// What a soak run does and how much it lets the processes drift.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "soak")]
pub struct SoakConfig {
    /// Seconds of steady load after the warm-up.
    #[arg(long, default_value_t = 3600.0)]
    pub duration_s: f64,
    /// Seconds of load before the baseline is taken, so that pools, caches and allocator
    /// arenas have grown to their working size.
    #[arg(long, default_value_t = 30.0)]
    pub warmup_s: f64,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Mean pause of a client between two requests, in ms (exponential).
    #[arg(long, default_value_t = 100.0)]
    pub think_ms: f64,
    /// Percent of requests whose client leaves mid-stream.
    #[arg(long, default_value_t = 10.0)]
    pub drop_percent: f64,
    /// Most words in a prompt (each about one token); drawn uniformly from 8.
    #[arg(long, default_value_t = 64)]
    pub max_prompt_words: usize,
    /// Most output tokens of a request; drawn uniformly from 4. A client that leaves asks for
    /// four times this, so that it leaves while tokens still come.
    #[arg(long, default_value_t = 32)]
    pub max_output_tokens: usize,
    /// Seconds into the steady run when prefill node 0 is killed (default: 30% of it).
    #[arg(long)]
    pub kill_prefill_at_s: Option<f64>,
    /// Seconds into the steady run when decode node 0 is killed (default: 60% of it).
    #[arg(long)]
    pub kill_decode_at_s: Option<f64>,
    /// Seconds a killed node stays down before it is started again on its address.
    #[arg(long, default_value_t = 5.0)]
    pub restart_after_s: f64,
    /// Seconds after a restarted node is back in the router's rotation during which an
    /// error still counts as the kill's.
    #[arg(long, default_value_t = 5.0)]
    pub kill_grace_s: f64,
    /// Kill nothing.
    #[arg(long)]
    pub no_kills: bool,
    /// Run hostile peers and broken clients beside the load for the whole steady run
    /// (see `hostile`): forged KV tickets, silent and dripping KV connections, bodiless
    /// requests and streams whose client stops reading.
    #[arg(long)]
    pub hostile: bool,
    /// The prefill nodes' prefix cache (`--prefix-cache-mb`): small, so that it fills during
    /// the warm-up and the whole run evicts, and the baseline is taken with it full.
    #[arg(long, default_value_t = 32)]
    pub prefix_cache_mb: u64,
    /// Seconds a request may take before it counts as hung.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout_s: f64,
    /// Seconds the cluster may take to settle after the load (and after the warm-up).
    #[arg(long, default_value_t = 60.0)]
    pub settle_s: f64,
    /// Resident memory may end this many percent above its baseline...
    #[arg(long, default_value_t = 25.0)]
    pub rss_slack_percent: f64,
    /// ...or this many MiB, whichever is more.
    #[arg(long, default_value_t = 64.0)]
    pub rss_slack_mb: f64,
    /// Open file descriptors a process may end with above its baseline.
    #[arg(long, default_value_t = 16)]
    pub fd_slack: u64,
    /// Threads a process may end with above its baseline.
    #[arg(long, default_value_t = 4)]
    pub thread_slack: u64,
    /// Tokio tasks a process may end with above its baseline.
    #[arg(long, default_value_t = 16)]
    pub task_slack: u64,
    /// The model to serve (a Hugging Face folder or a GGUF file); default: the generated
    /// tiny model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Soak a cluster already running behind this router URL instead of starting one
    /// (nothing is killed then).
    #[arg(long)]
    pub url: Option<String>,
    /// With `--url`: the router's operations listener (host:port of its `/metrics`).
    #[arg(long)]
    pub router_metrics: Option<String>,
    /// With `--url`: the `model` of each request.
    #[arg(long, default_value = "test")]
    pub model_name: String,
    /// With `--url`: the prefill and decode nodes (host:port of their `/metrics`), comma
    /// separated.
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the result here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl SoakConfig {
    fn kills(&self) -> Vec<(Role, f64)> {
        if self.no_kills || self.url.is_some() {
            return Vec::new();
        }
        let mut kills = vec![
            (
                Role::Prefill,
                self.kill_prefill_at_s.unwrap_or(0.3 * self.duration_s),
            ),
            (
                Role::Decode,
                self.kill_decode_at_s.unwrap_or(0.6 * self.duration_s),
            ),
        ];
        kills.sort_by(|a, b| a.1.total_cmp(&b.1));
        kills
    }

    fn tolerance(&self) -> Tolerance {
        Tolerance {
            rss_fraction: self.rss_slack_percent / 100.0,
            rss_bytes: self.rss_slack_mb * 1024.0 * 1024.0,
            fds: self.fd_slack as f64,
            threads: self.thread_slack as f64,
            tasks: self.task_slack as f64,
        }
    }
}

/// Why a soak could not run at all (a failed check is not an error: it is in the report).
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error("{0} does not serve /metrics")]
    Unreachable(String),
    #[error("{0} serves neither prefill nor decode metrics")]
    UnknownRole(String),
    #[error("configuration: {0}")]
    Config(String),
}

fn check(name: &str, passed: bool, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        passed,
        detail: detail.into(),
    }
}

/// Whether a request's end falls in a kill's window: from the kill until `grace_s` after
/// the node was back (or, if it never came back, without end).
fn in_kill_window(kills: &[KillRecord], at_s: f64, grace_s: f64) -> bool {
    kills
        .iter()
        .any(|k| at_s >= k.killed_at_s && k.back_at_s.is_none_or(|back| at_s <= back + grace_s))
}

/// Runs the soak and checks the cluster afterwards. Failed checks are in the report; an
/// error means the soak could not run.
pub async fn run(cfg: &SoakConfig) -> Result<SoakReport, SoakError> {
    let kills_planned = cfg.kills();
    if let Some(&(role, at)) = kills_planned.iter().find(|(_, at)| *at >= cfg.duration_s) {
        return Err(SoakError::Config(format!(
            "the {} kill at {at} s is not within the {} s run",
            role.name(),
            cfg.duration_s
        )));
    }
    if cfg.url.is_some() && cfg.workers.is_empty() {
        return Err(SoakError::Config("--url needs --workers".into()));
    }
    let tol = cfg.tolerance();
    let scraper = reqwest::Client::new();
    let mut cluster = Cluster::start(cfg, &scraper).await?;
    let settle_limit = Duration::from_secs_f64(cfg.settle_s);
    let t0 = Instant::now();
    let load = || Load {
        client: reqwest::Client::new(),
        base: cluster.url.clone(),
        model: cluster.model_name.clone(),
        cfg: cfg.clone(),
        t0,
    };
    let router_before = scrape(&scraper, &cluster.ops)
        .await
        .map(|p| router_requests(&p))
        .ok_or_else(|| SoakError::Unreachable(cluster.url.clone()))?;

    let warm_until = Instant::now() + Duration::from_secs_f64(cfg.warmup_s);
    let mut records = drive(load(), warm_until, cfg.clients).await;
    let (warmup_settled_s, pages) = cluster.settle(&scraper, None, &tol, settle_limit).await;
    let baseline: BTreeMap<String, Resources> = pages
        .iter()
        .filter_map(|(name, page)| Some((name.clone(), Resources::from_page(page)?)))
        .collect();

    let steady_start = Instant::now();
    let steady_until = steady_start + Duration::from_secs_f64(cfg.duration_s);
    let steady = tokio::spawn(drive(load(), steady_until, cfg.clients));
    let hostile = cfg.hostile.then(|| {
        let decode = cluster
            .procs
            .iter()
            .filter(|p| p.kind == Kind::Decode)
            .map(|p| p.addr.clone())
            .collect();
        let router = cluster.router_addr().to_string();
        let model = cluster.model_name.clone();
        tokio::spawn(crate::hostile::run(decode, router, model, t0, steady_until))
    });
    let mut kills = Vec::new();
    for (role, at) in &kills_planned {
        tokio::time::sleep_until((steady_start + Duration::from_secs_f64(*at)).into()).await;
        let down = Duration::from_secs_f64(cfg.restart_after_s);
        kills.push(cluster.kill_and_restart(&scraper, *role, down, t0).await);
    }
    let steady_records = steady.await.expect("the load task");
    let hostile = match hostile {
        Some(h) => Some(h.await.expect("the hostile task")),
        None => None,
    };
    let steady_s = steady_start.elapsed().as_secs_f64();
    let steady_count = steady_records.len();
    records.extend(steady_records);

    let (settled_s, pages) = cluster
        .settle(&scraper, Some(&baseline), &tol, settle_limit)
        .await;
    let exited = cluster.exited();
    let restarted: Vec<String> = kills.iter().map(|k| k.process.clone()).collect();

    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_kind: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut clients_saw: BTreeMap<String, u64> = BTreeMap::new();
    let mut unexpected = Vec::new();
    let mut hung_or_broken = 0;
    let mut errors_outside = 0;
    let mut client_errors = 0;
    for r in &records {
        *outcomes.entry(r.outcome.name().into()).or_default() += 1;
        let api = match r.api {
            Api::Chat => "chat",
            Api::Completions => "completions",
        };
        let shape = if r.stream { "stream" } else { "whole" };
        *by_kind
            .entry(format!("{api}/{shape}"))
            .or_default()
            .entry(r.outcome.name().into())
            .or_default() += 1;
        if r.status != 0 {
            *clients_saw
                .entry(format!("{api}/{}", r.status))
                .or_default() += 1;
        }
        let bad = match r.outcome {
            Outcome::Ok | Outcome::Dropped => false,
            Outcome::Broken | Outcome::Hung => {
                hung_or_broken += 1;
                true
            }
            Outcome::CleanError => {
                let client_error = (400..500).contains(&r.status);
                client_errors += usize::from(client_error);
                let expected = in_kill_window(&kills, r.ended_at_s, cfg.kill_grace_s);
                errors_outside += usize::from(!expected && !client_error);
                client_error || !expected
            }
        };
        if bad && unexpected.len() < 100 {
            unexpected.push(r.clone());
        }
    }
    for (k, n) in hostile.iter().flat_map(|h| h.router_saw()) {
        *clients_saw.entry(k).or_default() += n;
    }
    let router_after = pages.get("router").map(|p| router_requests(p.as_str()));
    let router_counted: BTreeMap<String, u64> = router_after
        .unwrap_or_default()
        .into_iter()
        .map(|(k, n)| {
            let before = router_before.get(&k).copied().unwrap_or(0);
            (k, n.saturating_sub(before))
        })
        .filter(|(_, n)| *n > 0)
        .collect();

    let mut processes = Vec::new();
    for p in &cluster.procs {
        let page = pages.get(&p.name);
        let end = page.and_then(|pg| Resources::from_page(pg.as_str()));
        let base = baseline.get(&p.name).copied();
        let exceeded = match (&base, &end) {
            (Some(b), Some(e)) => tol.exceeded(b, e),
            _ => vec!["no figures (the process did not answer /metrics)".into()],
        };
        processes.push(ProcessReport {
            name: p.name.clone(),
            kind: p.kind,
            addr: p.addr.clone(),
            restarted: restarted.contains(&p.name),
            baseline: base,
            end,
            busy_at_end: page.map_or(vec!["no answer".into()], |pg| busy(p.kind, pg)),
            exceeded,
        });
    }

    let dropped = outcomes.get("dropped").copied().unwrap_or(0);
    let ok = outcomes.get("ok").copied().unwrap_or(0);
    let mut checks = vec![
        check(
            "every request ended",
            hung_or_broken == 0,
            format!(
                "{} requests: {hung_or_broken} hung or broken",
                records.len()
            ),
        ),
        check(
            "errors only from the kills",
            errors_outside == 0 && client_errors == 0,
            format!(
                "{} clean errors, {errors_outside} outside a kill's window, {client_errors} 4xx",
                outcomes.get("clean_error").copied().unwrap_or(0)
            ),
        ),
        check(
            "requests served",
            ok > 0 && steady_count > 0,
            format!("{ok} finished"),
        ),
        check(
            "clients left mid-stream",
            dropped > 0 || cfg.drop_percent == 0.0,
            format!(
                "{dropped} of {} ({:.1}%)",
                records.len(),
                100.0 * dropped as f64 / records.len().max(1) as f64
            ),
        ),
        check(
            "the router counted every request",
            router_counted == clients_saw,
            format!("router {router_counted:?}, clients {clients_saw:?}"),
        ),
        check(
            "no process exited",
            exited.is_empty(),
            format!("exited: {exited:?}"),
        ),
        check(
            "settled after the warm-up",
            warmup_settled_s.is_some(),
            format!("within {:?}", settle_limit),
        ),
    ];
    for k in &kills {
        checks.push(check(
            &format!("{} killed and back", k.process),
            k.noticed_at_s.is_some() && k.back_at_s.is_some(),
            format!(
                "killed at {:.1} s, noticed {:?}, back {:?}",
                k.killed_at_s, k.noticed_at_s, k.back_at_s
            ),
        ));
    }
    let down = |at: f64| in_kill_window(&kills, at, cfg.kill_grace_s);
    for (name, passed, detail) in hostile.iter().flat_map(|h| h.checks(down)) {
        checks.push(check(&name, passed, detail));
    }
    if kills.len() < kills_planned.len() {
        checks.push(check("kills", false, "a planned kill did not happen"));
    }
    for p in &processes {
        checks.push(check(
            &format!("{} holds nothing", p.name),
            p.busy_at_end.is_empty(),
            if p.busy_at_end.is_empty() {
                p.kind.idle_gauges().join(", ") + " at 0"
            } else {
                p.busy_at_end.join(", ")
            },
        ));
        checks.push(check(
            &format!("{} back near its baseline", p.name),
            p.exceeded.is_empty(),
            if p.exceeded.is_empty() {
                "RSS, open fds, threads and tokio tasks within tolerance".into()
            } else {
                p.exceeded.join("; ")
            },
        ));
    }
    for p in processes.iter().filter(|p| p.restarted) {
        let served = pages.get(&p.name).and_then(|pg| match p.kind {
            Kind::Decode => metric(pg, "decode_requests_total", "{outcome=\"admitted\"}"),
            _ => metric(pg, "prefill_requests_total", "{outcome=\"completed\"}"),
        });
        checks.push(check(
            &format!("{} served after its restart", p.name),
            served.is_some_and(|n| n > 0.0),
            served.map_or("no answer".into(), |n| format!("{n} requests")),
        ));
    }
    let passed = checks.iter().all(|c| c.passed);
    Ok(SoakReport {
        duration_s: cfg.duration_s,
        warmup_s: cfg.warmup_s,
        clients: cfg.clients,
        drop_percent: cfg.drop_percent,
        model: cluster.model.display().to_string(),
        tolerance: tol,
        requests: records.len(),
        outcomes,
        by_kind,
        throughput_rps: steady_count as f64 / steady_s.max(f64::EPSILON),
        kills,
        warmup_settled_s,
        settled_s,
        processes,
        router_counted,
        clients_saw,
        unexpected,
        hostile,
        logs: e2e::scratch().display().to_string(),
        checks,
        passed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_count_as_the_kills_only_inside_their_windows() {
        let kills = [KillRecord {
            process: "decode0".into(),
            addr: String::new(),
            busy_at_kill: true,
            killed_at_s: 10.0,
            noticed_at_s: Some(10.5),
            restarted_at_s: 15.0,
            back_at_s: Some(16.0),
        }];
        assert!(!in_kill_window(&kills, 9.9, 5.0));
        assert!(in_kill_window(&kills, 10.0, 5.0));
        assert!(in_kill_window(&kills, 21.0, 5.0));
        assert!(!in_kill_window(&kills, 21.1, 5.0));
        let never_back = [KillRecord {
            back_at_s: None,
            ..kills[0].clone()
        }];
        assert!(in_kill_window(&never_back, 1000.0, 5.0));
    }

    #[test]
    fn kills_default_inside_the_run_and_can_be_turned_off() {
        use clap::Parser;
        let cfg = SoakConfig::try_parse_from(["soak", "--duration-s", "100"]).unwrap();
        let kills: Vec<(&str, f64)> = cfg.kills().iter().map(|(r, t)| (r.name(), *t)).collect();
        assert_eq!(kills, [("prefill", 30.0), ("decode", 60.0)]);
        let none = SoakConfig::try_parse_from(["soak", "--no-kills"]).unwrap();
        assert!(none.kills().is_empty());
    }
}
