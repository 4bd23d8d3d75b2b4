//! The processes of a soak run: started, killed and restarted here, or given.

use super::*;

/// The processes of the run: started here (and then killed and restarted), or given.
pub(super) struct Cluster {
    pub(super) fleet: Option<Fleet>,
    pub(super) model: PathBuf,
    pub(super) url: String,
    /// The router's operations listener (host:port): its `/metrics`.
    pub(super) ops: String,
    pub(super) model_name: String,
    pub(super) procs: Vec<Tracked>,
    /// Flags every prefill node started here gets, restarts included.
    pub(super) prefill_args: Vec<String>,
}

/// How long a started or restarted process may take to serve.
pub(super) const START_LIMIT: Duration = Duration::from_secs(60);
/// How often the cluster is polled while it settles or recovers.
pub(super) const POLL: Duration = Duration::from_millis(250);
/// How long a kill waits for its node to hold work, and how often it looks.
pub(super) const BUSY_LIMIT: Duration = Duration::from_secs(10);
pub(super) const BUSY_POLL: Duration = Duration::from_millis(5);

impl Cluster {
    pub(super) async fn start(
        cfg: &SoakConfig,
        scraper: &reqwest::Client,
    ) -> Result<Self, SoakError> {
        let model = cfg.model.clone().unwrap_or_else(e2e::tiny_model);
        if let Some(url) = &cfg.url {
            let url = url.trim_end_matches('/').to_string();
            let ops = cfg
                .router_metrics
                .clone()
                .ok_or_else(|| SoakError::Config("--url needs --router-metrics".into()))?;
            let mut procs = vec![Tracked {
                name: "router".into(),
                kind: Kind::Router,
                addr: ops.clone(),
            }];
            for addr in &cfg.workers {
                let page = scrape(scraper, addr)
                    .await
                    .ok_or_else(|| SoakError::Unreachable(addr.clone()))?;
                let kind =
                    Kind::of_worker(&page).ok_or_else(|| SoakError::UnknownRole(addr.clone()))?;
                let n = procs.iter().filter(|p| p.kind == kind).count();
                let role = if kind == Kind::Prefill {
                    "prefill"
                } else {
                    "decode"
                };
                procs.push(Tracked {
                    name: format!("{role}{n}"),
                    kind,
                    addr: addr.clone(),
                });
            }
            return Ok(Self {
                fleet: None,
                model,
                url,
                ops,
                model_name: cfg.model_name.clone(),
                procs,
                prefill_args: Vec::new(),
            });
        }
        let mut fleet = Fleet::start(&model, &[]).await;
        let prefill_args = vec![
            "--prefix-cache-mb".to_string(),
            cfg.prefix_cache_mb.to_string(),
        ];
        let prefill_flags: Vec<&str> = prefill_args.iter().map(String::as_str).collect();
        for _ in 0..2 {
            fleet.add_prefill(&prefill_flags);
            fleet.add_decode(&[]);
        }
        fleet
            .wait_workers(Role::Prefill, "ready", 2, START_LIMIT)
            .await;
        fleet
            .wait_workers(Role::Decode, "ready", 2, START_LIMIT)
            .await;
        fleet.wait_ready(START_LIMIT).await;
        let mut procs = vec![Tracked {
            name: "router".into(),
            kind: Kind::Router,
            addr: fleet.ops.clone(),
        }];
        for (role, kind) in [(Role::Prefill, Kind::Prefill), (Role::Decode, Kind::Decode)] {
            for (i, w) in fleet.workers(role).iter().enumerate() {
                procs.push(Tracked {
                    name: format!("{}{i}", role.name()),
                    kind,
                    addr: w.addr.clone(),
                });
            }
        }
        Ok(Self {
            url: fleet.url.clone(),
            ops: fleet.ops.clone(),
            fleet: Some(fleet),
            model,
            model_name: "test".into(),
            procs,
            prefill_args,
        })
    }

