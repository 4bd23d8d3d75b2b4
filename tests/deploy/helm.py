"""The Helm chart (deploy/helm/tandem), for tests/deploy/manifests.py: rendered with
`helm template` for each value set in tests/deploy/helm-values/, and each rendering checked
like a kustomize target (schemas, the binaries' flags, the manifests' own consistency,
monitoring); and the kustomize base's part that the chart renders, checked to be current."""

import os
import re
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "deploy", "helm", "tandem")
RENDER_BASE = os.path.join(ROOT, "scripts", "render-k8s-base.py")
VALUES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helm-values")
EXAMPLES = os.path.join(CHART, "examples")


def helm():
    return os.environ.get("HELM", "helm")


def targets():
    """(label, values file) of every value set: the tests' and the chart's examples."""
    return [(f"helm {prefix}{name[:-5]}", os.path.join(folder, name))
            for prefix, folder in (("", VALUES), ("example ", EXAMPLES))
            for name in sorted(os.listdir(folder)) if name.endswith(".yaml")]


def render(values, chart=CHART):
    """The chart's objects with `values`, in namespace tandem; raises with helm's message."""
    r = subprocess.run(
        [helm(), "template", "tandem", chart, "--namespace", "tandem", "-f", values],
        capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip() or r.stdout.strip())
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def check_base(t, k8s, chart=CHART):
    """The kustomize base's chart/ is `chart`'s current rendering (scripts/render-k8s-base.py):
    Helm and kustomize deploy one design."""
    base = os.path.join(k8s, "base")
    r = subprocess.run([sys.executable, RENDER_BASE, "--check", "--chart", chart,
                        "--values", os.path.join(base, "values.yaml"),
                        "--out", os.path.join(base, "chart")], capture_output=True, text=True)
    t.ok("deploy/k8s/base/chart is the chart's rendering with base/values.yaml",
         r.returncode == 0, " ".join(r.stderr.split()))


def validated_on(values, versions):
    """The Kubernetes versions of `versions` a value set is checked against: all, unless its
    first line says `# k8s >= X.Y` (a field that older servers lack)."""
    with open(values) as f:
        m = re.match(r"# k8s >= (\d+)\.(\d+)", f.readline())
    if not m:
        return versions
    least = (int(m.group(1)), int(m.group(2)))
    return [v for v in versions if tuple(int(x) for x in v.split(".")[:2]) >= least]


def test_script(router, key_file):
    """The shell script of the chart's `helm test` pod (templates/tests.yaml, with an API key
    set), pointed at `router` (http://host:port) and reading its key from `key_file`."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values:
        values.write("apiKeys:\n  keys: [\"sk-any\"]\n")
        values.flush()
        objs = render(values.name)
    (pod,) = [o for o in objs if o["kind"] == "Pod"
              and o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    script = pod["spec"]["containers"][0]["args"][0]
    base = re.search(r"^base=(http://\S+)$", script, re.M)
    if base is None or "/etc/tandem/api-keys/api-keys" not in script:
        raise RuntimeError(f"the test pod's script has no plain base URL or key file:\n{script}")
    return script.replace(base.group(1), router).replace("/etc/tandem/api-keys/api-keys",
                                                         key_file)


if __name__ == "__main__":
    # helm.py test-script ROUTER KEY_FILE: prints the script (tests/deploy/entrypoints.sh).
    if len(sys.argv) != 4 or sys.argv[1] != "test-script":
        sys.exit("usage: helm.py test-script ROUTER KEY_FILE")
    print(test_script(sys.argv[2], sys.argv[3]))
