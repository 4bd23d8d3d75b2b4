//! `helm install` of the chart into a real Kubernetes API server (etcd and kube-apiserver
//! built from upstream by tests/kube/get-apiserver.sh), then the chart's pods run as local
//! processes: the router and the prefill nodes follow the EndpointSlices of the chart's own
//! Services, as the chart's own service account (whose Role allows list and watch on
//! EndpointSlices in the namespace, nothing else), with the selector from the chart's
//! ConfigMaps. No kubelet or controllers run, so the test plays them: it writes each pod's
//! endpoint and readiness into slices labelled as the endpoint controller labels them, and
//! runs `helm test`'s pod here.

use std::net::{IpAddr, UdpSocket};
use std::path::Path;
use std::time::Duration;

use e2e::kube::{run, tool, KubeApi};
use e2e::{
    free_port, poll_until, root, scrape, scratch, tiny_model, try_get, try_scrape, workers_in,
    Proc, Role,
};
use reqwest::Method;
use serde_json::{json, Value};

const NS: &str = "tandem";
/// The release: its objects are named `t-<part>`.
const RELEASE: &str = "t";
/// The chart's service account for the pods that read the API.
const ACCOUNT: &str = "tandem/t-discovery";
const SEE: Duration = Duration::from_secs(30);

/// An address of this host that an EndpointSlice may hold (the API server refuses
/// loopback ones): the one its default route leaves from. Connecting a UDP socket sends
/// nothing.
fn host_ip() -> IpAddr {
    let s = UdpSocket::bind("0.0.0.0:0").expect("a UDP socket");
    s.connect("203.0.113.1:9").expect("a default route");
    let ip = s.local_addr().expect("its address").ip();
    assert!(!ip.is_loopback(), "{ip}");
    ip
}

/// One worker process and the endpoint that describes its pod.
struct Pod {
    name: String,
    ip: IpAddr,
    port: u16,
    proc: Proc,
}

impl Pod {
    /// Starts a worker of `role` on this host's address, with `extra` flags and `env`, and
    /// waits until its operations listener says it is ready.
    async fn start(name: &str, role: Role, extra: &[String], env: &[(&str, &str)]) -> Self {
        let ip = host_ip();
        let port = free_port();
        let ops = format!("127.0.0.1:{}", free_port());
        let mut args = vec![
            "--model".into(),
            tiny_model().display().to_string(),
            "--listen".into(),
            format!("{ip}:{port}"),
            "--metrics-listen".into(),
            ops.clone(),
        ];
        args.extend(extra.iter().cloned());
        let proc = Proc::spawn_env(
            &e2e::bin(role.binary()),
            &args,
            &format!("kube-{name}"),
            env,
        );
        let health = format!("http://{ops}/health/ready");
        let ready = poll_until(SEE * 4, || async {
            try_get(&health).await.filter(|(status, _)| *status == 200)
        })
        .await;
        assert!(
            ready.is_some(),
            "{name} is not ready: {}",
            std::fs::read_to_string(&proc.log).unwrap_or_default()
        );
        Self {
            name: name.into(),
            ip,
            port,
            proc,
        }
    }

    fn path(&self) -> String {
        format!("{SLICES}/{}", self.name)
    }

    /// This pod's EndpointSlice in `service`.
    fn slice(&self, service: &Value, ready: bool) -> Value {
        slice(service, &self.name, self.ip, self.port, ready)
    }
}

const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/tandem/endpointslices";

/// The EndpointSlice the endpoint controller would write for `service` holding one pod,
/// `name` at `ip:port`: the Service's labels and its port's name, with the controller's own.
fn slice(service: &Value, name: &str, ip: IpAddr, port: u16, ready: bool) -> Value {
    let mut labels = service["metadata"]["labels"].clone();
    labels["kubernetes.io/service-name"] = service["metadata"]["name"].clone();
    labels["endpointslice.kubernetes.io/managed-by"] = "endpointslice-controller.k8s.io".into();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "addressType": "IPv4",
        "ports": [{"name": service["spec"]["ports"][0]["name"], "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip.to_string()],
            "conditions": {"ready": ready, "serving": ready, "terminating": false},
            "targetRef": {"kind": "Pod", "namespace": NS, "name": name}}],
    })
}

/// The chart, installed by `helm install` as the admin, and what the controllers would have
/// made before any pod of it runs: the namespace's `default` service account (`helm test`'s
/// pod runs as it).
async fn install(api: &KubeApi, helm: &Path, admin: &Path) {
    let chart = root().join("deploy/helm/tandem");
    let out = run(
        helm,
        &[
            "--kubeconfig",
            &admin.display().to_string(),
            "install",
            RELEASE,
            &chart.display().to_string(),
            "--namespace",
            NS,
            "--create-namespace",
        ],
        "",
    );
    assert!(
        out.status.success(),
        "helm install: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    api.create(
        &format!("/api/v1/namespaces/{NS}/serviceaccounts"),
        &json!({"metadata": {"name": "default"}}),
    )
    .await;
}

