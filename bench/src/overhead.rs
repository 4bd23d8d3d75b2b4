//! Router overhead (`router-overhead`): Tandem's router, sglang-router and vllm-router, each
//! in front of zero-compute backends it speaks to ([`crate::zero`]), driven by the same
//! closed-loop clients; next to the same clients talking to the zero-compute HTTP backend
//! directly. The router under test runs on its own core; its added latency is its latency
//! minus the direct one in the same round, and its CPU time per request (read from /proc)
//! says how many requests one core sustains.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use e2e::{free_port, Proc};
use serde::Serialize;
use serde_json::{json, Value};

use crate::stats::quantile;

/// The bench's settings.
#[derive(Debug, Clone, Parser)]
#[command(name = "router-overhead")]
pub struct OverheadConfig {
    /// Model folder whose tokenizer and KV layout the routers and zero-compute nodes use.
    #[arg(long)]
    pub model: PathBuf,
    /// The virtualenv of bench/install-peers.sh; peers missing from it are skipped and
    /// reported as such.
    #[arg(long, default_value = "~/.cache/tandem-peers")]
    pub peers_venv: String,
    /// Folder of the tandem-router and zero-worker binaries.
    #[arg(long, default_value = "target/release")]
    pub bin_dir: PathBuf,
    /// Seconds of load per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub duration_s: f64,
    /// Closed-loop client counts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub concurrency: Vec<usize>,
    /// Rounds; each round measures every setup once, in the same order.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 16)]
    pub tokens: usize,
    /// The core the router under test is pinned to (`taskset -c`); run this binary, and so
    /// the clients and backends it starts, on the other ones.
    #[arg(long, default_value = "0")]
    pub router_core: String,
    /// Setups to run, comma separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One router (or none) with its backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Setup {
    /// Clients to the zero-compute HTTP backend, no router.
    Direct,
    /// Tandem's router in PD mode, a zero prefill node and a zero decode node.
    TandemPd,
    /// Tandem's router in colocated mode, one zero decode node.
    TandemColocated,
    /// sglang-router in front of one backend (round robin).
    Sglang,
    /// sglang-router's PD mode, the backend as prefill and as decode server.
    SglangPd,
    /// vllm-router in front of one backend (round robin).
    Vllm,
    /// vllm-router's PD mode, the backend as prefill and as decode server.
    VllmPd,
}

impl Setup {
    const ALL: [Setup; 7] = [
        Setup::Direct,
        Setup::TandemPd,
        Setup::TandemColocated,
        Setup::Sglang,
        Setup::SglangPd,
        Setup::Vllm,
        Setup::VllmPd,
    ];

    fn name(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::TandemPd => "tandem-pd",
            Setup::TandemColocated => "tandem-colocated",
            Setup::Sglang => "sglang",
            Setup::SglangPd => "sglang-pd",
            Setup::Vllm => "vllm",
            Setup::VllmPd => "vllm-pd",
        }
    }
}

/// One measurement: a setup at one client count, unary or streamed.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub round: usize,
    pub setup: Setup,
    pub stream: bool,
    pub concurrency: usize,
    pub requests: usize,
    pub errors: usize,
    pub requests_per_s: f64,
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
    /// CPU time of the router's processes per request; absent without a router.
    pub router_cpu_us_per_request: Option<f64>,
}

/// Why the bench could not run (a slow or failing router is a row, not an error).
#[derive(Debug, thiserror::Error)]
pub enum OverheadError {
    #[error("{setup} not serving after {limit:?} (last answer: {last}); logs: {logs}")]
    NotServing {
        setup: &'static str,
        limit: Duration,
        last: String,
        logs: String,
    },
}

type Result<T> = std::result::Result<T, OverheadError>;

/// Starts `program` with `args` (pinned to `core` when given), logging at WARN so that
/// logging costs every setup the same little.
fn spawn(program: &Path, args: &[String], core: Option<&str>, tag: &str) -> Proc {
    let mut cmd = match core {
        Some(core) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(core).arg(program);
            c
        }
        None => Command::new(program),
    };
    cmd.args(args).env("RUST_LOG", "warn");
    Proc::start(cmd, tag)
}

