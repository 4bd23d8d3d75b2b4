//! Every rendering of deploy/ that an operator can apply, applied to a real Kubernetes API
//! server (etcd and kube-apiserver built from upstream by tests/kube/get-apiserver.sh) with
//! strict field validation: the server must accept each object as written, with no field it
//! does not know. The renderings: `helm template` of the chart with each values example in
//! tests/deploy/helm-values, and `kubectl kustomize` of the base, each overlay, and the base
//! with each component. The custom kinds are registered with their projects' own
//! CustomResourceDefinitions (tests/kube/get-crds.sh: cert-manager, the Prometheus Operator,
//! KEDA, Gateway API), so the server holds each custom resource to the real schema too.
//! No controllers run, so nothing these objects ask for happens here (tests/tests/e2e/kube.rs
//! runs what the pods would).

use std::path::{Path, PathBuf};

use e2e::kube::{run, tool, upstream_crds, KubeApi};
use e2e::{root, scratch};
use serde_json::json;

/// One rendering: its name, which is also the namespace it is applied in, and its objects.
struct Rendering {
    name: String,
    yaml: String,
}

/// The files in `dir` whose names end in `.yaml`, in order.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a folder entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

/// What `program` with `args` writes: a rendering.
fn rendered(program: &Path, args: &[&str]) -> String {
    let out = run(program, args, "");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{} {args:?}: {stderr}",
        program.display()
    );
    String::from_utf8(out.stdout).expect("renderings are UTF-8")
}

/// The chart with each values example, in namespace `helm-<example>`.
fn charted(helm: &Path) -> Vec<Rendering> {
    let chart = root().join("deploy/helm/tandem").display().to_string();
    yaml_files(&root().join("tests/deploy/helm-values"))
        .into_iter()
        .map(|values| {
            let stem = values.file_stem().expect("a name").to_string_lossy();
            let name = format!("helm-{stem}");
            let values = values.display().to_string();
            let args = ["template", "t", &chart, "--namespace", &name, "-f", &values];
            let yaml = rendered(helm, &args);
            Rendering { name, yaml }
        })
        .collect()
}

