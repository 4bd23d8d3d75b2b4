#!/usr/bin/env python3
"""The launch plan that tests/deploy/entrypoints.sh runs: a bash file with the router, prefill
and decode commands and environments of one overlay, as its pods would run them, and the TLS
flags of its etcd, rewritten for one machine.

  plan.py OUT.sh --model FILE --etcd HOST:PORT --workdir DIR --certs DIR [--overlay O] [--mode M]

Secrets the manifests render (the API keys) are written from the rendered objects; Secrets made
in the cluster by cert-manager (each role's certificate, etcd's) are taken from --certs
DIR/<secret name>/ (ca.crt, tls.crt, tls.key), which the caller makes from a CA of its own.
Environment: BIN_DIR (the binaries, default target/release), KUBECTL (a kubectl with the
kustomize subcommand). Needs PyYAML (tests/deploy/requirements.txt).
"""

import argparse
import base64
import os
import re
import shlex
import socket
import sys

from objects import (K8S, binary_help, container_env, env_dict, etcd_statefulset, expand, index,
                     pod_specs, render, split_args, tandem_binary)

# etcd's flags that name a TLS file, and the switch that asks clients for a certificate.
ETCD_TLS_FILE_FLAGS = ("cert-file", "key-file", "trusted-ca-file")
ETCD_CLIENT_AUTH = "client-cert-auth"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_data(name, by_key, certs):
    """{key: bytes} of the Secret `name`: rendered, or made in the cluster (from `certs`)."""
    secret = by_key.get(("Secret", name))
    if secret is not None:
        return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    d = os.path.join(certs, name)
    if not os.path.isdir(d):
        sys.exit(f"Secret {name} is made in the cluster (cert-manager): put its files in {d}/")
    out = {}
    for k in sorted(os.listdir(d)):
        with open(os.path.join(d, k), "rb") as f:
            out[k] = f.read()
    return out


def volume_files(c, volumes, by_key, workdir, comp, certs):
    """Writes the files of each Secret / ConfigMap volume `c` mounts under workdir/comp; returns
    ({mountPath: local dir}, ["local:mountPath:ro"])."""
    path_map, mounts = {}, []
    for m in c.get("volumeMounts") or []:
        # A claim of a volumeClaimTemplate is not among the pod's volumes.
        v = volumes.get(m["name"]) or {}
        if "secret" in v:
            data = secret_data(v["secret"]["secretName"], by_key, certs)
        elif "configMap" in v:
            cm = by_key[("ConfigMap", v["configMap"]["name"])]
            data = {k: val.encode() for k, val in (cm.get("data") or {}).items()}
        else:
            continue
        d = os.path.join(workdir, comp, m["name"])
        os.makedirs(d, exist_ok=True)
        os.chmod(os.path.join(workdir, comp), 0o755)
        os.chmod(d, 0o755)
        for k, content in data.items():
            with open(os.path.join(d, k), "wb") as f:
                f.write(content)
            # Readable by the pod's user in a container (the files are the run's own).
            os.chmod(os.path.join(d, k), 0o644)
        path_map[m["mountPath"]] = d
        mounts.append(f"{d}:{m['mountPath']}:ro")
    return path_map, mounts


def first_api_key(path_map, c):
    """The first key of the file --api-key-file names, among the router's mounted files."""
    for m in c.get("volumeMounts") or []:
        if m["name"] == "api-keys" and m["mountPath"] in path_map:
            d = path_map[m["mountPath"]]
            for k in sorted(os.listdir(d)):
                with open(os.path.join(d, k)) as f:
                    lines = [ln.strip() for ln in f]
                keys = [ln.split()[0] for ln in lines if ln and not ln.startswith("#")]
                if keys:
                    return keys[0]
    return ""


def podman_opts(spec, c, volumes, model_dir):
    """The pod's security context and scratch volumes, as podman options (container mode)."""
    opts = []
    psc, csc = spec.get("securityContext") or {}, c.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if uid is not None:
        opts.append(f"--user={uid}:{gid if gid is not None else uid}")
    if csc.get("readOnlyRootFilesystem"):
        opts.append("--read-only")
    if "ALL" in ((csc.get("capabilities") or {}).get("drop") or []):
        opts.append("--cap-drop=ALL")
    if csc.get("allowPrivilegeEscalation") is False:
        opts.append("--security-opt=no-new-privileges")
    for m in c.get("volumeMounts") or []:
        if "emptyDir" in volumes[m["name"]] and m["mountPath"] != model_dir:
            opts.append(f"--tmpfs={m['mountPath']}")
    return opts


def local_path(value, path_map):
    """`value`, a path in the container, as this machine's copy when it lies under one of
    `path_map`'s mounts ({mountPath: local folder}); otherwise as it is."""
    for mount_path, d in path_map.items():
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return d + value[len(mount_path):]
    return value


def etcd_plan(by_key, workdir, certs):
    """(scheme, flags) of the manifests' etcd for a local one: its client URL scheme and its TLS
    flags, each file taken from the run's copy of the Secret the StatefulSet mounts there."""
    sts = etcd_statefulset(by_key.values())
    if sts is None:
        return "http", []
    spec = sts["spec"]["template"]["spec"]
    c = next(c for c in spec["containers"] if c["name"] == "etcd")
    args = dict(split_args(c))
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    path_map, _ = volume_files(c, volumes, by_key, workdir, "etcd", certs)
    flags = []
    for flag in ETCD_TLS_FILE_FLAGS:
        if args.get(flag):
            flags.append(f"--{flag}={local_path(args[flag], path_map)}")
    if ETCD_CLIENT_AUTH in args:
        flags.append(f"--{ETCD_CLIENT_AUTH}")
    scheme = "https" if (args.get("listen-client-urls") or "").startswith("https://") else "http"
    return scheme, flags


