//! A real etcd server for one test: a single member on free localhost ports with its own
//! data folder, which a test can kill and start again on the same ports to play an outage.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::{free_port, scratch, wait_answer, Proc};

/// How long etcd may take to report healthy after a start.
const START_LIMIT: Duration = Duration::from_secs(20);

/// The etcd server binary: `$ETCD_BIN`, else the Debian package's.
fn etcd_bin() -> PathBuf {
    let bin = std::env::var_os("ETCD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
    assert!(
        bin.exists(),
        "etcd is missing: apt-get install etcd-server etcd-client (.ci/run does this); looked for {}",
        bin.display()
    );
    bin
}

/// The etcd client binary: `$ETCDCTL_BIN`, else `etcdctl` beside the server.
fn etcdctl_bin() -> PathBuf {
    let bin = std::env::var_os("ETCDCTL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| etcd_bin().with_file_name("etcdctl"));
    assert!(
        bin.exists(),
        "etcdctl is missing: apt-get install etcd-server etcd-client (.ci/run does this); looked for {}",
        bin.display()
    );
    bin
}

/// TLS and a user for a secured etcd: clients must present a certificate from the CA and
/// authenticate.
#[derive(Debug, Clone)]
pub struct EtcdSecurity {
    /// CA of every certificate below.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server: crate::pki::Leaf,
    /// The certificate etcdctl (and the cluster's processes) present.
    pub client: crate::pki::Leaf,
    /// The user the cluster's processes log in as, with read-write rights on
    /// `/tandem/` only.
    pub user: String,
    /// Its password.
    pub password: String,
    /// Root's password, for etcdctl.
    pub root_password: String,
}

impl EtcdSecurity {
    /// The flags that make a router or worker reach this etcd as `user`.
    pub fn client_args(&self) -> Vec<String> {
        [
            "--etcd-ca",
            &self.ca.display().to_string(),
            "--etcd-cert",
            &self.client.cert.display().to_string(),
            "--etcd-key",
            &self.client.key.display().to_string(),
            "--etcd-user",
            &self.user,
            "--etcd-password",
            &self.password,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

/// A single-member etcd cluster on localhost; killed on drop.
pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP health endpoint's port, which answers whatever the client port asks.
    metrics_port: u16,
    security: Option<EtcdSecurity>,
    /// Whether etcdctl must log in as root.
    auth_on: bool,
    data_dir: PathBuf,
    proc: Option<Proc>,
    /// The log of each start, oldest first (a restart must not overwrite the outage's).
    logs: Vec<PathBuf>,
}

/// Kills etcd and removes its data folder: each holds a preallocated 64 MB write-ahead log
/// and its spare, and a test run starts dozens. The logs stay beside it.
impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

impl Etcd {
    /// Starts etcd on free ports and waits until it reports healthy.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Starts etcd serving clients over TLS with client certificates, creates the user of
    /// `security` and turns authentication on.
    pub async fn start_secured(security: EtcdSecurity) -> Self {
        let mut etcd = Self::start_with(Some(security)).await;
        let s = etcd.security.clone().expect("secured");
        etcd.ctl(&["user", "add", &format!("root:{}", s.root_password)]);
        etcd.ctl(&["role", "add", "tandem"]);
        etcd.ctl(&[
            "role",
            "grant-permission",
            "tandem",
            "--prefix=true",
            "readwrite",
            "/tandem/",
        ]);
        etcd.ctl(&["user", "add", &format!("{}:{}", s.user, s.password)]);
        etcd.ctl(&["user", "grant-role", &s.user, "tandem"]);
        etcd.ctl(&["auth", "enable"]);
        etcd.auth_on = true;
        etcd
    }

    async fn start_with(security: Option<EtcdSecurity>) -> Self {
        let mut ports = Vec::new();
        while ports.len() < 3 {
            // Two ephemeral binds in a row can get the same port.
            let p = free_port();
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let (client_port, peer_port, metrics_port) = (ports[0], ports[1], ports[2]);
        let mut etcd = Self {
            client_port,
            peer_port,
            metrics_port,
            security,
            auth_on: false,
            data_dir: scratch().join(format!("etcd-{client_port}")),
            proc: None,
            logs: Vec::new(),
        };
        etcd.launch().await;
        etcd
    }

    /// The client endpoint, `127.0.0.1:<port>`, as `--etcd-endpoints` takes it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Kills etcd with SIGKILL (its clients get no goodbye, as in a crash) and waits for it
    /// to exit.
    pub fn stop(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            proc.kill();
        }
    }

    /// Starts etcd again on the same ports and data folder, and waits until it is healthy.
    pub async fn restart(&mut self) {
        self.stop();
        self.launch().await;
    }

    /// Writes `key` = `value`, without a lease: it stays until deleted.
    pub fn put(&self, key: &str, value: &str) {
        self.ctl(&["put", key, value]);
    }

    /// Every key under `prefix` with its value, in key order.
    pub fn get_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        let out = self.ctl(&["get", "--prefix", prefix]);
        // etcdctl prints each key on one line and its value on the next; the values the
        // tests read (registrations) are one-line JSON.
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines.len().is_multiple_of(2),
            "etcdctl get --prefix {prefix}: a value spans lines:\n{out}"
        );
        lines
            .chunks(2)
            .map(|kv| (kv[0].to_string(), kv[1].to_string()))
            .collect()
    }

    /// Every start's log, for failure messages.
    pub fn logs(&self) -> String {
        self.logs
            .iter()
            .map(|log| {
                format!(
                    "== {}\n{}",
                    log.display(),
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            })
            .collect()
    }

    /// Runs `etcdctl` (v3 API, bounded) against this server; its stdout. Panics with the
    /// server's log when the command fails.
    fn ctl(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(etcdctl_bin());
        cmd.env("ETCDCTL_API", "3");
        match &self.security {
            Some(s) => {
                cmd.arg(format!("--endpoints=https://{}", self.endpoint()))
                    .arg(format!("--cacert={}", s.ca.display()))
                    .arg(format!("--cert={}", s.client.cert.display()))
                    .arg(format!("--key={}", s.client.key.display()));
                // Until auth is on, etcd refuses to authenticate anyone.
                if self.auth_on {
                    cmd.arg(format!("--user=root:{}", s.root_password));
                }
            }
            None => {
                cmd.arg(format!("--endpoints={}", self.endpoint()));
            }
        }
        let out = cmd
            .args(["--dial-timeout=2s", "--command-timeout=5s"])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running etcdctl: {e}"));
        assert!(
            out.status.success(),
            "etcdctl {args:?} failed ({}): {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8(out.stdout).expect("etcdctl prints UTF-8")
    }

    /// Spawns the server on this instance's ports and data folder and waits until its
    /// health endpoint says so.
    async fn launch(&mut self) {
        let scheme = if self.security.is_some() {
            "https"
        } else {
            "http"
        };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let metrics = format!("http://127.0.0.1:{}", self.metrics_port);
        let mut args: Vec<String> = [
            "--name",
            "e2e",
            "--data-dir",
            &self.data_dir.display().to_string(),
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("e2e={peer}"),
            "--listen-metrics-urls",
            &metrics,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(s) = &self.security {
            args.extend([
                "--cert-file".to_string(),
                s.server.cert.display().to_string(),
                "--key-file".into(),
                s.server.key.display().to_string(),
                "--trusted-ca-file".into(),
                s.ca.display().to_string(),
                "--client-cert-auth".into(),
            ]);
        }
        let tag = format!("etcd-{}-{}", self.client_port, self.logs.len());
        let proc = self.proc.insert(Proc::spawn(&etcd_bin(), &args, &tag));
        self.logs.push(proc.log.clone());
        let healthy = |status: u16, body: &str| {
            status == 200
                && serde_json::from_str::<Value>(body).is_ok_and(|v| v["health"] == "true")
        };
        let url = format!("{metrics}/health");
        if let Err(why) = wait_answer(proc, &url, START_LIMIT, healthy).await {
            panic!("etcd is not healthy: {why}; log:\n{}", self.logs());
        }
    }
}
