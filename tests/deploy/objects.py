"""The deploy checks' common ground: rendering the kustomize tree, validating objects against
Kubernetes' and the CRDs' schemas, reading the binaries' --help, and resolving a container's
command and environment as its pod would see them; plus the pass/fail tally."""

import os
import re
import shutil
import subprocess
import sys

import yaml


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.environ.get("DEPLOY_K8S") or os.path.join(ROOT, "deploy", "k8s")
BINARIES = ("tandem-router", "tandem-prefill", "tandem-decode", "tandem-fetch")
# The init container's binary that fetches a Hub model for the others (hub/src/bin).
FETCHER = "tandem-fetch"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
# Schemas of the custom resources the manifests use (kubernetes-validate knows built-in kinds).
CRD_SCHEMAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crd-schemas.yaml")
# Components meant to be used together: rendered and checked together on the base as well.
COMBINATIONS = [("mtls", "cert-manager-certs"), ("model-fetch-init", "mtls")]


# ---------------------------------------------------------------------------------------------
# Rendering


def kubectl():
    k = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not k:
        sys.exit("no kubectl: set KUBECTL, or run tests/deploy/get-kubectl.sh (see deploy/README.md)")
    return k


def render(path):
    """Objects of the kustomization at `path`, rendered by `kubectl kustomize`."""
    r = subprocess.run([kubectl(), "kustomize", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip() or f"kubectl kustomize {path} failed")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def kustomization_kind(path):
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        f = os.path.join(path, name)
        if os.path.exists(f):
            with open(f) as fh:
                return (yaml.safe_load(fh) or {}).get("kind", "Kustomization")
    return None


def targets(tmp, k8s=None):
    """(label, path) of everything to render: the base, each overlay, base + each component,
    and base + each of COMBINATIONS (a component renders only inside a kustomization: one is
    written for it under `tmp`)."""
    k8s = k8s or K8S
    out = [("base", os.path.join(k8s, "base"))]

    def wrap(names):
        d = os.path.join(tmp, "+".join(names))
        os.makedirs(d)
        with open(os.path.join(d, "kustomization.yaml"), "w") as f:
            yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(os.path.join(k8s, "base"), d)],
                "components": [os.path.relpath(os.path.join(k8s, "components", n), d)
                               for n in names],
            }, f)
        return ("base+" + "+".join(f"components/{n}" for n in names), d)

    components = []
    for group in ("overlays", "components"):
        d = os.path.join(k8s, group)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            path = os.path.join(d, name)
            kind = kustomization_kind(path)
            if kind is None:
                continue
            if kind == "Component":
                components.append(name)
                out.append(wrap([name]))
            else:
                out.append((f"{group}/{name}", path))
    for names in COMBINATIONS:
        if all(n in components for n in names):
            out.append(wrap(list(names)))
    return out


# ---------------------------------------------------------------------------------------------
# The binaries' --help


class Help:
    """Flags, aliases, env twins, value kinds and possible values from one binary's --help."""

    OPTION = re.compile(r"^\s*(?:-\w,\s*)?--([A-Za-z][\w-]*)(?:\s+<([^>]+)>)?")

    def __init__(self, binary, text):
        self.binary = binary
        self.options = {}  # flag name -> info
        self.env = {}  # env name -> info
        block = None
        blocks = []
        environment = False
        for line in text.splitlines():
            # The section the Hub's variables are listed in (hub::ENV_HELP): `  NAME  what`.
            if line.startswith("Environment"):
                environment, block = True, None
                continue
            if environment:
                v = re.match(r"^\s+([A-Z][A-Z0-9_]+)\s", line)
                if v:
                    self.env[v.group(1)] = {"flag": None, "takes_value": True, "env": v.group(1),
                                            "default": None, "values": []}
                continue
            m = self.OPTION.match(line)
            if m:
                block = {"flag": m.group(1), "takes_value": m.group(2) is not None, "text": [line]}
                blocks.append(block)
            elif block is not None:
                block["text"].append(line)
        for b in blocks:
            text = "\n".join(b["text"])
            env = re.search(r"\[env: ([A-Z0-9_]+)", text)
            default = re.search(r"\[default: ([^\]]*)\]", text)
            values = re.findall(r"^\s+- ([\w-]+):", text, re.M)
            aliases = []
            for a in re.findall(r"\[aliases?: ([^\]]+)\]", text):
                aliases += [x.strip().lstrip("-") for x in a.split(",")]
            info = {
                "flag": b["flag"],
                "takes_value": b["takes_value"],
                "env": env.group(1) if env else None,
                "default": default.group(1) if default else None,
                "values": values,
            }
            for name in [b["flag"]] + aliases:
                self.options[name] = info
            if info["env"]:
                self.env[info["env"]] = info

    def check_value(self, info, value):
        """None if `value` fits the option, else why not."""
        if not info["takes_value"]:
            # A switch's env twin takes true/false; as a flag it takes no value.
            if value is not None and value.lower() not in ("true", "false"):
                return f"switch given {value!r}"
            return None
        if value is None or value == "":
            return "needs a value"
        if info["values"] and value not in info["values"]:
            return f"{value!r} is none of {info['values']}"
        if info["default"] is not None and re.fullmatch(r"\d+", info["default"]):
            if not re.fullmatch(r"\d+", value):
                return f"{value!r} is not a whole number (default {info['default']})"
        return None


