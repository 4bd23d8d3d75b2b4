//! A cluster of the real binaries on free localhost ports: a router with one prefill and
//! one decode node (PD) or one colocated worker.

use super::*;
use crate::http::{read_json, send_with};

/// How a test cluster serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A router, one prefill node and one decode node.
    Pd,
    /// A router and one decode node acting as a colocated worker.
    Colocated,
}

/// A running cluster of real processes.
pub struct Cluster {
    pub url: String,
    /// The router's operations listener (host:port): `/metrics` and `/health/*`, over
    /// HTTPS when the API is.
    pub ops: String,
    pub model_name: String,
    pub procs: Vec<Proc>,
    /// The prefill node's address (host:port), in PD mode.
    pub prefill: Option<String>,
    /// The decode node's (or colocated worker's) address.
    pub decode: String,
    /// The client that speaks to the router (trusting its CA when it serves HTTPS).
    pub client: reqwest::Client,
}

impl Cluster {
    /// Starts a cluster for `model` and waits until the router reports ready.
    pub async fn start(mode: Mode, model: &Path, router_args: &[&str]) -> Self {
        Self::start_with(mode, model, router_args, &[]).await
    }

    /// `start`, with extra flags for the prefill node.
    pub async fn start_with(
        mode: Mode,
        model: &Path,
        router_args: &[&str],
        prefill_args: &[&str],
    ) -> Self {
        Self::start_full(mode, model, router_args, prefill_args, &[]).await
    }

    /// `start`, with extra flags for each process.
    pub async fn start_full(
        mode: Mode,
        model: &Path,
        router_args: &[&str],
        prefill_args: &[&str],
        decode_args: &[&str],
    ) -> Self {
        Self::launch(mode, model, router_args, prefill_args, decode_args, None).await
    }

    /// `start_full`, for a router that serves HTTPS with a certificate from `https_ca`.
    pub async fn launch(
        mode: Mode,
        model: &Path,
        router_args: &[&str],
        prefill_args: &[&str],
        decode_args: &[&str],
        https_ca: Option<&Path>,
    ) -> Self {
        let flags = [router_args, prefill_args, decode_args];
        Self::spawn_all(mode, model, flags, https_ca, &[]).await
    }

    /// `start`, with `env` set for every process.
    pub async fn launch_env(
        mode: Mode,
        model: &Path,
        router_args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn_all(mode, model, [router_args, &[], &[]], None, env).await
    }

    /// Starts the processes with `flags` for the router, prefill and decode node.
    async fn spawn_all(
        mode: Mode,
        model: &Path,
        flags: [&[&str]; 3],
        https_ca: Option<&Path>,
        env: &[(&str, &str)],
    ) -> Self {
        let [router_args, prefill_args, decode_args] = flags;
        let tag = format!("{:?}-{}", mode, free_port()).to_lowercase();
        let model_arg = model.display().to_string();
        let mut procs = Vec::new();
        let decode = format!("127.0.0.1:{}", free_port());
        let mut d_args = args(&["--model", &model_arg, "--listen", &decode]);
        d_args.extend(args(decode_args));
        procs.push(Proc::spawn_env(
            &bin("tandem-decode"),
            &d_args,
            &format!("{tag}-decode"),
            env,
        ));
        let mut prefill_addr = None;
        let mut router = args(&["--model", &model_arg, "--decode-nodes", &decode]);
        if mode == Mode::Pd {
            let prefill = format!("127.0.0.1:{}", free_port());
            let mut p_args = args(&[
                "--model",
                &model_arg,
                "--listen",
                &prefill,
                "--decode-nodes",
                &decode,
            ]);
            p_args.extend(args(prefill_args));
            procs.push(Proc::spawn_env(
                &bin("tandem-prefill"),
                &p_args,
                &format!("{tag}-prefill"),
                env,
            ));
            router.extend(args(&["--prefill-nodes", &prefill]));
            prefill_addr = Some(prefill);
        } else {
            router.extend(args(&["--mode", "colocated"]));
        }
        let port = free_port();
        let ops = format!("127.0.0.1:{}", free_port());
        router.extend(args(&[
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            &ops,
            "--model-name",
            "test",
        ]));
        router.extend(args(router_args));
        procs.push(Proc::spawn_env(
            &bin("tandem-router"),
            &router,
            &format!("{tag}-router"),
            env,
        ));
        let (scheme, client) = match https_ca {
            Some(ca) => ("https", pki::https_client(ca)),
            None => ("http", reqwest::Client::new()),
        };
        let mut cluster = Self {
            url: format!("{scheme}://127.0.0.1:{port}"),
            ops,
            client,
            model_name: "test".into(),
            procs,
            prefill: prefill_addr,
            decode,
        };
        cluster.wait_ready(Duration::from_secs(60)).await;
        cluster
    }

    /// Asserts that a small completion is served (after something hostile, `what`),
    /// with the cluster's logs on failure.
    pub async fn assert_serving(&self, what: &str) {
        let (status, v) = self
            .post(
                "/v1/completions",
                &serde_json::json!({"model": self.model_name, "prompt": "still serving", "max_tokens": 3}),
            )
            .await;
        assert_eq!(status, 200, "{what}: {v}\nlogs:\n{}", self.logs());
    }

    /// The operations listener's URL for `path`, in the API's scheme.
    pub fn ops_url(&self, path: &str) -> String {
        let scheme = self.url.split("://").next().unwrap_or("http");
        format!("{scheme}://{}{path}", self.ops)
    }

    /// Polls `/health/ready` until it answers 200; panics with the logs after `limit`.
    pub async fn wait_ready(&mut self, limit: Duration) {
        let client = self.client.clone();
        let deadline = Instant::now() + limit;
        loop {
            let ok = client
                .get(self.ops_url("/health/ready"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false);
            if ok {
                return;
            }
            let dead: Vec<String> = self
                .procs
                .iter_mut()
                .filter_map(|p| (!p.running()).then(|| p.log.display().to_string()))
                .collect();
            if !dead.is_empty() || Instant::now() > deadline {
                panic!(
                    "cluster not ready after {limit:?} (exited: {dead:?}); logs:\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every process's log, for failure messages.
    pub fn logs(&self) -> String {
        self.procs
            .iter()
            .map(|p| {
                format!(
                    "== {}\n{}",
                    p.log.display(),
                    std::fs::read_to_string(&p.log).unwrap_or_default()
                )
            })
            .collect()
    }

    /// The router's `/metrics` page, from its operations listener.
    pub async fn router_metrics(&self) -> String {
        self.client
            .get(self.ops_url("/metrics"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("scraping the router: {e}"))
            .text()
            .await
            .expect("a metrics page")
    }

    /// POSTs JSON to `path`; returns the status and the JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        read_json(send_with(&self.client, &format!("{}{path}", self.url), body).await).await
    }

    /// POSTs a streaming request; returns the status and every SSE `data:` payload.
    pub async fn post_sse(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        post_sse(&format!("{}{path}", self.url), body).await
    }
}

pub(crate) fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}
