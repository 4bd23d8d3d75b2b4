#!/usr/bin/env python3
"""Offline checks of deploy/k8s and the Helm chart: renders every kustomization and value set,
validates every object, checks flags/env against the binaries' --help and the manifests' own
consistency; prints `<n> passed, <m> failed` last. (tests/deploy/plan.py writes the launch
plan that tests/deploy/entrypoints.sh runs.)

  manifests.py

Environment: BIN_DIR (the binaries, default target/release), KUBECTL (a kubectl with the
kustomize subcommand; default: `kubectl` on PATH), K8S_VERSIONS (Kubernetes versions to
validate against, comma separated, default 1.29.0,1.32.0,1.37.0; kubernetes-validate 1.37
knows 1.25-1.37).
Needs PyYAML and kubernetes-validate (tests/deploy/requirements.txt).
"""

import argparse
import os
import re
import sys
import tempfile

import yaml

import discovery
import fetch
import helm
import monitoring
import network
import twins
from objects import (FETCHER, K8S, Tally, binary_help, container_env, effective, env_dict,
                     etcd_statefulset, index, mib, pod_specs, port_of, port_security,
                     referenced_vars, render, split_args, tandem_binary, targets,
                     validate_object)
from selftest import selftest

# What a worker takes after its drain to close connections (runtime/src/worker.rs CLOSE_GRACE).
CLOSE_GRACE_S = 5
# Least margin a terminationGracePeriodSeconds must leave over what it has to cover.
MIN_MARGIN_S = 5
# Memory a worker needs beyond its configured cache (model, buffers, the process).
MEMORY_HEADROOM_MIB = 512
# A GPU as the device plugins name theirs (nvidia.com/gpu, amd.com/gpu).
GPU_RESOURCE_SUFFIX = "/gpu"
# The CUDA build's image repository ends so (deploy/Containerfile's `cuda` target).
CUDA_IMAGE_SUFFIX = "-cuda"
# Kinds outside any namespace; every other object must name its namespace, or `kubectl apply`
# puts it in whatever namespace the caller's context has (a component's resources do not get
# the base's `namespace:`).
CLUSTER_SCOPED = {"Namespace", "ClusterIssuer", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PersistentVolume", "PriorityClass", "StorageClass"}
# Files of TLS flags, which must come from a mounted Secret.
TLS_FILE_FLAGS = ("tls-cert", "tls-key", "tls-ca", "https-cert", "https-key",
                  "etcd-ca", "etcd-cert", "etcd-key")
# The keys of a kubernetes.io/tls Secret as cert-manager writes it: what a Secret made outside
# the manifests (not among the rendered objects) is taken to hold.
TLS_SECRET_KEYS = ("tls.crt", "tls.key", "ca.crt")


# ---------------------------------------------------------------------------------------------
# check


def check_target(t, label, objs, versions):
    # 1. Every object, strictly, against each Kubernetes version (custom resources against
    #    crd-schemas.yaml), and in a namespace.
    for o in objs:
        for v in versions:
            what = f"{label} {o.get('kind')}/{o.get('metadata', {}).get('name')} k8s {v}"
            try:
                validate_object(o, v)
                t.ok(what, True)
            except Exception as e:  # ValidationError, SchemaNotFoundError, ...
                t.ok(what, False, getattr(e, "message", None) or str(e).splitlines()[0])
        if o.get("kind") not in CLUSTER_SCOPED:
            meta = o.get("metadata") or {}
            t.ok(f"{label} {o.get('kind')}/{meta.get('name')} has a namespace",
                 bool(meta.get("namespace")),
                 "no metadata.namespace: kubectl apply would put it in the context's namespace")

    by_key = index(objs)

    # 2. Flags and env vars against the binaries' --help; manifest consistency per pod.
    tandem = []  # (container label, binary, its effective flags, the Secret of each TLS file)
    for wl, spec in pod_specs(objs):
        wl_label = f"{label} {wl['kind']}/{wl['metadata']['name']}"
        t.ok(f"{wl_label} runs as non-root",
             (spec.get("securityContext") or {}).get("runAsNonRoot") is True)
        mounts_by_volume = {v["name"]: v for v in spec.get("volumes") or []}
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            c_label = f"{wl_label} container {c['name']}"
            binary = tandem_binary(c)
            if binary is None:
                continue
            h = binary_help(binary)
            try:
                env = container_env(c, by_key)
            except KeyError as e:
                t.ok(c_label, False, str(e))
                continue
            helpers = referenced_vars(c)
            for name, value, where in env:
                info = h.env.get(name)
                if info is None and name in helpers:
                    continue  # only there for $(NAME) in the args, as POD_IP
                if t.ok(f"{c_label} env {name} ({where}) in {binary} --help", info is not None,
                        f"{binary} --help has no env var {name}"):
                    why = h.check_value(info, value)
                    t.ok(f"{c_label} env {name}={value!r}", why is None, why or "")
            for flag, value in split_args(c):
                if flag is None:
                    t.ok(f"{c_label} arg {value!r}", False, "a value without a flag")
                    continue
                info = h.options.get(flag)
                if t.ok(f"{c_label} --{flag} in {binary} --help", info is not None,
                        f"{binary} --help has no flag --{flag}"):
                    why = h.check_value(info, value)
                    t.ok(f"{c_label} --{flag}={value!r}", why is None, why or "")
            if binary == FETCHER:
                continue
            tandem.append((c_label, binary) + check_pod_consistency(
                t, c_label, wl, spec, c, env, binary, mounts_by_volume, by_key))

        # The model fetchers write where the binaries read.
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            dest = env_dict(container_env(c, by_key)).get("MODEL_DEST") if c.get("env") else None
            if dest is None:
                continue
            common = next((o for o in objs if o["kind"] == "ConfigMap"
                           and o["metadata"]["name"].startswith("tandem-common")), None)
            model = (common or {}).get("data", {}).get("TANDEM_MODEL")
            t.ok(f"{wl_label} {c['name']} MODEL_DEST is TANDEM_MODEL", dest == model,
                 f"MODEL_DEST {dest} but TANDEM_MODEL {model}")

    check_tls(t, label, objs, by_key, tandem)
    discovery.check(t, label, objs, by_key)

    # 3. HPAs and PDBs point at something.
    for o in objs:
        if o["kind"] == "HorizontalPodAutoscaler":
            ref = o["spec"]["scaleTargetRef"]
            t.ok(f"{label} HPA {o['metadata']['name']} targets {ref['kind']}/{ref['name']}",
                 (ref["kind"], ref["name"]) in by_key)
            t.ok(f"{label} HPA {o['metadata']['name']} min <= max",
                 o["spec"].get("minReplicas", 1) <= o["spec"]["maxReplicas"])
            target = by_key.get((ref["kind"], ref["name"]))
            t.ok(f"{label} {ref['kind']}/{ref['name']} leaves replicas to its HPA",
                 target is None or "replicas" not in target["spec"],
                 "spec.replicas would reset the HPA's count on every apply")
        if o["kind"] == "PodDisruptionBudget":
            sel = o["spec"]["selector"]["matchLabels"]
            hits = [w for w, _ in pod_specs(objs)
                    if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            t.ok(f"{label} PDB {o['metadata']['name']} selects a workload", bool(hits))
        if o["kind"] == "Deployment" and tandem_binary(
                o["spec"]["template"]["spec"]["containers"][0]):
            ru = (o["spec"].get("strategy") or {}).get("rollingUpdate") or {}
            t.ok(f"{label} Deployment/{o['metadata']['name']} rolls with maxUnavailable 0",
                 str(ru.get("maxUnavailable")) == "0")

    check_scalers(t, label, objs, by_key)
    check_routes(t, label, objs, by_key)

    # 4. Monitors select what serves /metrics; alerts, dashboard and adapter rules name
    #    metrics the binaries export.
    monitoring.check(t, label, objs, list(pod_specs(objs)))

    # 5. The NetworkPolicies allow what the processes do and nothing else.
    network.check(t, label, objs)


def check_scalers(t, label, objs, by_key):
    """Each KEDA ScaledObject scales a rendered Deployment that leaves its replicas to it and
    that no HPA scales as well (KEDA makes its own)."""
    hpas = {o["spec"]["scaleTargetRef"]["name"] for o in objs
            if o["kind"] == "HorizontalPodAutoscaler"}
    for o in objs:
        if o["kind"] != "ScaledObject":
            continue
        spec, name = o["spec"], o["metadata"]["name"]
        ref = spec["scaleTargetRef"]
        kind = ref.get("kind", "Deployment")
        target = by_key.get((kind, ref["name"]))
        t.ok(f"{label} ScaledObject {name} targets {kind}/{ref['name']}", target is not None)
        t.ok(f"{label} ScaledObject {name}: {ref['name']} leaves replicas to it",
             target is None or "replicas" not in target["spec"],
             "spec.replicas would reset KEDA's count on every apply")
        t.ok(f"{label} ScaledObject {name}: no HPA scales {ref['name']} too",
             ref["name"] not in hpas, "two autoscalers fight over one count")
        t.ok(f"{label} ScaledObject {name} min <= max",
             spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100))


def check_routes(t, label, objs, by_key):
    """Each Ingress and HTTPRoute sends its traffic to a port of a rendered Service."""
    backends = []  # (what, Service name, port number)
    for o in objs:
        what = f"{label} {o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Ingress":
            backends += [(what, p["backend"]["service"]["name"],
                          p["backend"]["service"]["port"].get("number"))
                         for r in o["spec"]["rules"] for p in r["http"]["paths"]]
        elif o["kind"] == "HTTPRoute":
            backends += [(what, b["name"], b.get("port")) for r in o["spec"]["rules"]
                         for b in r.get("backendRefs") or []]
    for what, service, port in backends:
        svc = by_key.get(("Service", service))
        ports = [p["port"] for p in (svc or {}).get("spec", {}).get("ports", [])]
        t.ok(f"{what} sends to Service {service} port {port}", port in ports,
             f"Service {service} {'has ports ' + str(ports) if svc else 'is not rendered'}")


def check_pod_consistency(t, c_label, wl, spec, c, env, binary, volumes, by_key):
    eff = effective(c, env, binary)
    grace = spec.get("terminationGracePeriodSeconds", 30)
    ports = {p["containerPort"] for p in c.get("ports") or []}
    mounts = c.get("volumeMounts") or []

    def mounted(path):
        return mount_of(mounts, path)

    model = eff.get("model") or ""
    if model.startswith("/"):
        m = mounted(model)
        t.ok(f"{c_label} the model {model} is on a read-only volume",
             m is not None and m.get("readOnly") is True, "not under a readOnly volumeMount")
    else:
        check_hub_model(t, c_label, spec, model, env_dict(env), mounted, by_key)

    listen = eff.get("listen") or ""
    lport = port_of(listen)
    t.ok(f"{c_label} listens on all addresses ({listen})", listen.startswith("0.0.0.0:"))
    t.ok(f"{c_label} listen port {lport} is a containerPort", lport in ports)
    security = port_security(eff, binary)
    named = {pp.get("name"): pp["containerPort"] for pp in c.get("ports") or []}
    # Probes and Prometheus ask the operations listener, never the API's port (whose clients
    # must not read the cluster's state) nor a worker's gRPC port (whose mutual TLS the
    # kubelet cannot pass: it holds no client certificate).
    pport = port_of(eff.get("metrics-listen"))
    t.ok(f"{c_label} metrics-listen port {pport} is a containerPort apart from the listen port",
         pport in ports and pport != lport)
    annotations = (wl["spec"]["template"].get("metadata") or {}).get("annotations") or {}
    if annotations.get("prometheus.io/scrape") == "true":
        t.ok(f"{c_label} prometheus.io/port is the metrics-listen port ({pport})",
             str(annotations.get("prometheus.io/port")) == str(pport))
        want = "https" if security.get(pport) == "server" else "http"
        t.ok(f"{c_label} prometheus.io/scheme is {want}",
             annotations.get("prometheus.io/scheme", "http") == want)
    for probe, paths in PROBE_PATHS.items():
        p = c.get(probe)
        if not t.ok(f"{c_label} has a {probe}", p is not None):
            continue
        kind, port = probe_target(p, named)
        t.ok(f"{c_label} {probe} ({kind}) port {port} is the metrics-listen port",
             port == pport)
        if not t.ok(f"{c_label} {probe} is an httpGet", kind == "httpGet", f"a {kind} probe"):
            continue
        path = p["httpGet"].get("path")
        t.ok(f"{c_label} {probe} asks {path}, one of {', '.join(paths)}", path in paths,
             "/health/ready is the one that turns 503 while loading and draining")
        scheme = p["httpGet"].get("scheme", "HTTP")
        want = "HTTPS" if security.get(port) == "server" else "HTTP"
        t.ok(f"{c_label} {probe} scheme {scheme} is the probed port's ({want})",
             scheme == want)

    # TLS files come from Secret volumes mounted whole (a subPath mount never sees a renewal).
    tls_secrets = {}
    for flag in TLS_FILE_FLAGS:
        path = eff.get(flag)
        if not path:
            continue
        secret, why = secret_file(path, mounts, volumes, by_key)
        tls_secrets[flag] = secret
        t.ok(f"{c_label} --{flag} {path} is a file of a mounted Secret", why is None, why or "")

    if binary == "tandem-router":
        stop = ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command")
        sleep = int(stop[1]) if stop and stop[0] == "sleep" else 0
        timeout = int(eff.get("request-timeout-ms") or binary_help(binary).options[
            "request-timeout-ms"]["default"]) / 1000
        t.ok(f"{c_label} terminationGracePeriodSeconds {grace} covers preStop {sleep} s + "
             f"request timeout {timeout:g} s + {MIN_MARGIN_S} s",
             grace >= sleep + timeout + MIN_MARGIN_S)
        keyfile = eff.get("api-key-file")
        if keyfile:
            km = mounted(keyfile)
            vol = volumes.get(km["name"]) if km else None
            ok = False
            if vol and "secret" in vol:
                secret = next((o for (k, n), o in by_key.items()
                               if k == "Secret" and n == vol["secret"]["secretName"]), None)
                rel = os.path.relpath(keyfile, km["mountPath"])
                ok = secret is not None and rel in (secret.get("data") or {})
            t.ok(f"{c_label} --api-key-file {keyfile} is a key of a mounted Secret", ok)
    else:
        drain = int(eff.get("drain-grace-s") or binary_help(binary).options[
            "drain-grace-s"]["default"])
        t.ok(f"{c_label} terminationGracePeriodSeconds {grace} covers drain {drain} s + close "
             f"{CLOSE_GRACE_S} s + {MIN_MARGIN_S} s", grace >= drain + CLOSE_GRACE_S + MIN_MARGIN_S)
        adv = eff.get("advertise-addr") or ""
        t.ok(f"{c_label} advertises the pod IP on the listen port ({adv})",
             adv == f"$(POD_IP):{lport}" and any(
                 e.get("name") == "POD_IP" and e.get("valueFrom", {}).get("fieldRef", {}).get(
                     "fieldPath") == "status.podIP" for e in c.get("env") or []))
        # Found by the routers: registered in etcd, or its pool's EndpointSlices followed
        # (discovery.py checks the Services and the permissions).
        followed = any("TANDEM_KUBE_SELECTOR" in (o.get("data") or {})
                       for (kind, _), o in by_key.items() if kind == "ConfigMap")
        t.ok(f"{c_label} registers in etcd or is followed through EndpointSlices",
             bool(eff.get("etcd-endpoints")) or followed)
        check_worker_memory(t, c_label, c, eff, binary)
    return eff, tls_secrets


def check_worker_memory(t, c_label, c, eff, binary):
    """A worker's caches fit where they are held: in the pod's memory on the CPU; on a GPU
    (--device cuda) in the GPU's, which the pod must then be given (and only then: a GPU a
    pod holds and does not use is lost to the cluster), running the CUDA build."""
    cache = {"tandem-decode": "kv-cache-mb", "tandem-prefill": "prefix-cache-mb"}[binary]
    cache_mib = int(eff.get(cache) or binary_help(binary).options[cache]["default"])
    limits = (c.get("resources") or {}).get("limits") or {}
    limit = limits.get("memory")
    gpus = sum(int(v) for k, v in limits.items() if k.endswith(GPU_RESOURCE_SUFFIX))
    on_gpu = (eff.get("device") or binary_help(binary).options["device"]["default"]) \
        .startswith("cuda")
    image = c.get("image") or ""
    cuda_build = repository(image).endswith(CUDA_IMAGE_SUFFIX)
    if on_gpu:
        t.ok(f"{c_label} computes on a GPU and is given exactly one ({gpus})", gpus == 1)
        t.ok(f"{c_label} computes on a GPU in the CUDA build ({image})", cuda_build)
        t.ok(f"{c_label} memory limit {limit} covers {MEMORY_HEADROOM_MIB} MiB (--{cache} "
             f"{cache_mib} is in the GPU's)",
             limit is not None and mib(limit) >= MEMORY_HEADROOM_MIB)
        return
    t.ok(f"{c_label} computes on the CPU and holds no GPU ({gpus})", gpus == 0)
    t.ok(f"{c_label} computes on the CPU in the CPU build ({image})", not cuda_build)
    t.ok(f"{c_label} memory limit {limit} covers --{cache} {cache_mib} + "
         f"{MEMORY_HEADROOM_MIB} MiB",
         limit is not None and mib(limit) >= cache_mib + MEMORY_HEADROOM_MIB)


def repository(image):
    """An image reference's repository: without its digest or tag, keeping a registry's
    port (`registry:5000/tandem-cuda:1` is `registry:5000/tandem-cuda`)."""
    name = image.split("@")[0]
    head, _, tag = name.rpartition(":")
    return head if head and "/" not in tag else name


def mount_of(mounts, path):
    """The volumeMount of `mounts` that `path` lies under (or is), else None."""
    return next((m for m in mounts if path == m["mountPath"]
                 or path.startswith(m["mountPath"].rstrip("/") + "/")), None)


def hub_cache(env):
    """The Hugging Face cache folder `env` gives (hub/src/lib.rs Options::from_vars)."""
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    return os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else None


def check_hub_model(t, c_label, spec, model, env, mounted, by_key):
    """A model named on the Hub: the binary finds it offline in a cache on a read-only
    volume, which an init container running tandem-fetch filled with the same name."""
    t.ok(f"{c_label} finds the Hub model {model} offline (HF_HUB_OFFLINE=1)",
         env.get("HF_HUB_OFFLINE") == "1",
         "a serving container fetching on its own writes to its model volume")
    cache = hub_cache(env)
    m = mounted(cache) if cache else None
    t.ok(f"{c_label} the Hub cache {cache} is on a read-only volume",
         m is not None and m.get("readOnly") is True, "not under a readOnly volumeMount")
    fetchers = [c for c in spec.get("initContainers") or [] if tandem_binary(c) == FETCHER]
    ok = False
    for f in fetchers:
        f_env = env_dict(container_env(f, by_key))
        f_cache = hub_cache(f_env)
        fm = mount_of(f.get("volumeMounts") or [], f_cache) if f_cache else None
        ok = ok or (f_env.get("TANDEM_MODEL") == model and f_env.get("HF_HUB_OFFLINE") != "1"
                    and fm is not None and m is not None and fm["name"] == m["name"]
                    and os.path.relpath(f_cache, fm["mountPath"])
                    == os.path.relpath(cache, m["mountPath"]) and not fm.get("readOnly"))
    t.ok(f"{c_label} an init container fetches {model} into the same cache", ok,
         f"no {FETCHER} init container writes {model} to the volume at {cache}")


# What each probe may ask the operations listener: readiness is /health/ready (503 while the
# model loads and once the drain starts), liveness /health (the process answers); a startup
# probe either (a worker's waits for the model, a router's only for the process).
PROBE_PATHS = {
    "livenessProbe": ("/health",),
    "readinessProbe": ("/health/ready",),
    "startupProbe": ("/health", "/health/ready"),
}


def probe_target(probe, named_ports):
    """(handler, port) of a probe: httpGet, tcpSocket and grpc with their port (names
    resolved), exec with the port of a bash /dev/tcp/127.0.0.1/PORT connection in its command
    (None if it has none)."""
    for kind in ("httpGet", "tcpSocket", "grpc"):
        if kind in probe:
            port = probe[kind]["port"]
            return kind, named_ports.get(port, port)
    if "exec" in probe:
        m = re.search(r"/dev/tcp/(?:127\.0\.0\.1|localhost)/(\d+)",
                      " ".join(probe["exec"].get("command") or []))
        return "exec", int(m.group(1)) if m else None
    return None, None


def secret_file(path, mounts, volumes, by_key):
    """(Secret name, None) when `path` is a key of a Secret volume mounted read-only and whole,
    else (name or None, why not). A Secret not among the rendered objects (made by
    cert-manager or kubectl) is taken to hold TLS_SECRET_KEYS."""
    m = mount_of(mounts, path)
    vol = volumes.get(m["name"]) if m else None
    if not vol or "secret" not in vol:
        return None, "not under a Secret volume"
    name = vol["secret"]["secretName"]
    if m.get("subPath"):
        return name, f"Secret {name} is mounted by subPath: a renewed Secret never reaches it"
    if m.get("readOnly") is not True:
        return name, f"Secret {name} is not mounted readOnly"
    rel = os.path.relpath(path, m["mountPath"])
    items = vol["secret"].get("items")
    if items:
        key = next((i["key"] for i in items if i["path"] == rel), None)
        if key is None:
            return name, f"no item of Secret {name} is mounted as {rel}"
    else:
        key = rel
    secret = by_key.get(("Secret", name))
    keys = list((secret.get("data") or {}) if secret else TLS_SECRET_KEYS)
    if key not in keys:
        return name, f"Secret {name} has no key {key} (keys: {keys})"
    return name, None


def check_tls(t, label, objs, by_key, tandem):
    """TLS across the pods of one rendering: mutual TLS on every gRPC hop or on none, one
    server name, etcd dialed over TLS exactly when the rendered etcd serves it, and
    cert-manager Certificates that fit how their Secrets are used."""
    if not tandem:
        return
    certs = {}
    for o in objs:
        if o["kind"] == "Certificate" and o["apiVersion"].startswith("cert-manager.io/"):
            certs[o["spec"].get("secretName")] = o

    def cert_has(what, cert, usages=(), names=(), uris=()):
        have = cert["spec"].get("usages") or ["digital signature", "key encipherment"]
        cname = cert["metadata"]["name"]
        if usages:
            t.ok(f"{what}: Certificate/{cname} has usages {', '.join(usages)}",
                 all(u in have for u in usages), f"usages {have}")
        for n in names:
            t.ok(f"{what}: Certificate/{cname} carries the name {n}",
                 n in (cert["spec"].get("dnsNames") or []),
                 f"dnsNames {cert['spec'].get('dnsNames')}")
        for u in uris:
            t.ok(f"{what}: Certificate/{cname} carries the role URI {u}",
                 u in (cert["spec"].get("uris") or []), f"uris {cert['spec'].get('uris')}")

    etcd = etcd_statefulset(objs)
    if etcd:
        espec = etcd["spec"]["template"]["spec"]
        ec = next(c for c in espec["containers"] if c["name"] == "etcd")
        args = dict(split_args(ec))
        https = (args.get("listen-client-urls") or "").startswith("https://")
        for c_label, _, eff, _ in tandem:
            t.ok(f"{c_label} dials etcd over TLS exactly when etcd serves TLS ({https})",
                 bool(eff.get("etcd-ca")) == https,
                 f"etcd listens on {args.get('listen-client-urls')}, TANDEM_ETCD_CA is "
                 f"{eff.get('etcd-ca')!r}")
            if "client-cert-auth" in args:
                t.ok(f"{c_label} presents a certificate to etcd (--client-cert-auth)",
                     bool(eff.get("etcd-cert")))
        if https:
            volumes = {v["name"]: v for v in espec.get("volumes") or []}
            secret = None
            for flag in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file",
                         "peer-key-file", "peer-trusted-ca-file"):
                if args.get(flag):
                    sname, why = secret_file(args[flag], ec.get("volumeMounts") or [], volumes,
                                         by_key)
                    secret = secret or sname
                    t.ok(f"{label} etcd --{flag} is a file of a mounted Secret", why is None,
                         why or "")
            cert = certs.get(secret)
            if cert is not None:
                # The names dialed: the binaries' endpoints, and the peers' --initial-cluster.
                dialed = {e.rsplit(":", 1)[0].split("://")[-1] for _, _, eff, _ in tandem
                          for e in (eff.get("etcd-endpoints") or "").split(",") if e}
                dialed |= set(re.findall(r"=https://([^:,]+):", args.get("initial-cluster", "")))
                cert_has(f"{label} etcd", cert,
                         ("server auth", "client auth") if "peer-cert-file" in args
                         else ("server auth",), sorted(dialed))
    on = {c_label: bool(eff.get("tls-cert")) for c_label, _, eff, _ in tandem}
    t.ok(f"{label} mutual TLS on all of router, prefill and decode, or on none",
         len(set(on.values())) == 1,
         "a process with TLS and one without cannot talk: "
         + ", ".join(f"{k.split(' container ')[-1]}={v}" for k, v in on.items()))
    names = {eff.get("tls-server-name") for _, _, eff, _ in tandem if eff.get("tls-cert")}
    t.ok(f"{label} one TLS server name for every dialer", len(names) <= 1, str(sorted(
        n or "(none)" for n in names)))

    if not certs:
        return
    issuers = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Issuer"}
    ca_secrets = {s for s, o in certs.items() if o["spec"].get("isCA")}
    for o in certs.values():
        name, ref = o["metadata"]["name"], o["spec"]["issuerRef"]
        if ref.get("kind", "Issuer") == "Issuer":
            issuer = issuers.get(ref["name"])
            t.ok(f"{label} Certificate/{name} issuer {ref['name']} is rendered", issuer is not None)
            ca = ((issuer or {}).get("spec") or {}).get("ca")
            if ca:
                t.ok(f"{label} Issuer/{ref['name']} signs with a CA Certificate's Secret",
                     ca["secretName"] in ca_secrets,
                     f"no isCA Certificate writes {ca['secretName']}")
    # What each use of a Secret needs from the certificate in it. Dialers check the TLS server
    # name on the workers' certificates (they dial pod IPs).
    for c_label, binary, eff, secrets in tandem:
        for flag, needs in (("tls-cert", ("server auth", "client auth")),
                            ("https-cert", ("server auth",)),
                            ("etcd-cert", ("client auth",))):
            cert = certs.get(secrets.get(flag))
            if cert is not None:
                server_names = sorted(names - {None}) if (
                    flag == "tls-cert" and binary != "tandem-router") else ()
                # The role the binary's peers check (docs/security.md, "Roles").
                roles = (f"spiffe://tandem/{binary.removeprefix('tandem-')}",) if (
                    flag == "tls-cert") else ()
                cert_has(f"{c_label} --{flag}", cert, needs, server_names, roles)


