"""The Helm chart (deploy/helm/tandem), for tests/deploy/manifests.py: rendered with
`helm template` for each value set in tests/deploy/helm-values/, and each rendering checked
like a kustomize target (schemas, the binaries' flags, the manifests' own consistency,
monitoring)."""

import os
import re
import subprocess

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "deploy", "helm", "tandem")
VALUES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helm-values")


def helm():
    return os.environ.get("HELM", "helm")


def targets():
    """(label, values file) of every value set."""
    return [(f"helm {name[:-5]}", os.path.join(VALUES, name))
            for name in sorted(os.listdir(VALUES)) if name.endswith(".yaml")]


def render(values, chart=CHART):
    """The chart's objects with `values`, in namespace tandem; raises with helm's message."""
    r = subprocess.run(
        [helm(), "template", "tandem", chart, "--namespace", "tandem", "-f", values],
        capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip() or r.stdout.strip())
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def validated_on(values, versions):
    """The Kubernetes versions of `versions` a value set is checked against: all, unless its
    first line says `# k8s >= X.Y` (a field that older servers lack)."""
    with open(values) as f:
        m = re.match(r"# k8s >= (\d+)\.(\d+)", f.readline())
    if not m:
        return versions
    least = (int(m.group(1)), int(m.group(2)))
    return [v for v in versions if tuple(int(x) for x in v.split(".")[:2]) >= least]
