"""Helm and kustomize agree, for tests/deploy/manifests.py: the kustomize base is the chart's
rendering (scripts/render-k8s-base.py), and each component has a twin in the chart's values
(TWINS). The kustomize target and the chart with the base's values plus the twin's must render
the same objects, as Kubernetes would run them: the same pods (each container's image,
command, effective environment with its ConfigMaps resolved, mounts, probes, resources), the
same volumes, Services, policies, budgets, autoscalers, monitors and certificates."""

import copy
import difflib
import os
import re
import tempfile

import yaml

import helm
from objects import container_env, env_dict, index

# A twin's value that is the chart's own default (values.yaml), where the base's differs.
CHART_DEFAULT = "<the chart's default>"
# What makes the chart render what each kustomize target adds to the base: values merged over
# deploy/k8s/base/values.yaml. A component without a twin here is one the chart does not
# offer the same way (model-fill-job: the chart fetches in init containers instead; and
# cert-manager-certs alone also makes the HTTPS certificate the chart makes only with
# tls.enabled).
TWINS = [
    ("base", {}),
    ("base+components/mtls", {"tls": {"enabled": True}}),
    ("base+components/mtls+components/cert-manager-certs",
     {"tls": {"enabled": True, "certManager": {"enabled": True}}}),
    ("base+components/model-fetch-init", {"model": {"uri": CHART_DEFAULT}}),
    ("base+components/external-etcd",
     {"etcd": {"deploy": False, "endpoints": [f"etcd-{m}.example.internal:2379"
                                              for m in "abc"]}}),
    ("base+components/monitoring", {"monitoring": {"enabled": True}}),
    ("base+components/decode-hpa-kv-blocks", {"decode": {"autoscaling": {"metric": "kvBlocks"}}}),
    ("base+components/gpu-pools",
     {"prefill": {"gpu": {"enabled": True}}, "decode": {"gpu": {"enabled": True}}}),
]
# Objects one side has by design: the namespace (Helm installs into one) and the base's model
# claim (the chart mounts a claim you made). Helm's hooks (`helm test`'s pod) are left out.
ONE_SIDED = {("Namespace", "tandem"), ("PersistentVolumeClaim", "tandem-models")}
# The hash kustomize appends to a generated ConfigMap's or Secret's name (its alphabet).
GENERATED = re.compile(r"^(.+)-[245-9bcdfghkmt]{10}$")
# Labels of one tool, not of the deployment.
TOOL_LABELS = {"app.kubernetes.io/part-of", "app.kubernetes.io/managed-by", "helm.sh/chart"}
# ConfigMaps and Secrets reach the pods as environment and volumes, where they are compared.
BY_REFERENCE = {"ConfigMap", "Secret"}


def merged(a, b):
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merged(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def resolved(twin, defaults):
    """`twin` with each CHART_DEFAULT replaced by the value at its place in `defaults`."""
    return {k: resolved(v, defaults.get(k) or {}) if isinstance(v, dict)
            else defaults[k] if v == CHART_DEFAULT else v for k, v in twin.items()}


def base_image(k8s):
    """The image the base's `images` transformer makes of the chart's, as chart values."""
    with open(os.path.join(k8s, "base", "kustomization.yaml")) as f:
        (image,) = yaml.safe_load(f)["images"]
    return {"image": {"repository": image["newName"], "tag": image["newTag"]}}


def tidy(node, names):
    """`node` without tool labels, checksum annotations and empty label maps, with generated
    names (`names`: hashed -> plain) plain."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "labels" and isinstance(v, dict):
                v = {a: b for a, b in v.items() if a not in TOOL_LABELS}
                if not v:
                    continue
            if k == "annotations" and isinstance(v, dict):
                v = {a: b for a, b in v.items() if not a.startswith("checksum/")}
                if not v:
                    continue
            out[k] = tidy(v, names)
        return out
    if isinstance(node, list):
        return [tidy(x, names) for x in node]
    return names.get(node, node) if isinstance(node, str) else node


def container_view(c, by_key):
    c = copy.deepcopy(c)
    env = env_dict(container_env(c, by_key))
    c.pop("envFrom", None)
    c["env"] = dict(sorted(env.items()))
    c["volumeMounts"] = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
    return c


def views(objs):
    """{(kind, name): the object as compared} of a rendering."""
    by_key = index(objs)
    names = {}
    for o in objs:
        m = GENERATED.match(o["metadata"]["name"])
        if o["kind"] in BY_REFERENCE and m:
            names[o["metadata"]["name"]] = m.group(1)
    out = {}
    for o in objs:
        if o["kind"] in BY_REFERENCE or "helm.sh/hook" in (o["metadata"].get("annotations") or {}):
            continue
        o = copy.deepcopy(o)
        o["metadata"].pop("namespace", None)
        template = (o.get("spec") or {}).get("template") if o["kind"] in (
            "Deployment", "StatefulSet", "Job") else None
        if template:
            spec = template["spec"]
            for field in ("containers", "initContainers"):
                if field in spec:
                    spec[field] = {c["name"]: container_view(c, by_key) for c in spec[field]}
            spec["volumes"] = {v["name"]: v for v in spec.get("volumes") or []}
        out[(o["kind"], o["metadata"]["name"])] = tidy(o, names)
    return out


def differences(kustomized, charted):
    """[(kind/name, what differs)] between two renderings' views ('' when equal)."""
    k, h = views(kustomized), views(charted)
    out = []
    for key in sorted(set(k) | set(h)):
        what = f"{key[0]}/{key[1]}"
        if key in ONE_SIDED:
            continue
        if key not in h or key not in k:
            out.append((what, "only in " + ("kustomize" if key in k else "the chart")))
            continue
        a = yaml.safe_dump(k[key], sort_keys=True).splitlines()
        b = yaml.safe_dump(h[key], sort_keys=True).splitlines()
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0)
                if not d.startswith(("---", "+++", "@@"))]
        out.append((what, " | ".join(diff[:6])))
    return out


def check(t, k8s, kustomized, chart=helm.CHART, only=None):
    """Each twin's renderings agree. `kustomized`: {label: objects} of the kustomize targets
    already rendered."""
    with open(os.path.join(k8s, "base", "values.yaml")) as f:
        base = merged(yaml.safe_load(f), base_image(k8s))
    with open(os.path.join(chart, "values.yaml")) as f:
        defaults = yaml.safe_load(f)
    for label, twin in TWINS:
        if label not in kustomized or (only and label not in only):
            continue
        twin = resolved(twin, defaults)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values:
            yaml.safe_dump(merged(base, twin), values)
            values.flush()
            try:
                charted = helm.render(values.name, chart)
            except RuntimeError as e:
                t.ok(f"twin of {label}: the chart renders", False, str(e))
                continue
        for what, diff in differences(kustomized[label], charted):
            t.ok(f"twin of {label}: {what} is the chart's with {twin}", not diff, diff)