/// The object of `kind` (a collection under /api/v1) named `t-<part>`, as installed.
async fn installed(api: &KubeApi, kind: &str, part: &str) -> Value {
    let path = format!("/api/v1/namespaces/{NS}/{kind}/{RELEASE}-{part}");
    let (status, object) = api.call(Method::GET, &path, None, None).await;
    assert_eq!(status, 200, "GET {path}: {object}");
    object
}

/// Waits until the router's metrics count `n` ready workers of `role`.
async fn wait_ready(ops: &str, role: Role, n: f64, router: &Proc) {
    let seen = poll_until(SEE, || async {
        let page = try_scrape(ops).await?;
        (workers_in(&page, role, "ready") == Some(n)).then_some(())
    })
    .await;
    assert!(
        seen.is_some(),
        "the router does not count {n} ready {} workers: {}\n{}",
        role.name(),
        scrape(ops).await,
        std::fs::read_to_string(&router.log).unwrap_or_default()
    );
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": "test", "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// Runs `helm test` and plays the kubelet for its pod: runs the pod's command here and
/// writes its exit into the pod's status. No cluster DNS or Service proxy runs here, so the
/// command's curl connects the router Service's name and port to the router process (the
/// one stand-in in this test, for what cannot run without a cluster network).
async fn helm_test(api: &KubeApi, helm: &Path, admin: &Path, router_port: u16) {
    let helm = std::process::Command::new(helm)
        .args([
            "--kubeconfig",
            &admin.display().to_string(),
            "test",
            RELEASE,
        ])
        .args(["--namespace", NS, "--timeout", "120s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running helm test");
    let path = format!("/api/v1/namespaces/{NS}/pods/{RELEASE}-test");
    let pod = poll_until(SEE, || async {
        let (status, pod) = api.call(Method::GET, &path, None, None).await;
        (status == 200).then_some(pod)
    })
    .await
    .expect("helm test creates its pod");
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["command"], json!(["sh", "-c"]), "{pod}");
    let script = container["args"][0].as_str().expect("its script");

    let service = installed(api, "services", "router").await;
    let port = &service["spec"]["ports"][0]["port"];
    let shim = scratch().join("helm-test-bin");
    std::fs::create_dir_all(&shim).expect("a folder for the curl shim");
    let curl = which("curl");
    std::fs::write(
        shim.join("curl"),
        format!(
            "#!/bin/sh\nexec {} --connect-to {RELEASE}-router.{NS}.svc:{port}:127.0.0.1:{router_port} \"$@\"\n",
            curl.display()
        ),
    )
    .expect("writing the curl shim");
    let executable = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(shim.join("curl"), executable).expect("making the shim executable");
    let search = std::env::var("PATH").unwrap_or_default();
    let ran = std::process::Command::new("sh")
        .args(["-c", script])
        .env("PATH", format!("{}:{search}", shim.display()))
        .output()
        .expect("running the test pod's command");
    let phase = if ran.status.success() {
        "Succeeded"
    } else {
        "Failed"
    };
    api.merge_patch(
        &format!("{path}/status"),
        &json!({"status": {"phase": phase}}),
    )
    .await;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr)
    );
    assert!(
        ran.status.success(),
        "the test pod's command failed: {said}"
    );
    assert!(said.contains("a completion came back"), "{said}");
    let helm = helm.wait_with_output().expect("helm test's output");
    let report = String::from_utf8_lossy(&helm.stdout);
    assert!(
        helm.status.success() && report.contains("Succeeded"),
        "helm test: {report}{}",
        String::from_utf8_lossy(&helm.stderr)
    );
}

/// The path of `program` on `$PATH`.
fn which(program: &str) -> std::path::PathBuf {
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no {program} on PATH"))
}