/// User plus system CPU seconds of `pid` and every process below it.
fn tree_cpu_s(pid: u32) -> f64 {
    let mut stats = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(s) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            // The command name may hold spaces; the fields after it do not.
            let Some(rest) = s.rfind(')').map(|i| &s[i + 2..]) else {
                continue;
            };
            let f: Vec<&str> = rest.split(' ').collect();
            let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            // After the name: state, ppid (1), ..., utime (11), stime (12).
            stats.push((p, field(1) as u32, field(11) + field(12)));
        }
    }
    let mut tree = vec![pid];
    let mut ticks = 0;
    let mut grew = true;
    while grew {
        grew = false;
        for &(p, ppid, _) in &stats {
            if tree.contains(&ppid) && !tree.contains(&p) {
                tree.push(p);
                grew = true;
            }
        }
    }
    for &(p, _, t) in &stats {
        if tree.contains(&p) {
            ticks += t;
        }
    }
    // Linux reports these in USER_HZ, 100 on every architecture it runs on here.
    ticks as f64 / 100.0
}

/// The processes of one setup and the URL its clients use.
struct Running {
    url: String,
    router: Option<u32>,
    procs: Vec<Proc>,
}

fn expand(path: &str) -> PathBuf {
    match path.strip_prefix("~/") {
        Some(rest) => PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(rest),
        None => PathBuf::from(path),
    }
}

