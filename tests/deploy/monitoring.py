"""Checks of components/monitoring, for tests/deploy/manifests.py: the monitors select the
pods and ports that serve /metrics, and every metric the alerts, the dashboard and the
prometheus-adapter rules name is one the binaries export (read from their sources, where each
metric's name is written once as a string)."""

import json
import os
import re

import yaml

from objects import FETCHER, container_env, effective, index, port_security, tandem_binary

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCES = ("router/src", "prefill-node/src", "decode-node/src", "runtime/src")
METRIC = re.compile(r"\b((?:router|prefill|decode)_[a-z_]+)\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_EXPORTED = None


def exported():
    """Every metric name the binaries write: string literals in their sources."""
    global _EXPORTED
    if _EXPORTED is None:
        names = set()
        for d in SOURCES:
            for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
                for f in files:
                    if f.endswith(".rs"):
                        with open(os.path.join(dirpath, f)) as fh:
                            names |= set(re.findall(r'"((?:router|prefill|decode)_[a-z_]+)"',
                                                    fh.read()))
        _EXPORTED = names
    return _EXPORTED


def known(name):
    """Whether `name` is an exported metric, or a histogram's bucket, sum or count series."""
    names = exported()
    if name in names:
        return True
    return any(name.endswith(s) and name[: -len(s)] in names for s in HISTOGRAM_SUFFIXES)


def queries(objs):
    """(where, PromQL) of every query the monitoring objects hold."""
    out = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "PrometheusRule":
            for g in o["spec"]["groups"]:
                for r in g["rules"]:
                    out.append((f"{name} {r.get('alert') or r.get('record')}", r["expr"]))
        elif o["kind"] == "ScaledObject":
            for trig in o["spec"]["triggers"]:
                if trig["type"] == "prometheus":
                    out.append((f"{name} trigger", trig["metadata"]["query"]))
        elif o["kind"] == "ConfigMap":
            for key, text in (o.get("data") or {}).items():
                if key.endswith(".json"):
                    for p in json.loads(text).get("panels", []):
                        for tgt in p.get("targets", []):
                            out.append((f"{name} panel {p.get('title')!r}", tgt["expr"]))
                elif o["metadata"]["name"].endswith("adapter-rules"):
                    for r in yaml.safe_load(text).get("rules", []):
                        out.append((f"{name} rule", r["seriesQuery"]))
    return out


def runbooks():
    """The alerts deploy/README.md has a runbook for: its `#### <alert>` headings."""
    with open(os.path.join(ROOT, "deploy", "README.md")) as f:
        return set(re.findall(r"^#### (Tandem\w+)$", f.read(), re.M))


def check_runbooks(t, label, objs):
    """Each alert has a runbook in deploy/README.md; where the rule links them, each link
    ends with its heading's anchor."""
    written = runbooks()
    for o in objs:
        if o["kind"] != "PrometheusRule":
            continue
        rules = [r for g in o["spec"]["groups"] for r in g["rules"] if r.get("alert")]
        links = [r for r in rules if "runbook_url" in (r.get("annotations") or {})]
        t.ok(f"{label} alerts link their runbooks all or none", len(links) in (0, len(rules)),
             f"{len(links)} of {len(rules)}")
        for r in rules:
            alert = r["alert"]
            t.ok(f"{label} {alert} has a runbook", alert in written,
                 "no `#### " + alert + "` in deploy/README.md")
            url = (r.get("annotations") or {}).get("runbook_url")
            if url is not None:
                t.ok(f"{label} {alert} links its runbook", url.endswith("#" + alert.lower()),
                     url)


SELECTOR = re.compile(r"\b((?:router|prefill|decode)_[a-z_]+)\b(\{[^}]*\})?")


def check_scopes(t, label, objs):
    """Each series an alert or a KEDA trigger reads is selected by the job of one of the
    target's own monitors (`<namespace>/<name>`, the Prometheus Operator's job label), so
    that two deployments never read each other's pods; and a trigger reads its own pool."""
    jobs = {f"{o['metadata'].get('namespace')}/{o['metadata']['name']}"
            for o in objs if o["kind"] in ("ServiceMonitor", "PodMonitor")}
    workloads = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    reads = []  # (what, expr, the pool it must read or None)
    for o in objs:
        if o["kind"] == "PrometheusRule":
            reads += [(r.get("alert"), r["expr"], None) for g in o["spec"]["groups"]
                      for r in g["rules"]]
        elif o["kind"] == "ScaledObject":
            target = workloads.get(o["spec"]["scaleTargetRef"]["name"]) or {}
            pool = target.get("metadata", {}).get("labels", {}).get(
                "app.kubernetes.io/component")
            reads += [(f"ScaledObject/{o['metadata']['name']}", trig["metadata"]["query"], pool)
                      for trig in o["spec"]["triggers"] if trig["type"] == "prometheus"]
    for what, expr, pool in reads:
        for name, matchers in SELECTOR.findall(expr):
            job = re.search(r'\bjob="([^"]*)"', matchers or "")
            t.ok(f"{label} {what}: {name} is scoped to a monitor's job",
                 job is not None and job.group(1) in jobs,
                 f"{name}{matchers} (the monitors' jobs: {sorted(jobs)})")
            if pool is not None:
                t.ok(f"{label} {what} reads its own pool's {name}",
                     name.startswith(f"{pool}_"), f"{name}, but it scales the {pool} pool")
    check_dashboard_scopes(t, label, objs)


def check_dashboard_scopes(t, label, objs):
    """The dashboard picks one deployment with its `namespace` and `deployment` variables,
    and every series a panel reads is selected by that deployment's router or workers job."""
    for o in objs:
        if o["kind"] != "ConfigMap":
            continue
        for key, text in (o.get("data") or {}).items():
            if not key.endswith(".json"):
                continue
            board = json.loads(text)
            names = {v.get("name") for v in board.get("templating", {}).get("list", [])}
            t.ok(f"{label} dashboard has the namespace and deployment variables",
                 {"namespace", "deployment"} <= names, sorted(names))
            for p in board.get("panels", []):
                for tgt in p.get("targets", []):
                    for name, matchers in SELECTOR.findall(tgt["expr"]):
                        monitor = "router" if name.startswith("router_") else "workers"
                        want = f'job="$namespace/$deployment-{monitor}"'
                        t.ok(f"{label} panel {p.get('title')!r}: {name} is scoped",
                             want in (matchers or ""), f"{name}{matchers}: wants {want}")


def check(t, label, objs, pod_specs):
    """The monitoring objects of one rendered target, if it has any."""
    check_runbooks(t, label, objs)
    check_scopes(t, label, objs)
    monitors = [o for o in objs if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    served = set()
    for where, expr in queries(objs):
        names = METRIC.findall(expr)
        t.ok(f"{label} {where} names a metric", bool(names), expr)
        for n in names:
            t.ok(f"{label} {where}: {n} is exported", known(n),
                 f"no metric {n} in the binaries' sources")
        if where.endswith("adapter-rules rule"):
            served |= set(names)
    # Where the target carries the adapter's rules, each HPA's Pods metric must be one.
    for o in objs:
        if not served or o["kind"] != "HorizontalPodAutoscaler":
            continue
        for m in o["spec"].get("metrics", []):
            if m["type"] == "Pods":
                n = m["pods"]["metric"]["name"]
                t.ok(f"{label} HPA {o['metadata']['name']}: {n} is served", n in served,
                     f"no prometheus-adapter rule serves {n}")
    services = [o for o in objs if o["kind"] == "Service"]
    for m in monitors:
        sel = m["spec"]["selector"]
        what = f"{label} {m['kind']}/{m['metadata']['name']}"
        if m["kind"] == "ServiceMonitor":
            hits = [s for s in services if matches(sel, s["metadata"].get("labels") or {})]
            ports = {p.get("name"): None for s in hits for p in s["spec"]["ports"]}
            endpoints = m["spec"]["endpoints"]
        else:
            hits = [w for w, _ in pod_specs
                    if matches(sel, w["spec"]["template"]["metadata"]["labels"])]
            ports = pod_ports(objs, hits)
            endpoints = m["spec"]["podMetricsEndpoints"]
        t.ok(f"{what} selects something", bool(hits), f"selector {sel} matches nothing")
        for e in endpoints:
            port = e.get("port")
            if not t.ok(f"{what} port {port} exists", port in ports,
                        f"no port named {port!r} among {sorted(p for p in ports if p)}"):
                continue
            check_scheme(t, f"{what} port {port}", e, ports[port])


def pod_ports(objs, workloads):
    """{port name: "mutual", "server", "plain" or None (not a Tandem listener)} of the
    containers of `workloads`; a name that speaks differently in two pods is the stricter."""
    by_key = index(objs)
    order = [None, "plain", "server", "mutual"]
    out = {}
    for w in workloads:
        for c in w["spec"]["template"]["spec"]["containers"]:
            binary = tandem_binary(c)
            security = (port_security(effective(c, container_env(c, by_key), binary), binary)
                        if binary and binary != FETCHER else {})
            for p in c.get("ports") or []:
                name = p.get("name")
                if name:
                    s = security.get(p["containerPort"])
                    out[name] = max(out.get(name), s, key=order.index)
    return out


def check_scheme(t, what, endpoint, security):
    """A scrape speaks what its port does: TLS checked against a CA, with a client
    certificate where the port asks every caller for one; plain HTTP otherwise."""
    if security is None:
        return
    tls = endpoint.get("tlsConfig") or {}
    if security == "plain":
        t.ok(f"{what} scrapes over plain HTTP", endpoint.get("scheme", "http") == "http",
             "the operations listener of a worker speaks no TLS")
        return
    t.ok(f"{what} scrapes over TLS checked against a CA",
         endpoint.get("scheme") == "https" and "ca" in tls,
         f"the port speaks TLS; scheme {endpoint.get('scheme')!r}, tlsConfig {sorted(tls)}")
    if security == "mutual":
        t.ok(f"{what} presents a client certificate", "cert" in tls and "keySecret" in tls,
             "the port asks every caller for a certificate of the CA")


def matches(selector, labels):
    """Whether a LabelSelector (matchLabels, matchExpressions with In) selects `labels`."""
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
    return True
