//! A discovery-mode cluster: a real etcd, a router that learns its workers only from etcd,
//! and prefill and decode workers that a test adds, signals and stops while it runs.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use serde_json::Value;

use crate::{
    args, bin, free_port, metric, poll_until, scrape, try_get, try_scrape, wait_answer, Etcd, Proc,
};

/// The key prefix workers register under by default (`--etcd-prefix`).
pub const WORKER_PREFIX: &str = "/tandem/workers/";

/// How long a process may take to start serving.
const START_LIMIT: Duration = Duration::from_secs(60);

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    /// The role's name in registration keys, registrations and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    pub fn binary(self) -> &'static str {
        match self {
            Role::Prefill => "tandem-prefill",
            Role::Decode => "tandem-decode",
        }
    }
}

/// One worker process and the gRPC address it serves on (which also serves `/metrics`).
pub struct Worker {
    pub role: Role,
    pub addr: String,
    pub proc: Proc,
}

impl Worker {
    /// The etcd key this worker registers under (default prefix, advertised = listen
    /// address).
    pub fn key(&self) -> String {
        registration_key(self.role, &self.addr)
    }

    /// The worker's metrics page; panics if it does not answer.
    pub async fn metrics(&self) -> String {
        scrape(&self.addr).await
    }

    /// One sample of the worker's metrics (see [`metric`]); panics if it is absent.
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        let page = self.metrics().await;
        metric(&page, name, labels)
            .unwrap_or_else(|| panic!("{name}{labels} is missing on {}:\n{page}", self.addr))
    }
}

/// The key a worker of `role` serving at `addr` registers under (default prefix).
pub fn registration_key(role: Role, addr: &str) -> String {
    format!("{WORKER_PREFIX}{}/{addr}", role.name())
}

/// The router's count of `role` workers in `state` (`ready`, `unhealthy`, `open`,
/// `incompatible`, `draining`) on its metrics `page`.
pub fn workers_in(page: &str, role: Role, state: &str) -> Option<f64> {
    let labels = format!("{{role=\"{}\",state=\"{state}\"}}", role.name());
    metric(page, "router_workers", &labels)
}

/// An etcd, a router that finds its workers there, and the workers a test started.
pub struct Fleet {
    pub etcd: Etcd,
    /// The router's base URL, `http://127.0.0.1:<port>`.
    pub url: String,
    /// The router's operations listener (host:port): `/metrics` and `/health/*`.
    pub ops: String,
    pub router: Proc,
    pub prefill: Vec<Worker>,
    pub decode: Vec<Worker>,
    model: PathBuf,
    /// Names this fleet's log files apart from other tests'.
    tag: String,
}

impl Fleet {
    /// Starts etcd and a router with no static workers (`--etcd-endpoints` only, plus
    /// `router_args`), serving `model` as "test"; waits until the router is live.
    pub async fn start(model: &Path, router_args: &[&str]) -> Self {
        Self::start_on(Etcd::start().await, model, router_args).await
    }