def component_plan(comp, wl, spec, c, by_key, args):
    """The bash lines of one binary's pod: ports, command, environment, mounts, options."""
    env = container_env(c, by_key, {"status.podIP": "127.0.0.1",
                                    "metadata.name": f"{wl['metadata']['name']}-0"})
    envd = env_dict(env)
    ports = {p["containerPort"]: free_port() for p in c.get("ports") or []}
    out = [f"PORT_{comp}={ports[next(iter(ports))]}"]
    for p in c.get("ports") or []:
        if p.get("name"):
            out.append(f"PORT_{comp}_{p['name']}={ports[p['containerPort']]}")
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    path_map, mounts = volume_files(c, volumes, by_key, args.workdir, comp, args.certs)
    if comp == "router":
        out.append(f"MODEL_NAME={shlex.quote(envd.get('ROUTER_MODEL_NAME', ''))}")
        out.append(f"API_KEY={shlex.quote(first_api_key(path_map, c))}")

    def rewrite(value, name=None):
        if name == "TANDEM_ETCD_ENDPOINTS":
            return args.etcd
        if name == "TANDEM_MODEL":
            return value if args.mode == "container" else args.model

        def port(m):
            p = int(m.group(2))
            return f"127.0.0.1:{ports[p]}" if p in ports else m.group(0)

        value = re.sub(r"(0\.0\.0\.0|127\.0\.0\.1):(\d+)", port, value)
        return local_path(value, path_map) if args.mode == "process" else value

    cmd = [expand(a, envd) for a in (c.get("command") or []) + (c.get("args") or [])]
    h = binary_help(os.path.basename(cmd[0]))

    def rewrite_arg(a):
        if a.startswith("--") and "=" in a:
            flag, value = a.split("=", 1)
            return f"{flag}={rewrite(value, (h.options.get(flag[2:]) or {}).get('env'))}"
        return rewrite(a)

    cmd = [cmd[0]] + [rewrite_arg(a) for a in cmd[1:]]
    env_items = [f"{n}={rewrite(v, n)}" for n, v in envd.items()]
    if args.mode == "container" and envd.get("TANDEM_MODEL"):
        mounts.append(f"{args.model}:{envd['TANDEM_MODEL']}:ro")
    opts = podman_opts(spec, c, volumes, os.path.dirname(envd.get("TANDEM_MODEL", "")))
    q = lambda items: " ".join(shlex.quote(i) for i in items)  # noqa: E731
    out += [f"{comp}_podman_opts=({q(opts)})", f"{comp}_cmd=({q(cmd)})",
            f"{comp}_env=({q(env_items)})", f"{comp}_mounts=({q(mounts)})",
            f"{comp}_grace={spec.get('terminationGracePeriodSeconds', 30)}"]
    return out


def cmd_plan(args):
    """Writes a bash file defining, for router, prefill and decode: <c>_cmd (the command and
    args), <c>_env (NAME=VALUE of its whole environment), <c>_mounts (HOST:CONTAINER[:ro],
    container mode only), <c>_podman_opts (its security context and scratch volumes as podman
    options), <c>_grace, PORT_<c> (its first containerPort's local port), PORT_<c>_<name>
    (each named containerPort's); API_KEY (the first key of the router's Secret), MODEL_NAME;
    and for a local etcd ETCD_SCHEME (http or https) and etcd_tls_args (its TLS flags)."""
    path = os.path.join(K8S, args.overlay) if not os.path.isabs(args.overlay) else args.overlay
    objs = render(path)
    by_key = index(objs)
    os.makedirs(args.workdir, exist_ok=True)
    pods = {}
    for wl, spec in pod_specs(objs):
        for c in spec.get("containers", []):
            b = tandem_binary(c)
            if b:
                pods[b.split("-", 1)[1]] = (wl, spec, c)
    missing = {"router", "prefill", "decode"} - set(pods)
    if missing:
        sys.exit(f"{args.overlay}: no container runs {sorted(missing)}")

    out = ["# generated by tests/deploy/plan.py from deploy/k8s/" + args.overlay]
    for comp in ("router", "prefill", "decode"):
        out += component_plan(comp, *pods[comp], by_key, args)
    scheme, flags = etcd_plan(by_key, args.workdir, args.certs)
    out.append(f"ETCD_SCHEME={scheme}")
    out.append(f"etcd_tls_args=({' '.join(shlex.quote(f) for f in flags)})")
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out")
    p.add_argument("--overlay", default="overlays/small", help="under deploy/k8s")
    p.add_argument("--model", required=True, help="the model file on this machine")
    p.add_argument("--etcd", required=True, help="etcd endpoint on this machine")
    p.add_argument("--workdir", required=True, help="where Secret/ConfigMap files go")
    p.add_argument("--certs", required=True,
                   help="folder of the Secrets made in the cluster, one sub-folder each")
    p.add_argument("--mode", choices=("process", "container"), default="process")
    return cmd_plan(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
