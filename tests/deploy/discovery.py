"""Checks of Kubernetes discovery, for tests/deploy/manifests.py: a pod that follows the
workers through the API (--kube-selector) mounts the token of a ServiceAccount that may list
and watch EndpointSlices in its namespace and nothing more, and its selector finds a Service
for each pool it needs whose `grpc` port and pod selector are the pool's; a Tandem pod that
does not use the API mounts no token."""

from objects import FETCHER, container_env, effective, pod_specs, tandem_binary

# The pools a binary needs to find: the router pairs both; a prefill node sends to decode.
NEEDS = {"tandem-router": ("prefill", "decode"), "tandem-prefill": ("decode",)}
ALLOWED = {("discovery.k8s.io", "endpointslices", "list"),
           ("discovery.k8s.io", "endpointslices", "watch")}


def parse_selector(text):
    """{key: value} of an equality-based label selector (`k=v,k2=v2`)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip().lstrip("=")
    return out


def granted(objs, namespace, account):
    """(apiGroup, resource, verb) the Roles bound to `account` in `namespace` grant, and
    whether a ClusterRole is bound to it."""
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Role"}
    out, cluster = set(), False
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                   and s.get("namespace", b["metadata"].get("namespace")) == namespace
                   for s in b.get("subjects") or []):
            continue
        ref = b["roleRef"]
        if b["kind"] == "ClusterRoleBinding" or ref["kind"] == "ClusterRole":
            cluster = True
            continue
        for rule in (roles.get(ref["name"]) or {}).get("rules") or []:
            for g in rule.get("apiGroups") or [""]:
                for r in rule.get("resources") or []:
                    for v in rule.get("verbs") or []:
                        out.add((g, r, v))
    return out, cluster


def pool_service(t, what, objs, selector, pool):
    """Checks that a Service the selector chooses is the `pool`'s: its component label, its
    `grpc` port aimed at the pool containers' and its pods the pool's."""
    services = [o for o in objs if o["kind"] == "Service"
                and selector.items() <= (o["metadata"].get("labels") or {}).items()
                and (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == pool]
    if not t.ok(f"{what}: a Service of the {pool} pool carries the selector's labels",
                len(services) == 1, f"{len(services)} Services"):
        return
    svc = services[0]
    port = next((p for p in svc["spec"].get("ports") or [] if p.get("name") == "grpc"), None)
    pods = [(w, s) for w, s in pod_specs(objs)
            if (svc["spec"].get("selector") or {}).items()
            <= (w["spec"]["template"]["metadata"].get("labels") or {}).items()]
    ok_pods = bool(pods) and all(
        (w["spec"]["template"]["metadata"]["labels"]).get("app.kubernetes.io/component") == pool
        for w, _ in pods)
    t.ok(f"{what}: Service/{svc['metadata']['name']} selects the {pool} pods and only them",
         ok_pods, f"{[w['metadata']['name'] for w, _ in pods]}")
    if not t.ok(f"{what}: Service/{svc['metadata']['name']} has a port named grpc",
                port is not None):
        return
    target = port.get("targetPort", port.get("port"))
    for w, s in pods:
        named = {p.get("name"): p["containerPort"] for c in s["containers"]
                 for p in c.get("ports") or []}
        t.ok(f"{what}: Service/{svc['metadata']['name']} grpc port reaches "
             f"{w['metadata']['name']}'s gRPC port",
             named.get(target, target) == named.get("grpc"), f"targetPort {target}")


def check(t, label, objs, by_key):
    for wl, spec in pod_specs(objs):
        what = f"{label} {wl['kind']}/{wl['metadata']['name']}"
        ns = wl["metadata"].get("namespace")
        selectors = []
        for c in spec.get("containers", []):
            binary = tandem_binary(c)
            if binary is None or binary == FETCHER:
                continue
            eff = effective(c, container_env(c, by_key), binary)
            if eff.get("kube-selector"):
                selectors.append((binary, eff["kube-selector"]))
        token = spec.get("automountServiceAccountToken", True)
        account = spec.get("serviceAccountName", "default")
        if not selectors:
            if any(tandem_binary(c) for c in spec.get("containers", [])):
                t.ok(f"{what} mounts no API token (it does not use the API)", token is False)
            continue
        t.ok(f"{what} mounts its ServiceAccount's token (it follows EndpointSlices)",
             token is True)
        t.ok(f"{what} ServiceAccount {account} is rendered",
             ("ServiceAccount", account) in by_key)
        grants, cluster = granted(objs, ns, account)
        t.ok(f"{what} ServiceAccount {account} may list and watch EndpointSlices",
             ALLOWED <= grants, f"granted {sorted(grants)}")
        t.ok(f"{what} ServiceAccount {account} is granted nothing more, and only in its "
             f"namespace", grants <= ALLOWED and not cluster,
             f"also {sorted(grants - ALLOWED)}" + (", a ClusterRole" if cluster else ""))
        for binary, text in selectors:
            for pool in NEEDS.get(binary, ()):
                pool_service(t, what, objs, parse_selector(text), pool)