_HELP = {}


def binary_help(name):
    if name not in _HELP:
        bin_dir = os.environ.get("BIN_DIR", os.path.join(ROOT, "target", "release"))
        path = os.path.join(bin_dir, name)
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} not found: build it, or set BIN_DIR")
        r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{path} --help exited {r.returncode}: {r.stderr.strip()}")
        _HELP[name] = Help(name, r.stdout)
    return _HELP[name]


# ---------------------------------------------------------------------------------------------
# Schema validation


_CRDS = None
_DEFINITIONS = {}
_VALIDATORS = {}


def crd_schema(api_version, kind):
    """The schema crd-schemas.yaml has for a custom resource, else None."""
    global _CRDS
    if _CRDS is None:
        with open(CRD_SCHEMAS) as f:
            _CRDS = yaml.safe_load(f) or {}
    return (_CRDS.get(api_version) or {}).get(kind)


def validate_object(o, version):
    """Validates `o` strictly (unknown fields fail) for Kubernetes `version`: built-in kinds
    with kubernetes-validate's schemas, custom resources with crd-schemas.yaml (their metadata
    against that version's ObjectMeta). Raises on a failure, and SchemaNotFoundError for a kind
    that neither knows."""
    import kubernetes_validate
    schema = crd_schema(o.get("apiVersion"), o.get("kind"))
    if schema is None:
        kubernetes_validate.validate(o, version, strict=True)
        return
    import jsonschema
    from kubernetes_validate import utils
    from packaging.version import Version
    from referencing import Registry, Resource

    mm = Version(utils.major_minor(version))
    known = [v for v in utils.all_versions() if Version(utils.major_minor(v)) <= mm]
    if not known:
        raise utils.VersionNotSupportedError(version)
    schema_version = known[-1]
    key = (o["apiVersion"], o["kind"], schema_version)
    if key not in _VALIDATORS:
        if schema_version not in _DEFINITIONS:
            _DEFINITIONS[schema_version] = utils.schema_contents(
                f"kubernetes-json-schema/v{schema_version}-local-strict/_definitions.json",
                version)
        full = dict(schema)
        full["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        group_version = o["apiVersion"].replace("/", "-")
        full["$id"] = f"https://kubernetes.io/api/crd/{group_version}/{o['kind'].lower()}"
        registry = Resource.from_contents(_DEFINITIONS[schema_version]) @ Registry()
        _VALIDATORS[key] = jsonschema.validators.Draft202012Validator(full, registry=registry)
    error = jsonschema.exceptions.best_match(_VALIDATORS[key].iter_errors(o))
    if error is not None:
        where = ".".join(str(x) for x in error.absolute_path)
        error.message = f"{where}: {error.message}" if where else error.message
        raise error


# ---------------------------------------------------------------------------------------------
# Reading pods out of the rendered objects


def etcd_statefulset(objs):
    """The StatefulSet that runs etcd, found by its app.kubernetes.io/name label (the chart
    names it after the release), or None."""
    return next((o for o in objs if o["kind"] == "StatefulSet" and o["spec"]["template"][
        "metadata"]["labels"].get("app.kubernetes.io/name") == "etcd"), None)


def index(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def pod_specs(objs):
    """(workload, pod spec) of every workload."""
    for o in objs:
        if o["kind"] in WORKLOADS:
            yield o, o["spec"]["template"]["spec"]


def tandem_binary(container):
    cmd = container.get("command") or []
    return os.path.basename(cmd[0]) if cmd and os.path.basename(cmd[0]) in BINARIES else None


def split_args(container):
    """[(flag, value or None)] of a container's command tail and args: `--f=v`, `--f v`, `--f`."""
    items = list((container.get("command") or [])[1:]) + list(container.get("args") or [])
    out = []
    i = 0
    while i < len(items):
        a = items[i]
        if not a.startswith("--"):
            out.append((None, a))
        elif "=" in a:
            name, value = a[2:].split("=", 1)
            out.append((name, value))
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            out.append((a[2:], items[i + 1]))
            i += 1
        else:
            out.append((a[2:], None))
        i += 1
    return out


def container_env(container, objs_by_key, field_values=None):
    """[(name, value, where)] of a container's environment as Kubernetes builds it: envFrom
    sources first, then `env` (later entries win). Values of fieldRef come from field_values."""
    field_values = field_values or {}
    out = []
    for src in container.get("envFrom") or []:
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in src:
                name = src[key]["name"]
                obj = objs_by_key.get((kind, name))
                if obj is None:
                    raise KeyError(f"envFrom {kind} {name} is not among the rendered objects")
                for k, v in (obj.get("data") or {}).items():
                    out.append((src.get("prefix", "") + k, v, f"{kind} {name}"))
    for e in container.get("env") or []:
        if "value" in e:
            out.append((e["name"], e["value"], "env"))
        elif "valueFrom" in e:
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                path = vf["fieldRef"]["fieldPath"]
                out.append((e["name"], field_values.get(path, f"<{path}>"), f"fieldRef {path}"))
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind = "ConfigMap" if "configMapKeyRef" in vf else "Secret"
                ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
                obj = objs_by_key.get((kind, ref["name"]))
                if obj is None and kind == "Secret":
                    # Made outside the manifests (a token the operator holds).
                    out.append((e["name"], f"<Secret {ref['name']}>", f"Secret {ref['name']}"))
                    continue
                if obj is None or ref["key"] not in (obj.get("data") or {}):
                    raise KeyError(f"{kind} {ref['name']} has no key {ref['key']}")
                out.append((e["name"], obj["data"][ref["key"]], f"{kind} {ref['name']}"))
            else:
                out.append((e["name"], "", "valueFrom"))
        else:
            out.append((e["name"], "", "env"))
    return out


def env_dict(env):
    d = {}
    for name, value, _ in env:
        d[name] = value
    return d


def expand(text, env):
    """Kubernetes' $(VAR) expansion in command and args ($$ escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def referenced_vars(container):
    items = list(container.get("command") or []) + list(container.get("args") or [])
    return {v for a in items for v in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a)}


def effective(container, env, binary):
    """{flag: value} a binary ends up with, from args (which win) and env twins."""
    h = binary_help(binary)
    out = {}
    for name, value, _ in env:
        info = h.env.get(name)
        if info and info["flag"]:
            out[info["flag"]] = value
    for flag, value in split_args(container):
        if flag and flag in h.options:
            out[h.options[flag]["flag"]] = value
    return out


def port_of(addr):
    """The port of a HOST:PORT flag value, or None."""
    return int(addr.rsplit(":", 1)[1]) if addr and ":" in addr else None


def port_security(eff, binary):
    """{port: "mutual", "server" or "plain"} of a Tandem binary's listeners, from its
    effective flags: a worker's gRPC port with --tls-cert asks every caller for a certificate
    of the CA (mutual); the router's API and operations ports with --https-cert are TLS that
    asks for none (server); a worker's operations listener is always plain HTTP."""
    out = {}
    if binary == "tandem-router":
        tls = "server" if eff.get("https-cert") else "plain"
        for flag in ("listen", "metrics-listen"):
            out[port_of(eff.get(flag))] = tls
    else:
        out[port_of(eff.get("listen"))] = "mutual" if eff.get("tls-cert") else "plain"
        out[port_of(eff.get("metrics-listen"))] = "plain"
    out.pop(None, None)
    return out


def mib(quantity):
    """A memory quantity in MiB."""
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2,
             "k": 1e3 / 2 ** 20, "M": 1e6 / 2 ** 20, "G": 1e9 / 2 ** 20, "T": 1e12 / 2 ** 20}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", str(quantity))
    if not m:
        raise ValueError(f"memory quantity {quantity!r}")
    return float(m.group(1)) * (units[m.group(2)] if m.group(2) else 1 / 2 ** 20)


# ---------------------------------------------------------------------------------------------
# Tally


class Tally:
    """Counts passed and failed checks, printing each failure unless quiet."""

    def __init__(self, quiet=False):
        self.passed = 0
        self.failed = 0
        self.quiet = quiet
        self.failures = []

    def ok(self, label, cond, detail=""):
        if cond:
            self.passed += 1
        else:
            self.failed += 1
            line = f"{label}{': ' + detail if detail else ''}"
            self.failures.append(line)
            if not self.quiet:
                print(f"FAIL {line}", flush=True)
        return cond