    /// `start`, on an etcd already running.
    pub async fn start_on(etcd: Etcd, model: &Path, router_args: &[&str]) -> Self {
        let port = free_port();
        let tag = format!("fleet-{port}");
        let ops = format!("127.0.0.1:{}", free_port());
        let mut router_argv = args(&[
            "--model",
            &model.display().to_string(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            &ops,
            "--model-name",
            "test",
            "--etcd-endpoints",
            &etcd.endpoint(),
        ]);
        router_argv.extend(args(router_args));
        let router = Proc::spawn(
            &bin("tandem-router"),
            &router_argv,
            &format!("{tag}-router"),
        );
        let mut fleet = Self {
            etcd,
            url: format!("http://127.0.0.1:{port}"),
            ops,
            router,
            prefill: Vec::new(),
            decode: Vec::new(),
            model: model.to_path_buf(),
            tag,
        };
        let live = format!("{}/health", fleet.url);
        let answered = wait_answer(&mut fleet.router, &live, START_LIMIT, |s, _| s == 200).await;
        if let Err(why) = answered {
            panic!("the router is not live: {why}; logs:\n{}", fleet.logs());
        }
        fleet
    }

    /// Starts a prefill node that registers in etcd, with `extra` flags; its index in
    /// `prefill`. Nothing waits for it: wait on the router's view (`wait_workers`).
    pub fn add_prefill(&mut self, extra: &[&str]) -> usize {
        self.add(Role::Prefill, extra, true)
    }

    /// Starts a decode node that registers in etcd, with `extra` flags; its index in
    /// `decode`.
    pub fn add_decode(&mut self, extra: &[&str]) -> usize {
        self.add(Role::Decode, extra, true)
    }

    /// Starts a worker that knows no etcd, so that only what a test writes there can name
    /// it; waits until it serves. Its index in `prefill` or `decode`.
    pub async fn add_unregistered(&mut self, role: Role, extra: &[&str]) -> usize {
        let i = self.add(role, extra, false);
        let worker = &mut self.workers_mut(role)[i];
        let url = format!("http://{}/metrics", worker.addr);
        if let Err(why) = wait_answer(&mut worker.proc, &url, START_LIMIT, |s, _| s == 200).await {
            panic!(
                "the unregistered {} node does not serve: {why}; logs:\n{}",
                role.name(),
                self.logs()
            );
        }
        i
    }

    fn add(&mut self, role: Role, extra: &[&str], register: bool) -> usize {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut argv = args(&[
            "--model",
            &self.model.display().to_string(),
            "--listen",
            &addr,
        ]);
        if register {
            argv.extend(args(&["--etcd-endpoints", &self.etcd.endpoint()]));
        }
        argv.extend(args(extra));
        let i = self.workers(role).len();
        let tag = format!("{}-{}{i}", self.tag, role.name());
        let proc = Proc::spawn(&bin(role.binary()), &argv, &tag);
        self.workers_mut(role).push(Worker { role, addr, proc });
        i
    }

    /// The workers of `role` this fleet started, in order (stopped ones included).
    pub fn workers(&self, role: Role) -> &[Worker] {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    fn workers_mut(&mut self, role: Role) -> &mut Vec<Worker> {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        }
    }

    /// Sends SIGTERM to worker `i` of `role` and waits up to `limit` for it to exit; its
    /// exit status. Panics with the logs if it still runs.
    pub async fn terminate(&mut self, role: Role, i: usize, limit: Duration) -> ExitStatus {
        let worker = &mut self.workers_mut(role)[i];
        worker.proc.signal("TERM");
        match worker.proc.wait_exit(limit).await {
            Some(status) => status,
            None => panic!(
                "{} node {i} still runs {limit:?} after SIGTERM; logs:\n{}",
                role.name(),
                self.logs()
            ),
        }
    }

    /// The router's `/metrics` page.
    pub async fn router_metrics(&self) -> String {
        scrape(&self.ops).await
    }

    /// Polls the router's metrics until `holds` accepts the page; returns that page.
    /// Panics after `limit` with `what`, the last page and every log.
    pub async fn wait_router(
        &self,
        what: &str,
        limit: Duration,
        holds: impl Fn(&str) -> bool,
    ) -> String {
        let router = self.ops.as_str();
        let page = poll_until(limit, || async {
            let page = try_scrape(router).await?;
            holds(&page).then_some(page)
        })
        .await;
        if let Some(page) = page {
            return page;
        }
        let last = try_scrape(router).await;
        panic!(
            "the router did not get to {what} within {limit:?}; its metrics:\n{}\nlogs:\n{}",
            last.as_deref().unwrap_or("(no answer)"),
            self.logs()
        );
    }

    /// Waits until the router counts exactly `n` workers of `role` in `state`.
    pub async fn wait_workers(&self, role: Role, state: &str, n: usize, limit: Duration) {
        let what = format!("{n} {} workers {state}", role.name());
        self.wait_router(&what, limit, |page| {
            workers_in(page, role, state) == Some(n as f64)
        })
        .await;
    }

    /// `GET /health/ready`: its status and JSON body (Null when it is not JSON).
    pub async fn ready(&self) -> (u16, Value) {
        let url = format!("http://{}/health/ready", self.ops);
        let (status, body) = try_get(&url)
            .await
            .unwrap_or_else(|| panic!("{url} did not answer; logs:\n{}", self.logs()));
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// Polls `/health/ready` until it answers 200; panics with the logs after `limit`.
    pub async fn wait_ready(&self, limit: Duration) {
        let ready = poll_until(limit, || async {
            (self.ready().await.0 == 200).then_some(())
        })
        .await;
        if ready.is_none() {
            panic!(
                "the router is not ready after {limit:?}: {:?}; logs:\n{}",
                self.ready().await,
                self.logs()
            );
        }
    }

    /// The registration etcd holds for `worker`, parsed; `None` when there is none.
    pub fn registration(&self, worker: &Worker) -> Option<Value> {
        let key = worker.key();
        self.etcd
            .get_prefix(WORKER_PREFIX)
            .into_iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| {
                serde_json::from_str(&v)
                    .unwrap_or_else(|e| panic!("{key} holds no JSON ({e}): {v}"))
            })
    }

    /// Polls etcd until `worker`'s registration is there (`present`) or gone.
    pub async fn wait_registration(&self, worker: &Worker, present: bool, limit: Duration) {
        let found = poll_until(limit, || async {
            (self.registration(worker).is_some() == present).then_some(())
        })
        .await;
        if found.is_none() {
            panic!(
                "{} is {} etcd after {limit:?}: {:?}; logs:\n{}",
                worker.key(),
                if present { "not in" } else { "still in" },
                self.etcd.get_prefix(WORKER_PREFIX),
                self.logs()
            );
        }
    }

    /// Every log (router, workers, then etcd), for failure messages.
    pub fn logs(&self) -> String {
        let workers = self.prefill.iter().chain(&self.decode).map(|w| &w.proc);
        let procs: String = std::iter::once(&self.router)
            .chain(workers)
            .map(|p| {
                format!(
                    "== {}\n{}",
                    p.log.display(),
                    std::fs::read_to_string(&p.log).unwrap_or_default()
                )
            })
            .collect();
        procs + &self.etcd.logs()
    }

    /// POSTs JSON to the router's `path`; returns the status and the JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        crate::post(&format!("{}{path}", self.url), body).await
    }

    /// POSTs a streaming request to the router's `path`; returns the status and every SSE
    /// `data:` payload.
    pub async fn post_sse(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        crate::post_sse(&format!("{}{path}", self.url), body).await
    }
}
