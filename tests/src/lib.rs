//! Harness for the end-to-end tests: starts the real binaries on free localhost ports,
//! waits for readiness by polling (bounded), and kills every child on drop.
//!
//! Cargo does not hand one package another package's binaries, so the harness looks in
//! `target/release` (or `$E2E_BIN_DIR`) after `cargo build --release --workspace`.

mod cluster;
mod etcd;
mod fleet;
mod http;
pub mod hub;
pub mod kube;
pub mod kv;
pub mod otlp;
pub mod pki;

use cluster::args;
pub use cluster::{Cluster, Mode};
pub use etcd::{Etcd, EtcdSecurity};
pub use fleet::{registration_key, workers_in, Fleet, Role, Worker, WORKER_PREFIX};
pub use http::{chat_stream_content, post, post_sse, post_then_leave, sse_chunks, SseStream};

use std::fs::File;
use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .to_path_buf()
}

/// The folder holding the built binaries.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("E2E_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/release"))
}

/// A built binary; panics with the command that builds it when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --release --workspace` first (or set E2E_BIN_DIR)",
        p.display()
    );
    p
}

/// Where fetched models live: `$TANDEM_MODELS`, or `models/` at the repository root.
pub fn models_dir() -> PathBuf {
    std::env::var_os("TANDEM_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("models"))
}

/// The bundled SmolLM2 GGUF (fetched by `scripts/fetch-models.sh`).
pub fn smollm2() -> PathBuf {
    let p = models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

/// Each token of `ids` after the first scored as the engine run directly scores it (one
/// pass over them all), with `top` alternatives: what echo's prompt logprobs must equal.
pub fn scored_directly(loaded: &engine::Loaded, ids: &[u32], top: usize) -> Vec<engine::Sampled> {
    let mut cache = loaded.model.new_cache().expect("a cache");
    let (_, every) = loaded
        .model
        .forward_rows(
            &mut [engine::SeqInput {
                tokens: ids,
                cache: &mut cache,
            }],
            &mut |_, _| Ok(()),
            &[true],
        )
        .expect("the forward pass");
    let rows: Vec<Vec<f32>> = every[0]
        .as_ref()
        .expect("the rows asked for")
        .to_vec2()
        .expect("f32 logits");
    engine::sampling::scored(&rows[..ids.len() - 1], &ids[1..], top)
}

/// The generated tiny model, written once per test binary.
pub fn tiny_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch().join("tiny-model");
        engine::testmodel::write_model(
            &dir,
            engine::testmodel::ModelSize::Tiny,
            candle_core::DType::F32,
            engine::testmodel::DEFAULT_SEED,
        )
        .expect("writing the tiny model");
        dir
    })
    .clone()
}

/// The generated tiny model turned `family`, written once per test binary.
pub fn tiny_model_turned(family: engine::testmodel::Family) -> PathBuf {
    type Dirs = Vec<(engine::testmodel::Family, PathBuf)>;
    static DIRS: std::sync::Mutex<Dirs> = std::sync::Mutex::new(Vec::new());
    let mut dirs = DIRS.lock().expect("no test panics while holding the list");
    if let Some((_, dir)) = dirs.iter().find(|(f, _)| *f == family) {
        return dir.clone();
    }
    let dir = scratch().join(format!("tiny-{}", family.name()));
    let seed = engine::testmodel::DEFAULT_SEED;
    engine::testmodel::write_model(
        &dir,
        engine::testmodel::ModelSize::Tiny,
        candle_core::DType::F32,
        seed,
    )
    .expect("writing the tiny model");
    family.turn(&dir, seed).expect("turning the tiny model");
    dirs.push((family, dir.clone()));
    dir
}

/// A folder for this test process's files (models, logs).
pub fn scratch() -> PathBuf {
    let dir = root()
        .join("target/e2e")
        .join(format!("run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the scratch folder");
    dir
}

/// A port nothing listens on at the moment of the call, and that no other call in this
/// process has returned. A port the kernel picked for `bind(0)` could be picked again for
/// another test's listener before the node meant to take it starts (CI once saw a decode
/// node fail with "Address already in use"), so ports come from below the kernel's
/// ephemeral range (32768 and up on Linux), where it never picks; a counter keeps this
/// process's tests apart, and a start drawn from the process id keeps test processes apart.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    const SPAN: u32 = 22_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(7919) % SPAN;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(
            n < SPAN,
            "every test port below the ephemeral range was handed out"
        );
        let port = (LOW + (start + n) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A child process killed (and reaped) on drop; its output goes to a log file.
pub struct Proc {
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `bin` with `args`, logging to `<scratch>/<tag>.log`.
    pub fn spawn(bin: &Path, args: &[String], tag: &str) -> Self {
        Self::spawn_env(bin, args, tag, &[])
    }

    /// `spawn`, with `env` added to the environment.
    pub fn spawn_env(bin: &Path, args: &[String], tag: &str, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(bin);
        // Refused TLS handshakes are logged one by one at debug (a warning a minute sums
        // them up): the tests read each one's reason.
        cmd.args(args).env("RUST_LOG", "info,tls=debug");
        cmd.envs(env.iter().copied());
        Self::start(cmd, tag)
    }

    /// Starts `cmd` as it is set up (program, arguments, environment), logging to
    /// `<scratch>/<tag>.log`.
    pub fn start(mut cmd: Command, tag: &str) -> Self {
        let log = scratch().join(format!("{tag}.log"));
        let out = File::create(&log).expect("creating a log file");
        let child = cmd
            .stdout(out.try_clone().expect("log handle"))
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {:?}: {e}", cmd.get_program()));
        Self { child, log }
    }

    /// True while the process runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the process now (SIGKILL, which also ends a stopped process).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory now (`rss`) and at its peak so far (`peak`), in bytes, from
    /// `/proc/<pid>/status` (VmRSS and VmHWM).
    pub fn memory(&self) -> Memory {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_else(|e| panic!("reading the status of {}: {e}", self.pid()));
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} in the status of {}", self.pid()))
                * 1024
        };
        Memory {
            rss: field("VmRSS:"),
            peak: field("VmHWM:"),
        }
    }

    /// Starts the process's peak resident memory afresh from what it holds now (writes 5
    /// to `/proc/<pid>/clear_refs`), so that a later [`memory`](Self::memory)'s `peak`
    /// covers only what came after.
    pub fn reset_peak_memory(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5")
            .unwrap_or_else(|e| panic!("resetting the peak memory of {}: {e}", self.pid()));
    }

    /// Sends signal `sig` ("TERM", "STOP", "CONT", "KILL", ...) with `kill(1)`; panics if
    /// it cannot be delivered (the process is gone).
    pub fn signal(&self, sig: &str) {
        let pid = self.pid();
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .unwrap_or_else(|e| panic!("running kill -{sig} {pid}: {e}"));
        assert!(
            status.success(),
            "kill -{sig} {pid} failed ({status}); log {}",
            self.log.display()
        );
    }

    /// Waits up to `limit` for the process to exit; its status, or `None` if it still
    /// runs.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        poll_until(limit, || {
            std::future::ready(self.child.try_wait().ok().flatten())
        })
        .await
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A process's resident memory, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub rss: u64,
    pub peak: u64,
}

