"""The NetworkPolicies of one rendering, evaluated as Kubernetes would: every connection the
processes make is allowed, and nothing else reaches the workers or etcd, or leaves the pods
(default deny in both directions).

The peers that are not in the rendering stand for what a cluster has around it: a client on
the internet, a pod of another namespace, Prometheus in `monitoring`, the cluster DNS, PyPI,
an etcd outside the namespace (for renderings that do not run their own), and a trace
collector."""

import ipaddress
import re

from objects import FETCHER, container_env, effective, index, pod_specs, tandem_binary

NAMESPACE = "tandem"
SCRAPERS = "monitoring"
# Every Tandem pod's operations listener (--metrics-listen): probes and Prometheus.
OPS_PORT = 9464


def pod(ns, labels, ports=None, name=None):
    return {"ns": ns, "labels": labels, "ports": ports or {}, "name": name or ns}


def ip(addr, name):
    return {"ip": addr, "name": name}


CLIENT = ip("203.0.113.9", "a client on the internet")
STRANGER = pod("other", {"app": "curious"}, name="a pod of another namespace")
SCRAPER = pod(SCRAPERS, {"app.kubernetes.io/name": "prometheus"}, name="Prometheus")
DNS = pod("kube-system", {"k8s-app": "kube-dns"}, {"dns": 53}, name="kube-dns")
PYPI = ip("151.101.0.223", "PyPI")
OUTSIDE_ETCD = ip("10.0.0.9", "an etcd outside the namespace")
API_SERVER = ip("10.0.0.1", "the API server")
COLLECTOR = ip("10.1.2.3", "the trace collector")
# The port of an OTLP/gRPC collector that names none.
OTLP_PORT = 4317


def selects(selector, labels):
    """Whether a LabelSelector matches `labels` (an empty selector matches everything)."""
    selector = selector or {}
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def peer_matches(peer, policy_ns, other):
    """Whether one `from`/`to` entry of a policy in `policy_ns` covers `other`."""
    if "ipBlock" in peer:
        if "ip" not in other:
            return False
        block = peer["ipBlock"]
        addr = ipaddress.ip_address(other["ip"])
        net = ipaddress.ip_network(block["cidr"])
        if addr.version != net.version or addr not in net:
            return False
        return not any(addr in ipaddress.ip_network(x) for x in block.get("except") or []
                       if ipaddress.ip_network(x).version == addr.version)
    if "ip" in other:
        return False
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": other["ns"]})
    else:
        ns_ok = other["ns"] == policy_ns
    return ns_ok and selects(peer.get("podSelector"), other["labels"])


def port_matches(ports, port, protocol, dst):
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            want = dst.get("ports", {}).get(want)
        if want == port or (p.get("endPort") and want <= port <= p["endPort"]):
            return True
    return False


def types(policy):
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def side_allows(policies, me, other, direction, port, protocol, dst):
    """Whether `me`'s policies let traffic with `other` through in `direction`."""
    if "ip" in me:
        return True  # outside the cluster: no policy applies
    kind, rules_key, peers_key = (("Egress", "egress", "to") if direction == "out"
                                  else ("Ingress", "ingress", "from"))
    mine = [p for p in policies if p["metadata"].get("namespace") == me["ns"]
            and kind in types(p) and selects(p["spec"].get("podSelector"), me["labels"])]
    if not mine:
        return True
    for p in mine:
        for rule in p["spec"].get(rules_key) or []:
            peers = rule.get(peers_key)
            if peers is not None and not any(
                    peer_matches(x, p["metadata"]["namespace"], other) for x in peers):
                continue
            if port_matches(rule.get("ports"), port, protocol, dst):
                return True
    return False


def allowed(policies, src, dst, port, protocol="TCP"):
    return (side_allows(policies, src, dst, "out", port, protocol, dst)
            and side_allows(policies, dst, src, "in", port, protocol, dst))