/// The kustomize base, each overlay, and the base with each component, each moved into
/// namespace `kustomize-<target>` by a kustomization around it.
fn kustomized(kubectl: &Path) -> Vec<Rendering> {
    let k8s = root().join("deploy/k8s");
    let mut targets = vec![("base".to_string(), vec![k8s.join("base")], vec![])];
    for group in ["overlays", "components"] {
        let mut names: Vec<_> = std::fs::read_dir(k8s.join(group))
            .expect("deploy/k8s")
            .map(|e| {
                e.expect("a folder entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        for name in names {
            let path = k8s.join(group).join(&name);
            targets.push(match group {
                "overlays" => (name, vec![path], vec![]),
                _ => (format!("base-{name}"), vec![k8s.join("base")], vec![path]),
            });
        }
    }
    let dir = scratch().join("kustomized");
    targets
        .into_iter()
        .map(|(target, resources, components)| {
            let name = format!("kustomize-{target}");
            let wrap = dir.join(&name);
            std::fs::create_dir_all(&wrap).expect("a kustomization's folder");
            // Kustomize takes only relative paths.
            let up = wrap.strip_prefix(root()).expect("scratch is in the tree");
            let up: PathBuf = up.components().map(|_| "..").collect();
            let relative = |paths: Vec<PathBuf>| -> Vec<PathBuf> {
                let from_root = |p: PathBuf| p.strip_prefix(root()).map(|p| up.join(p));
                paths
                    .into_iter()
                    .map(|p| from_root(p).expect("in the tree"))
                    .collect()
            };
            let kustomization = json!({
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": name,
                "resources": relative(resources),
                "components": relative(components),
            });
            // JSON is YAML: kustomize reads it as written.
            std::fs::write(wrap.join("kustomization.yaml"), kustomization.to_string())
                .expect("writing a kustomization");
            let yaml = rendered(kubectl, &["kustomize", &wrap.display().to_string()]);
            Rendering { name, yaml }
        })
        .collect()
}

/// Applies `rendering` with server-side apply and strict field validation; kubectl's
/// output, and whether the server took every object.
fn apply(kubectl: &Path, config: &Path, rendering: &Rendering) -> (bool, String) {
    let config = config.display().to_string();
    let out = run(
        kubectl,
        &[
            "--kubeconfig",
            &config,
            "apply",
            "--server-side",
            "--validate=strict",
            "--field-manager=tandem-check",
            "--namespace",
            &rendering.name,
            "--filename=-",
        ],
        &rendering.yaml,
    );
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Namespace `name`, with the `default` service account its controller would make (a pod
/// that names none is refused without it).
async fn namespace(api: &KubeApi, name: &str) {
    api.create("/api/v1/namespaces", &json!({"metadata": {"name": name}}))
        .await;
    let accounts = format!("/api/v1/namespaces/{name}/serviceaccounts");
    api.create(&accounts, &json!({"metadata": {"name": "default"}}))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_api_server_accepts_every_rendering_strictly() {
    let api = KubeApi::start(&[]).await;
    let (helm, kubectl) = (tool("helm"), tool("kubectl"));
    let config = api.admin_kubeconfig("default");
    let crds = upstream_crds();
    let crds = std::fs::read_to_string(&crds).expect("the upstream CRDs");
    let kinds = Rendering {
        name: "default".into(),
        yaml: crds,
    };
    let (ok, said) = apply(&kubectl, &config, &kinds);
    assert!(ok, "registering the custom kinds: {said}");
    let wait = [
        "--kubeconfig",
        &config.display().to_string(),
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "customresourcedefinitions",
        "--all",
    ]
    .map(String::from);
    let out = run(&kubectl, &wait.each_ref().map(String::as_str), "");
    assert!(out.status.success(), "{out:?}");

    let renderings: Vec<Rendering> = charted(&helm)
        .into_iter()
        .chain(kustomized(&kubectl))
        .collect();
    assert!(renderings.len() >= 12, "{} renderings", renderings.len());
    for rendering in &renderings {
        namespace(&api, &rendering.name).await;
        let (ok, said) = apply(&kubectl, &config, rendering);
        assert!(ok, "{} is refused:\n{said}", rendering.name);
        let applied = said.matches("serverside-applied").count();
        let objects = rendering.yaml.matches("\nkind: ").count();
        assert!(
            applied >= objects && applied > 0,
            "{}: {said}",
            rendering.name
        );
    }

    // The check bites: a field the API does not have is refused, by name.
    let default = renderings
        .iter()
        .find(|r| r.name == "helm-default")
        .expect("the default values' rendering");
    let pod_spec = "spec:\n  restartPolicy: Never\n";
    assert_eq!(default.yaml.matches(pod_spec).count(), 1, "helm test's pod");
    let broken = Rendering {
        name: "broken".into(),
        yaml: default
            .yaml
            .replace(
                pod_spec,
                "spec:\n  restartPolicy: Never\n  restartPolicies: Never\n",
            )
            .replace("namespace: helm-default\n", "namespace: broken\n"),
    };
    api.create(
        "/api/v1/namespaces",
        &json!({"metadata": {"name": "broken"}}),
    )
    .await;
    let (ok, said) = apply(&kubectl, &config, &broken);
    assert!(!ok && said.contains("restartPolicies"), "{said}");

    // And so is a field a custom kind's upstream schema does not have.
    let certificates = renderings
        .iter()
        .find(|r| r.name == "helm-cert-manager")
        .expect("the cert-manager values' rendering");
    let ca = "  isCA: true\n";
    assert_eq!(
        certificates.yaml.matches(ca).count(),
        1,
        "the CA Certificate"
    );
    let broken = Rendering {
        name: "broken-custom".into(),
        yaml: certificates
            .yaml
            .replace(ca, "  isCA: true\n  isRootCA: true\n")
            .replace(
                "namespace: helm-cert-manager\n",
                "namespace: broken-custom\n",
            ),
    };
    namespace(&api, &broken.name).await;
    let (ok, said) = apply(&kubectl, &config, &broken);
    assert!(!ok && said.contains("isRootCA"), "{said}");
}