def check_tree(t, k8s, versions, only=None, chart=helm.CHART):
    if not only or "base" in only:
        helm.check_base(t, k8s, chart)
    with tempfile.TemporaryDirectory() as tmp:
        kustomized = [(label, path, render, versions) for label, path in targets(tmp, k8s)]
        charted = [(label, values, lambda v: helm.render(v, chart),
                    helm.validated_on(values, versions)) for label, values in helm.targets()]
        rendered = {}
        for label, path, render_with, on in kustomized + charted:
            if only and label not in only:
                continue
            try:
                objs = render_with(path)
            except RuntimeError as e:
                t.ok(f"render {label}", False, str(e))
                continue
            rendered[label] = objs
            t.ok(f"render {label} ({len(objs)} objects)", bool(objs))
            if not t.quiet:
                print(f"rendered {label}: {len(objs)} objects", flush=True)
            try:
                check_target(t, label, objs, on)
                if os.path.isdir(path):
                    check_images(t, label, path, objs)
            except Exception as e:  # a broken manifest must fail the run, not crash it
                t.ok(f"check {label}", False, f"{type(e).__name__}: {e}")
        twins.check(t, k8s, rendered, chart, only)


def check_images(t, label, path, objs):
    """Each `images` entry of a kustomization renames an image that reaches it: one that
    names the image the base has already renamed changes nothing, silently."""
    with open(os.path.join(path, "kustomization.yaml")) as f:
        entries = (yaml.safe_load(f) or {}).get("images") or []
    running = {c["image"] for _, spec in pod_specs(objs)
               for c in spec.get("containers", []) + spec.get("initContainers", [])}
    for e in entries:
        want = f"{e.get('newName', e['name'])}:{e['newTag']}" if "newTag" in e \
            else e.get("newName", e["name"])
        t.ok(f"{label} images entry {e['name']} renames an image its pods run ({want})",
             any(i == want or i.startswith(want + ":") for i in running),
             f"its pods run {sorted(running)}")


def cmd_check():
    versions = os.environ.get("K8S_VERSIONS", "1.29.0,1.32.0,1.37.0")
    versions = [v.strip() for v in versions.split(",") if v.strip()]
    t = Tally()
    check_tree(t, K8S, versions)
    fetch.check(t)
    selftest(t, versions, check_tree)
    print(f"{t.passed} passed, {t.failed} failed")
    return 1 if t.failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.parse_args()
    return cmd_check()


if __name__ == "__main__":
    sys.exit(main())
