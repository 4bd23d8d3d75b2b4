//! Workers found through a real Kubernetes API server (etcd and kube-apiserver built from
//! upstream by tests/kube/get-apiserver.sh): the router and the prefill nodes follow the
//! EndpointSlices this test writes for worker processes it runs, with no more than list
//! and watch on EndpointSlices in their namespace. No kubelet runs, so the test plays the
//! endpoint controller: it writes each pod's endpoint and its readiness.

use std::net::{IpAddr, UdpSocket};
use std::time::Duration;

use e2e::kube::KubeApi;
use e2e::{free_port, poll_until, scrape, tiny_model, try_get, try_scrape, workers_in, Proc, Role};
use reqwest::Method;
use serde_json::{json, Value};

const NS: &str = "tandem";
const SELECTOR: &str = "app.kubernetes.io/instance=t";
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
    role: Role,
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
            role,
            ip,
            port,
            proc,
        }
    }

    /// The EndpointSlice the endpoint controller would write for this pod alone.
    fn slice(&self, ready: bool) -> Value {
        let role = self.role.name();
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": self.name, "namespace": NS, "labels": {
                "app.kubernetes.io/instance": "t",
                "app.kubernetes.io/component": role,
                "kubernetes.io/service-name": format!("t-{role}")}},
            "addressType": "IPv4",
            "ports": [{"name": "grpc", "port": self.port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [self.ip.to_string()],
                "conditions": {"ready": ready, "serving": ready, "terminating": false},
                "targetRef": {"kind": "Pod", "namespace": NS, "name": self.name}}],
        })
    }

    fn path(&self) -> String {
        format!("{SLICES}/{}", self.name)
    }
}

const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/tandem/endpointslices";

/// The namespace, and a Role to list and watch its EndpointSlices bound to the router's
/// and the prefill nodes' service accounts.
async fn grant(api: &KubeApi) {
    api.create("/api/v1/namespaces", &json!({"metadata": {"name": NS}}))
        .await;
    api.create(
        &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles"),
        &json!({"metadata": {"name": "discovery"}, "rules": [{
            "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
            "verbs": ["list", "watch"]}]}),
    )
    .await;
    api.create(
        &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings"),
        &json!({"metadata": {"name": "discovery"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "discovery"},
            "subjects": [
                {"kind": "ServiceAccount", "name": "router", "namespace": NS},
                {"kind": "ServiceAccount", "name": "prefill", "namespace": NS}]}),
    )
    .await;
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

#[tokio::test(flavor = "multi_thread")]
async fn the_router_follows_endpoint_slices_as_pools_scale_losing_nothing() {
    let api = KubeApi::start(&["tandem/router", "tandem/prefill"]).await;
    grant(&api).await;
    let follow = vec![
        "--kube-selector".to_string(),
        SELECTOR.into(),
        "--kube-namespace".into(),
        NS.into(),
    ];
    let prefill_cfg = api.kubeconfig("tandem/prefill", NS).display().to_string();
    let prefill_env = [("KUBECONFIG", prefill_cfg.as_str())];
    let mut d0 = Pod::start("decode-0", Role::Decode, &[], &[]).await;
    let p0 = Pod::start("prefill-0", Role::Prefill, &follow, &prefill_env).await;

    let port = free_port();
    let ops = format!("127.0.0.1:{}", free_port());
    let url = format!("http://127.0.0.1:{port}");
    let router_cfg = api.kubeconfig("tandem/router", NS).display().to_string();
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
    router_args.extend(["--kube-selector".to_string(), SELECTOR.into()]);
    let router = Proc::spawn_env(
        &e2e::bin("tandem-router"),
        &router_args,
        "kube-router",
        &[("KUBECONFIG", router_cfg.as_str())],
    );

    // Pods the controller has not marked ready are not workers.
    api.create(SLICES, &p0.slice(true)).await;
    api.create(SLICES, &d0.slice(false)).await;
    wait_ready(&ops, Role::Prefill, 1.0, &router).await;
    let page = scrape(&ops).await;
    assert_eq!(
        workers_in(&page, Role::Decode, "ready").unwrap_or(0.0),
        0.0,
        "{page}"
    );
    api.replace(&d0.path(), &d0.slice(true)).await;
    wait_ready(&ops, Role::Decode, 1.0, &router).await;
    let (status, body) = e2e::post(&format!("{url}/v1/chat/completions"), &chat(4)).await;
    assert_eq!(status, 200, "{body}");

    // Scale the decode pool up, then take the first pod out while requests run.
    let d1 = Pod::start("decode-1", Role::Decode, &[], &[]).await;
    api.create(SLICES, &d1.slice(true)).await;
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
    api.replace(&d0.path(), &d0.slice(false)).await;
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
    // The prefill node follows the decode pool too: it sends to the pod that is left.
    let (status, body) = e2e::post(&format!("{url}/v1/chat/completions"), &chat(4)).await;
    assert_eq!(status, 200, "{body}");
    drop((d0, d1, p0));

    // The router's service account can do what it needs and nothing more.
    let router_token = Some("tandem/router");
    let (status, _) = api.call(Method::GET, SLICES, None, router_token).await;
    assert_eq!(status, 200);
    for denied in [
        "/api/v1/namespaces/tandem/pods",
        "/api/v1/namespaces/tandem/secrets",
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
    ] {
        let (status, _) = api.call(Method::GET, denied, None, router_token).await;
        assert_eq!(status, 403, "{denied}");
    }
    let (status, _) = api
        .call(
            Method::DELETE,
            &format!("{SLICES}/decode-1"),
            None,
            router_token,
        )
        .await;
    assert_eq!(status, 403, "it cannot write");
}