/// The JSON schema of a person (a bounded string, a bounded integer and an enum), which the
/// structured-output tests hold SmolLM2 to and `mask-bench` masks with.
pub fn person_schema() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]}
        },
        "required": ["name", "age", "role"],
        "additionalProperties": false
    })
}

/// Every example request body in the API documents, with the document it is from
/// (`tests/fixtures/seed_requests.json`, written by `scripts/extract-seed-requests.py`).
pub fn seed_requests() -> Vec<(String, Value)> {
    let path = root().join("tests/fixtures/seed_requests.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let all: Vec<Value> = serde_json::from_str(&text).expect("the fixture is JSON");
    all.into_iter()
        .map(|r| {
            (
                r["document"].as_str().unwrap().to_string(),
                r["body"].clone(),
            )
        })
        .collect()
}

/// A program of the Python environment the tests use (`openai`, `lm-eval`): under
/// `$E2E_VENV`, else the repository's `.venv` (`.ci/run` makes it).
pub fn venv_bin(name: &str) -> PathBuf {
    let venv = std::env::var_os("E2E_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv"));
    let path = venv.join("bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: `python3 -m venv .venv && .venv/bin/pip install -r tests/python/requirements.txt` (.ci/run does this)",
        path.display()
    );
    path
}

/// The value of one sample in a Prometheus text page: `name` with exactly `labels`
/// (`""` for none, else as written, e.g. `{outcome="admitted"}`); `None` when absent.
pub fn metric(page: &str, name: &str, labels: &str) -> Option<f64> {
    let key = format!("{name}{labels} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
}

/// `GET http://{addr}/metrics` (a worker serves it on its gRPC port).
pub async fn scrape(addr: &str) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap_or_else(|e| panic!("scraping {addr}: {e}"))
        .text()
        .await
        .expect("a metrics page")
}

/// `scrape`, or `None` while nothing answers at `addr` (a process starting or gone).
pub async fn try_scrape(addr: &str) -> Option<String> {
    let (status, text) = try_get(&format!("http://{addr}/metrics")).await?;
    (status == 200).then_some(text)
}

/// A GET bounded to a few seconds: the status and the body, or `None` when the request
/// failed (nothing listening, no answer in time).
pub async fn try_get(url: &str) -> Option<(u16, String)> {
    let resp = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .ok()?;
    let status = resp.status().as_u16();
    Some((status, resp.text().await.ok()?))
}

/// Polls GET `url` until its status and body satisfy `ok`, while `proc` runs; `Err` says
/// why it gave up (the process exited, or `limit` passed).
async fn wait_answer(
    proc: &mut Proc,
    url: &str,
    limit: Duration,
    ok: impl Fn(u16, &str) -> bool,
) -> Result<(), String> {
    let outcome = poll_until(limit, || {
        let exited = proc.child.try_wait().ok().flatten();
        let ok = &ok;
        async move {
            if let Some(status) = exited {
                return Some(Err(format!("it exited ({status})")));
            }
            let (status, body) = try_get(url).await?;
            ok(status, &body).then_some(Ok(()))
        }
    })
    .await;
    outcome.unwrap_or_else(|| Err(format!("{url} did not answer as expected within {limit:?}")))
}

/// How often the harness polls for a condition.
const POLL: Duration = Duration::from_millis(20);

/// Calls `probe` until it gives a value, for at most `limit` (the probe runs at least
/// once); `None` when time ran out. Callers panic with what they waited for.
pub async fn poll_until<T, F, Fut>(limit: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = probe().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `addr`'s metrics until `name` reads `want`; panics with the last page after
/// `limit`.
pub async fn wait_metric(addr: &str, name: &str, labels: &str, want: f64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let page = scrape(addr).await;
        if metric(&page, name, labels) == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name}{labels} on {addr} did not reach {want} within {limit:?}:\n{page}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