/// Why `setup` cannot run here, if it cannot.
pub fn missing(cfg: &OverheadConfig, setup: Setup) -> Option<String> {
    let venv = expand(&cfg.peers_venv);
    let found = match setup {
        Setup::Sglang | Setup::SglangPd => Command::new(venv.join("bin/python"))
            .args(["-c", "import sglang_router"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
        Setup::Vllm | Setup::VllmPd => venv.join("bin/vllm-router").exists(),
        _ => true,
    };
    (!found).then(|| {
        format!(
            "not installed in {} (bench/install-peers.sh)",
            venv.display()
        )
    })
}

async fn start(cfg: &OverheadConfig, setup: Setup, round: usize) -> Result<Running> {
    let tag = |what: &str| format!("overhead-{}-{what}-r{round}", setup.name());
    let model = cfg.model.display().to_string();
    let zero = cfg.bin_dir.join("zero-worker");
    let mut procs = Vec::new();
    let backend = |role: &str, name: &str, procs: &mut Vec<Proc>| -> String {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args = vec![
            "--listen".into(),
            addr.clone(),
            "--model".into(),
            model.clone(),
            role.into(),
        ];
        if role == "openai" {
            args.extend([
                "--tokens".into(),
                cfg.tokens.to_string(),
                "--model-name".into(),
                "zero".into(),
            ]);
        }
        procs.push(spawn(&zero, &args, None, &tag(name)));
        addr
    };
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let venv = expand(&cfg.peers_venv);
    let core = Some(cfg.router_core.as_str());
    let router = match setup {
        Setup::Direct => {
            let addr = backend("openai", "openai", &mut procs);
            return ready(
                cfg,
                setup,
                Running {
                    url: format!("http://{addr}"),
                    router: None,
                    procs,
                },
            )
            .await;
        }
        Setup::TandemPd | Setup::TandemColocated => {
            let d = backend("decode", "decode", &mut procs);
            let mut args = vec![
                "--model".into(),
                model.clone(),
                "--model-name".into(),
                "zero".into(),
                "--listen".into(),
                listen,
                // A port of its own, so that it never meets another router's.
                "--metrics-listen".into(),
                format!("127.0.0.1:{}", free_port()),
                "--decode-nodes".into(),
                d,
            ];
            if setup == Setup::TandemPd {
                let p = backend("prefill", "prefill", &mut procs);
                args.extend(["--mode".into(), "pd".into(), "--prefill-nodes".into(), p]);
            } else {
                args.extend(["--mode".into(), "colocated".into()]);
            }
            spawn(
                &cfg.bin_dir.join("tandem-router"),
                &args,
                core,
                &tag("router"),
            )
        }
        Setup::Sglang | Setup::SglangPd | Setup::Vllm | Setup::VllmPd => {
            let mut url = |name: &str| -> String {
                format!("http://{}", backend("openai", name, &mut procs))
            };
            let port = port.to_string();
            let (program, mut args): (PathBuf, Vec<String>) = match setup {
                Setup::Sglang | Setup::SglangPd => (
                    venv.join("bin/python"),
                    vec![
                        "-m".into(),
                        "sglang_router.launch_router".into(),
                        "--log-level".into(),
                        "warn".into(),
                    ],
                ),
                _ => (
                    venv.join("bin/vllm-router"),
                    vec!["--log-level".into(), "warning".into()],
                ),
            };
            args.extend(
                [
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &port,
                    "--policy",
                    "round_robin",
                ]
                .map(String::from),
            );
            // The PD modes refuse one server as both prefill and decode: two backends.
            match setup {
                Setup::SglangPd => args.extend([
                    "--pd-disaggregation".into(),
                    "--prefill".into(),
                    url("openai-prefill"),
                    "none".into(),
                    "--decode".into(),
                    url("openai-decode"),
                ]),
                Setup::VllmPd => args.extend([
                    "--vllm-pd-disaggregation".into(),
                    "--prefill".into(),
                    url("openai-prefill"),
                    "--decode".into(),
                    url("openai-decode"),
                ]),
                _ => args.extend(["--worker-urls".into(), url("openai")]),
            }
            spawn(&program, &args, core, &tag("router"))
        }
    };
    let pid = router.pid();
    procs.push(router);
    ready(
        cfg,
        setup,
        Running {
            url: format!("http://127.0.0.1:{port}"),
            router: Some(pid),
            procs,
        },
    )
    .await
}

/// Waits (bounded) until one request through the setup succeeds.
async fn ready(cfg: &OverheadConfig, setup: Setup, running: Running) -> Result<Running> {
    let client = reqwest::Client::new();
    let limit = Duration::from_secs(60);
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < limit {
        match once(&client, &running.url, &body(cfg, false)).await {
            Ok(()) => return Ok(running),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs: Vec<String> = running
        .procs
        .iter()
        .map(|p| p.log.display().to_string())
        .collect();
    Err(OverheadError::NotServing {
        setup: setup.name(),
        limit,
        last,
        logs: logs.join(", "),
    })
}

fn body(cfg: &OverheadConfig, stream: bool) -> Value {
    json!({"model": "zero", "stream": stream, "max_tokens": cfg.tokens,
           "messages": [{"role": "user", "content": "Say hello to the router benchmark."}]})
}

/// One request, read to its end; an error says what was wrong with the answer.
async fn once(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> std::result::Result<(), String> {
    let stream = body["stream"].as_bool() == Some(true);
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let bytes = r.bytes().await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&bytes);
    if !status.is_success() {
        return Err(format!("{status}: {text}"));
    }
    // Every setup's backend ends each answer on the token budget.
    let finished = text.contains(r#""finish_reason":"length""#);
    let complete = finished && (!stream || text.trim_end().ends_with("data: [DONE]"));
    complete
        .then_some(())
        .ok_or_else(|| format!("incomplete answer: {text}"))
}

async fn measure(
    cfg: &OverheadConfig,
    running: &Running,
    round: usize,
    setup: Setup,
    stream: bool,
    concurrency: usize,
) -> Row {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .expect("an HTTP client");
    let body = body(cfg, stream);
    // Open and warm every client's connection before the clock starts.
    for _ in 0..3 {
        let warm: Vec<_> = (0..concurrency)
            .map(|_| {
                let (client, url, body) = (client.clone(), running.url.clone(), body.clone());
                tokio::spawn(async move { once(&client, &url, &body).await })
            })
            .collect();
        for w in warm {
            let _ = w.await;
        }
    }
    let cpu0 = running.router.map(tree_cpu_s);
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.duration_s);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, body) = (client.clone(), running.url.clone(), body.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut errors = 0;
                while Instant::now() < deadline {
                    let t = Instant::now();
                    match once(&client, &url, &body).await {
                        Ok(()) => lat.push(t.elapsed().as_secs_f64() * 1e6),
                        Err(_) => errors += 1,
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.expect("a client task");
        lat.extend(l);
        errors += e;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = running
        .router
        .zip(cpu0)
        .map(|(pid, c0)| tree_cpu_s(pid) - c0);
    let done = lat.len();
    Row {
        round,
        setup,
        stream,
        concurrency,
        requests: done,
        errors,
        requests_per_s: done as f64 / wall,
        latency_p50_us: quantile(&lat, 0.5),
        latency_p99_us: quantile(&lat, 0.99),
        router_cpu_us_per_request: cpu.map(|c| c * 1e6 / (done + errors).max(1) as f64),
    }
}

/// What the run found: every measurement, and the setups that could not run and why.
#[derive(Debug, Serialize)]
pub struct Report {
    pub rows: Vec<Row>,
    pub skipped: Vec<(Setup, String)>,
}

/// Runs every setup `cfg.rounds` times.
pub async fn run(cfg: &OverheadConfig) -> Result<Report> {
    let mut setups = Vec::new();
    let mut skipped = Vec::new();
    for s in Setup::ALL {
        if !cfg.only.is_empty() && !cfg.only.iter().any(|o| o == s.name()) {
            continue;
        }
        match missing(cfg, s) {
            Some(why) => skipped.push((s, why)),
            None => setups.push(s),
        }
    }
    let mut rows = Vec::new();
    for round in 1..=cfg.rounds {
        for &setup in &setups {
            let running = start(cfg, setup, round).await?;
            for stream in [false, true] {
                for &c in &cfg.concurrency {
                    let row = measure(cfg, &running, round, setup, stream, c).await;
                    eprintln!(
                        "round {round} {:<17} stream={stream:<5} c={c:<3} {:>8.0} req/s p50 {:>7.0} us p99 {:>7.0} us cpu/req {} errors {}",
                        setup.name(), row.requests_per_s, row.latency_p50_us, row.latency_p99_us,
                        row.router_cpu_us_per_request.map_or("-".into(), |c| format!("{c:.0} us")),
                        row.errors
                    );
                    rows.push(row);
                }
            }
        }
    }
    Ok(Report { rows, skipped })
}

impl Report {
    /// A markdown table per round: latency added over the direct clients at the same
    /// round, streaming and client count; requests/s; router CPU per request.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| round | setup | stream | clients | req/s | p50 µs | p99 µs | added p50 µs | added p99 µs | router CPU µs/req | errors |\n\
             | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for r in &self.rows {
            let direct = self.rows.iter().find(|d| {
                d.setup == Setup::Direct
                    && d.round == r.round
                    && d.stream == r.stream
                    && d.concurrency == r.concurrency
            });
            let added = |f: fn(&Row) -> f64| match direct {
                Some(d) if r.setup != Setup::Direct => format!("{:.0}", f(r) - f(d)),
                _ => "-".into(),
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} |\n",
                r.round,
                r.setup.name(),
                if r.stream { "yes" } else { "no" },
                r.concurrency,
                r.requests_per_s,
                r.latency_p50_us,
                r.latency_p99_us,
                added(|x| x.latency_p50_us),
                added(|x| x.latency_p99_us),
                r.router_cpu_us_per_request
                    .map_or("-".into(), |c| format!("{c:.0}")),
                r.errors
            ));
        }
        for (s, why) in &self.skipped {
            out.push_str(&format!("\n{}: not run: {why}\n", s.name()));
        }
        out
    }
}