def endpoints(objs):
    """The rendering's pods by part: router, prefill, decode, etcd, and fetchers (pods with a
    container that fetches the model)."""
    parts = {"router": [], "prefill": [], "decode": [], "etcd": [], "fetchers": []}
    by_key = index(objs)
    for wl, spec in pod_specs(objs):
        labels = wl["spec"]["template"]["metadata"].get("labels") or {}
        containers = spec.get("containers", []) + spec.get("initContainers", [])
        ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports") or []
                 if "name" in p}
        p = pod(wl["metadata"].get("namespace", NAMESPACE), labels, ports,
                f"{wl['kind']}/{wl['metadata']['name']}")
        # Which discovery its binaries use: etcd endpoints, or a Kubernetes selector.
        flags = {}
        for c in spec.get("containers", []):
            binary = tandem_binary(c)
            if binary and binary != FETCHER:
                flags.update(effective(c, container_env(c, by_key), binary))
        p["etcd"] = bool(flags.get("etcd-endpoints"))
        p["kube"] = bool(flags.get("kube-selector"))
        p["otlp"] = flags.get("otlp-endpoint")
        part = ("etcd" if labels.get("app.kubernetes.io/name") == "etcd"
                else labels.get("app.kubernetes.io/component"))
        if part in parts:
            parts[part].append(p)
        if any(e.get("name") == "MODEL_DEST" for c in containers for e in c.get("env") or []) \
                or any(tandem_binary(c) == FETCHER for c in containers):
            parts["fetchers"].append(p)
    return parts


def flows(parts):
    """(source, destination, port, protocol, must it be allowed) of every connection that
    matters."""
    out = []
    tandem = parts["router"] + parts["prefill"] + parts["decode"]
    etcd = parts["etcd"] or [OUTSIDE_ETCD]
    for p in tandem + parts["etcd"]:
        out.append((p, DNS, 53, "UDP", True))
    for p in tandem:
        # A pod reaches etcd, or the API server, only if it uses it (a fetcher's HTTPS to
        # any address may reach the API server's port 443 too).
        out += [(p, e, 2379, "TCP", p["etcd"]) for e in etcd]
        fetches = p in parts["fetchers"]
        out.append((p, API_SERVER, 443, "TCP", p["kube"] or fetches))
        out.append((p, API_SERVER, 6443, "TCP", p["kube"]))
        out.append((p, PYPI, 443, "TCP", fetches))
        # The trace collector, on its port, only for a binary that sends it spans.
        port = re.search(r":(\d+)$", (p["otlp"] or "").rstrip("/"))
        out.append((p, COLLECTOR, int(port.group(1)) if port else OTLP_PORT, "TCP",
                    bool(p["otlp"])))
        out.append((p, CLIENT, 22, "TCP", False))
    for p in [f for f in parts["fetchers"] if f not in tandem]:
        # A pod of its own that fetches the model (a Job): PyPI and the DNS, nothing else.
        out += [(p, DNS, 53, "UDP", True), (p, PYPI, 443, "TCP", True),
                (p, CLIENT, 22, "TCP", False)]
    for r in parts["router"]:
        out += [(CLIENT, r, 8080, "TCP", True), (STRANGER, r, 8080, "TCP", True),
                (SCRAPER, r, OPS_PORT, "TCP", True), (STRANGER, r, OPS_PORT, "TCP", False)]
        out += [(r, w, 50051, "TCP", True) for w in parts["prefill"]]
        out += [(r, w, 50052, "TCP", True) for w in parts["decode"]]
    for w in parts["prefill"] + parts["decode"]:
        # The operations listener: the scrapers only; they have no business on gRPC.
        out += [(SCRAPER, w, OPS_PORT, "TCP", True), (STRANGER, w, OPS_PORT, "TCP", False),
                (CLIENT, w, OPS_PORT, "TCP", False)]
    for w in parts["prefill"]:
        out += [(SCRAPER, w, 50051, "TCP", False), (STRANGER, w, 50051, "TCP", False),
                (CLIENT, w, 50051, "TCP", False)]
        out += [(w, d, 50052, "TCP", True) for d in parts["decode"]]
        out += [(d, w, 50051, "TCP", False) for d in parts["decode"]]
    for d in parts["decode"]:
        out += [(SCRAPER, d, 50052, "TCP", False), (STRANGER, d, 50052, "TCP", False),
                (CLIENT, d, 50052, "TCP", False)]
        out += [(d, r, 8080, "TCP", False) for r in parts["router"]]
    for e in parts["etcd"]:
        out += [(x, e, 2380, "TCP", True) for x in parts["etcd"]]
        out += [(SCRAPER, e, 2381, "TCP", True), (STRANGER, e, 2379, "TCP", False)]
    return out


def check(t, label, objs):
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    if not policies:
        # Only the chart may leave them out, and only when its values say so.
        t.ok(f"{label} has NetworkPolicies", label.startswith("helm "),
             "a kustomize rendering without NetworkPolicies lets every pod reach every port")
        return
    parts = endpoints(objs)
    for src, dst, port, protocol, want in flows(parts):
        verb = "reaches" if want else "cannot reach"
        t.ok(f"{label} network: {src['name']} {verb} {dst['name']}:{port}/{protocol}",
             allowed(policies, src, dst, port, protocol) == want,
             "allowed by the NetworkPolicies" if not want else "denied by the NetworkPolicies")