#[tokio::test(flavor = "multi_thread")]
async fn helm_install_serves_through_the_charts_services_as_pools_scale_losing_nothing() {
    let api = KubeApi::start(&[ACCOUNT]).await;
    let (helm, admin) = (tool("helm"), api.admin_kubeconfig(NS));
    install(&api, &helm, &admin).await;
    // Each pod that reads the API takes its selector from its ConfigMap.
    let selector = installed(&api, "configmaps", "router").await["data"]["TANDEM_KUBE_SELECTOR"]
        .as_str()
        .expect("the router's selector")
        .to_string();
    assert_eq!(
        installed(&api, "configmaps", "prefill").await["data"]["TANDEM_KUBE_SELECTOR"],
        json!(selector)
    );
    let [router_svc, prefill_svc, decode_svc] = [
        installed(&api, "services", "router").await,
        installed(&api, "services", "prefill").await,
        installed(&api, "services", "decode").await,
    ];
    let account = api.kubeconfig(ACCOUNT, NS).display().to_string();
    let env = [("KUBECONFIG", account.as_str())];
    let follow = vec!["--kube-selector".to_string(), selector.clone()];
    let mut d0 = Pod::start("decode-0", Role::Decode, &[], &[]).await;
    let p0 = Pod::start("prefill-0", Role::Prefill, &follow, &env).await;

    let port = free_port();
    let ops = format!("127.0.0.1:{}", free_port());
    let url = format!("http://127.0.0.1:{port}");
    let mut router_args = vec![
        "--model".to_string(),
        tiny_model().display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--metrics-listen".into(),
        ops.clone(),
        "--model-name".into(),
        "test".into(),
    ];
    // The namespace comes from the kubeconfig's context, as in a pod from its own.
    router_args.extend(follow.iter().cloned());
    let router = Proc::spawn_env(
        &e2e::bin("tandem-router"),
        &router_args,
        "kube-router",
        &env,
    );

    // The routers' own Service matches the selector too: its pods are not workers. Pods the
    // controller has not marked ready are not workers either.
    api.create(
        SLICES,
        &slice(&router_svc, "router-0", host_ip(), port, true),
    )
    .await;
    api.create(SLICES, &p0.slice(&prefill_svc, true)).await;
    api.create(SLICES, &d0.slice(&decode_svc, false)).await;
    wait_ready(&ops, Role::Prefill, 1.0, &router).await;
    let page = scrape(&ops).await;
    assert_eq!(
        workers_in(&page, Role::Decode, "ready").unwrap_or(0.0),
        0.0,
        "{page}"
    );
    api.replace(&d0.path(), &d0.slice(&decode_svc, true)).await;
    wait_ready(&ops, Role::Decode, 1.0, &router).await;
    let (status, body) = e2e::post(&format!("{url}/v1/chat/completions"), &chat(4)).await;
    assert_eq!(status, 200, "{body}");

    // Scale the decode pool up, then take the first pod out while requests run.
    let d1 = Pod::start("decode-1", Role::Decode, &[], &[]).await;
    api.create(SLICES, &d1.slice(&decode_svc, true)).await;
    wait_ready(&ops, Role::Decode, 2.0, &router).await;
    let load: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..4 {
                    let (s, b) = e2e::post(&format!("{url}/v1/chat/completions"), &chat(16)).await;
                    statuses.push((s, b));
                }
                statuses
            })
        })
        .collect();
    api.replace(&d0.path(), &d0.slice(&decode_svc, false)).await;
    wait_ready(&ops, Role::Decode, 1.0, &router).await;
    api.delete(&d0.path()).await;
    // Its pod ends as Kubernetes ends it: SIGTERM, a drain, exit.
    d0.proc.signal("TERM");
    let mut served = 0;
    for task in load {
        for (status, body) in task.await.expect("a load task") {
            assert_eq!(status, 200, "a request was lost: {body}");
            served += 1;
        }
    }
    assert_eq!(served, 32);
    let exit = d0.proc.wait_exit(SEE).await;
    assert!(
        exit.is_some_and(|e| e.success()),
        "decode-0 did not drain: {exit:?}"
    );
    let page = scrape(&ops).await;
    assert_eq!(
        workers_in(&page, Role::Decode, "ready"),
        Some(1.0),
        "{page}"
    );
    // The prefill node follows the decode pool too: it sends to the pod that is left, and
    // so does `helm test`'s pod.
    let (status, body) = e2e::post(&format!("{url}/v1/chat/completions"), &chat(4)).await;
    assert_eq!(status, 200, "{body}");
    helm_test(&api, &helm, &admin, port).await;
    drop((d0, d1, p0));

    // The chart's service account can do what the pods need and nothing more.
    let token = Some(ACCOUNT);
    let (status, _) = api.call(Method::GET, SLICES, None, token).await;
    assert_eq!(status, 200);
    for denied in [
        "/api/v1/namespaces/tandem/pods",
        "/api/v1/namespaces/tandem/secrets",
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
    ] {
        let (status, _) = api.call(Method::GET, denied, None, token).await;
        assert_eq!(status, 403, "{denied}");
    }
    let (status, _) = api
        .call(Method::DELETE, &format!("{SLICES}/decode-1"), None, token)
        .await;
    assert_eq!(status, 403, "it cannot write");
}