    pub(super) fn router_addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }

    /// Every process's metrics page now, by name (absent when it did not answer).
    pub(super) async fn pages(&self, scraper: &reqwest::Client) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for p in &self.procs {
            if let Some(page) = scrape(scraper, &p.addr).await {
                out.insert(p.name.clone(), page);
            }
        }
        out
    }

    /// Polls until no process holds a request and, with a baseline, every process's figures
    /// are within `tol` of it, for at most `limit`; the seconds it took (`None` when time ran
    /// out) and the last pages.
    pub(super) async fn settle(
        &self,
        scraper: &reqwest::Client,
        baseline: Option<&BTreeMap<String, Resources>>,
        tol: &Tolerance,
        limit: Duration,
    ) -> (Option<f64>, BTreeMap<String, String>) {
        let start = Instant::now();
        loop {
            let pages = self.pages(scraper).await;
            let settled = self.procs.iter().all(|p| {
                let Some(page) = pages.get(&p.name) else {
                    return false;
                };
                let within = baseline.is_none_or(|b| {
                    b.get(&p.name)
                        .zip(Resources::from_page(page))
                        .is_some_and(|(base, now)| tol.exceeded(base, &now).is_empty())
                });
                busy(p.kind, page).is_empty() && within
            });
            if settled {
                return (Some(start.elapsed().as_secs_f64()), pages);
            }
            if start.elapsed() >= limit {
                return (None, pages);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The router's count of ready workers of `role`; `None` when it does not answer.
    pub(super) async fn ready_workers(&self, scraper: &reqwest::Client, role: Role) -> Option<f64> {
        let page = scrape(scraper, &self.ops).await?;
        workers_in(&page, role, "ready")
    }

    /// Polls the router until `holds` accepts its count of ready `role` workers, for at
    /// most `limit`; whether it did.
    pub(super) async fn wait_ready_count(
        &self,
        scraper: &reqwest::Client,
        role: Role,
        limit: Duration,
        holds: impl Fn(f64) -> bool,
    ) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.ready_workers(scraper, role).await.is_some_and(&holds) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Kills worker 0 of `role` with SIGKILL, waits `down`, starts it again on its
    /// address, and waits for the router to route to it again.
    pub(super) async fn kill_and_restart(
        &mut self,
        scraper: &reqwest::Client,
        role: Role,
        down: Duration,
        t0: Instant,
    ) -> KillRecord {
        let fleet = self
            .fleet
            .as_ref()
            .expect("kills need a cluster started here");
        let etcd = fleet.etcd.endpoint();
        let addr = fleet.workers(role)[0].addr.clone();
        // Killed while it holds work, when that shows within a few seconds: a kill between
        // two requests would test less.
        let gauge = match role {
            Role::Prefill => "prefill_running_prompts",
            Role::Decode => "decode_running_sequences",
        };
        let busy_deadline = Instant::now() + BUSY_LIMIT;
        let busy_at_kill = loop {
            let page = scrape(scraper, &addr).await;
            if page.is_some_and(|p| metric(&p, gauge, "").is_some_and(|n| n > 0.0)) {
                break true;
            }
            if Instant::now() >= busy_deadline {
                break false;
            }
            tokio::time::sleep(BUSY_POLL).await;
        };
        let fleet = self
            .fleet
            .as_mut()
            .expect("kills need a cluster started here");
        // Stamped before the signal: requests fail as soon as it lands, while `kill` still
        // waits to reap the process.
        let killed = Instant::now();
        let killed_at_s = t0.elapsed().as_secs_f64();
        fleet.workers_mut_of(role)[0].proc.kill();
        let noticed = self
            .wait_ready_count(scraper, role, down.max(Duration::from_secs(30)), |n| {
                n < 2.0
            })
            .await;
        let noticed_at_s = noticed.then(|| t0.elapsed().as_secs_f64());
        tokio::time::sleep((killed + down).saturating_duration_since(Instant::now())).await;
        let restarted_at_s = t0.elapsed().as_secs_f64();
        let model = self.model.display().to_string();
        let mut argv: Vec<String> = [
            "--model",
            &model,
            "--listen",
            &addr,
            "--etcd-endpoints",
            &etcd,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if role == Role::Prefill {
            argv.extend(self.prefill_args.iter().cloned());
        }
        let binary = match role {
            Role::Prefill => "tandem-prefill",
            Role::Decode => "tandem-decode",
        };
        let tag = format!("soak-{}0-restarted-{}", role.name(), e2e::free_port());
        let proc = Proc::spawn(&e2e::bin(binary), &argv, &tag);
        let fleet = self
            .fleet
            .as_mut()
            .expect("kills need a cluster started here");
        fleet.workers_mut_of(role)[0] = Worker {
            role,
            addr: addr.clone(),
            proc,
        };
        let back = self
            .wait_ready_count(scraper, role, START_LIMIT, |n| n >= 2.0)
            .await;
        KillRecord {
            process: format!("{}0", role.name()),
            addr,
            busy_at_kill,
            killed_at_s,
            noticed_at_s,
            restarted_at_s,
            back_at_s: back.then(|| t0.elapsed().as_secs_f64()),
        }
    }

    /// The processes started here that are no longer running, by name.
    pub(super) fn exited(&mut self) -> Vec<String> {
        let Some(fleet) = self.fleet.as_mut() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if !fleet.router.running() {
            out.push("router".to_string());
        }
        for role in [Role::Prefill, Role::Decode] {
            for (i, w) in fleet.workers_mut_of(role).iter_mut().enumerate() {
                if !w.proc.running() {
                    out.push(format!("{}{i}", role.name()));
                }
            }
        }
        out
    }
}

/// The workers of one role, to replace a killed one.
trait WorkersOf {
    fn workers_mut_of(&mut self, role: Role) -> &mut Vec<Worker>;
}

impl WorkersOf for Fleet {
    fn workers_mut_of(&mut self, role: Role) -> &mut Vec<Worker> {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        }
    }
}

/// `GET http://{addr}/metrics`, bounded; `None` when it does not answer 200.
pub(super) async fn scrape(client: &reqwest::Client, addr: &str) -> Option<String> {
    let resp = client
        .get(format!("http://{addr}/metrics"))
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .ok()?;
    if resp.status() != 200 {
        return None;
    }
    resp.text().await.ok()
}

/// `router_requests_total` on a router page, by `endpoint/status`.
pub(super) fn router_requests(page: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("router_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\""))
                .map(|v| v.trim_end_matches('"').to_string())
        };
        if let (Some(endpoint), Some(status), Ok(n)) = (
            label("endpoint"),
            label("status"),
            value.trim().parse::<f64>(),
        ) {
            out.insert(format!("{endpoint}/{status}"), n as u64);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_counts_are_read_by_endpoint_and_status() {
        let page = "# TYPE router_requests_total counter\n\
            router_requests_total{endpoint=\"chat\",status=\"200\"} 12\n\
            router_requests_total{endpoint=\"completions\",status=\"502\"} 1\n\
            router_requests_in_flight 0\n";
        let counts = router_requests(page);
        assert_eq!(counts.get("chat/200"), Some(&12));
        assert_eq!(counts.get("completions/502"), Some(&1));
        assert_eq!(counts.len(), 2);
    }
}
