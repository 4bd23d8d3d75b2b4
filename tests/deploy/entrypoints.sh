#!/usr/bin/env bash
# shellcheck disable=SC2015,SC2154  # ok() never fails; the *_cmd, *_env, PORT_* come from the plan
# Starts tandem-prefill, tandem-decode and tandem-router with exactly the commands, args and
# environment that the pods of deploy/k8s/overlays/${OVERLAY:-small} get (read from the
# rendered YAML by tests/deploy/plan.py: envFrom ConfigMaps, env, $(POD_IP) expansion, the
# api-keys Secret and each role's certificate as files), rewritten only where a pod differs
# from one machine: the pod IP is 127.0.0.1, every containerPort becomes a free port, etcd is a
# local one on free ports with the StatefulSet's TLS flags, the model is ${TANDEM_MODEL}, the
# Secrets cert-manager would make come from a CA made here (openssl), and Secret files live in
# a temporary folder.
# Then: the router's /health/ready, both workers registered in etcd, a /v1/completions request
# with the Secret's key answers 200 (and 401 without it), the Helm chart's `helm test` script
# passes against this router, and a SIGTERM to each worker
# deregisters it and exits 0 within its terminationGracePeriodSeconds; then the router too.
#
#   TANDEM_MODEL=models/smollm2-135m-instruct-q4_1.gguf bash tests/deploy/entrypoints.sh
#
# RUNNER=process (default) runs ${BIN_DIR:-target/release}/tandem-*; RUNNER=podman runs each
# as a container of ${IMAGE} (host network, the model and Secret files mounted where the pod
# has them, the pod's runAsUser, read-only root, dropped capabilities and emptyDirs;
# tests/deploy/image.sh builds the image and calls this). Needs etcd (Debian
# etcd-server, etcd-client), openssl, curl, a Python with tests/deploy/requirements.txt (PYTHON, default
# .venv/bin/python) and kubectl (see get-kubectl.sh). Ends with `<n> passed, <m> failed`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY="${PYTHON:-.venv/bin/python}"
BIN_DIR="$(cd "${BIN_DIR:-target/release}" && pwd)"
OVERLAY="${OVERLAY:-small}"
RUNNER="${RUNNER:-process}"
MODEL="${TANDEM_MODEL:-models/smollm2-135m-instruct-q4_1.gguf}"
MODEL="$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")"
[ -f "$MODEL" ] || { echo "no model at $MODEL (bash scripts/fetch-smollm2.sh)" >&2; exit 1; }
KUBECTL="$(PYTHON="$PY" bash tests/deploy/get-kubectl.sh)"
HELM="$(PYTHON="$PY" bash tests/deploy/get-kubectl.sh helm)"
export KUBECTL HELM BIN_DIR
case "$RUNNER" in
  process) mode=process ;;
  podman)
    mode=container
    : "${IMAGE:?RUNNER=podman needs IMAGE}"
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/tests/deploy/containers.conf}"
    ;;
  *) echo "RUNNER is process or podman" >&2; exit 2 ;;
esac

passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $*"; }
bad() { failed=$((failed + 1)); echo "FAIL $*"; }

work="$(mktemp -d)"
chmod 755 "$work"
declare -A pid=()
etcd_pid=""
cleanup() {
  set +e
  for c in "${!pid[@]}"; do kill -9 "${pid[$c]}" 2>/dev/null; done
  if [ "$RUNNER" = podman ]; then
    for c in prefill decode router; do podman rm -f "tandem-e2e-$c-$$" >/dev/null 2>&1; done
  fi
  [ -n "$etcd_pid" ] && kill "$etcd_pid" 2>/dev/null && wait "$etcd_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The Secrets cert-manager makes in a cluster (components/cert-manager-certs), from a CA of
# this run's own and with the same names and usages: each role's certificate, which the
# binaries present to etcd, and etcd's, which names 127.0.0.1 (the endpoint dialed here).
certs="$work/certs"
mkdir -p "$certs"
openssl req -x509 -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -days 1 -subj /CN=tandem-ca \
  -keyout "$certs/ca.key" -out "$certs/ca.crt" 2>/dev/null
issue() {  # Secret name, common name, subjectAltName
  local d="$certs/$1"
  mkdir -p "$d"
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -subj "/CN=$2" \
    -keyout "$d/tls.key" -out "$work/$1.csr" 2>/dev/null
  printf '%s\n' "subjectAltName=$3" 'extendedKeyUsage=serverAuth,clientAuth' \
    'keyUsage=critical,digitalSignature' 'basicConstraints=critical,CA:FALSE' >"$work/$1.ext"
  openssl x509 -req -in "$work/$1.csr" -CA "$certs/ca.crt" -CAkey "$certs/ca.key" \
    -CAcreateserial -days 1 -extfile "$work/$1.ext" -out "$d/tls.crt" 2>/dev/null
  cp "$certs/ca.crt" "$d/ca.crt"
}
issue tandem-router-tls tandem-router URI:spiffe://tandem/router
for role in prefill decode; do
  issue "tandem-$role-tls" tandem-worker.tandem.svc \
    "DNS:tandem-worker.tandem.svc,URI:spiffe://tandem/$role"
done
issue tandem-etcd-tls etcd.tandem.svc DNS:localhost,IP:127.0.0.1

ec="$(free_port)" ep="$(free_port)" em="$(free_port)"
"$PY" tests/deploy/plan.py "$work/plan.sh" --overlay "overlays/$OVERLAY" \
  --model "$MODEL" --etcd "127.0.0.1:$ec" --workdir "$work/files" --certs "$certs" --mode "$mode"
# shellcheck disable=SC1091
source "$work/plan.sh"

# A local etcd on free ports, for the manifests' TANDEM_ETCD_ENDPOINTS, with the TLS flags of
# their StatefulSet (ETCD_SCHEME, etcd_tls_args from the plan).
etcd --name e2e --data-dir "$work/etcd" "${etcd_tls_args[@]}" \
  --listen-client-urls "$ETCD_SCHEME://127.0.0.1:$ec" \
  --advertise-client-urls "$ETCD_SCHEME://127.0.0.1:$ec" \
  --listen-peer-urls "http://127.0.0.1:$ep" --initial-advertise-peer-urls "http://127.0.0.1:$ep" \
  --initial-cluster "e2e=http://127.0.0.1:$ep" --listen-metrics-urls "http://127.0.0.1:$em" \
  >"$work/etcd.log" 2>&1 &
etcd_pid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$em/health" >/dev/null && break; sleep 0.1; done
# etcdctl as etcd's own certificate (serverAuth and clientAuth), where etcd asks for one.
etcdctl_() {
  ETCDCTL_API=3 etcdctl --endpoints="$ETCD_SCHEME://127.0.0.1:$ec" --cacert="$certs/ca.crt" \
    --cert="$certs/tandem-etcd-tls/tls.crt" --key="$certs/tandem-etcd-tls/tls.key" "$@"
}
if [ "$ETCD_SCHEME" = https ] && command -v etcdctl >/dev/null; then
  if ETCDCTL_API=3 etcdctl --endpoints="https://127.0.0.1:$ec" --cacert="$certs/ca.crt" \
    --dial-timeout=2s get --prefix / --keys-only >/dev/null 2>&1; then
    bad "etcd answers a client without a certificate"
  else
    ok "etcd refuses a client without a certificate from the CA"
  fi
fi
prefix="$(for e in "${router_env[@]}"; do case "$e" in TANDEM_ETCD_PREFIX=*) echo "${e#*=}";; esac; done)"
prefix="${prefix:-/tandem/workers/}"

start() {
  local c="$1" cmd_ref="$1_cmd[@]" env_ref="$1_env[@]" mounts_ref="$1_mounts[@]"
  local opts_ref="$1_podman_opts[@]"
  local cmd=("${!cmd_ref}") env=("${!env_ref}") mounts=("${!mounts_ref}") opts=("${!opts_ref}")
  echo "--- $c: ${env[*]} ${cmd[*]}"
  if [ "$RUNNER" = process ]; then
    # env -i: the process sees the pod's environment and nothing of this shell's.
    env -i PATH=/usr/local/bin:/usr/bin:/bin "${env[@]}" "$BIN_DIR/${cmd[0]}" "${cmd[@]:1}" \
      >"$work/$c.log" 2>&1 &
  else
    # The pod's user, read-only root, dropped capabilities and emptyDirs (as tmpfs).
    local args=(run --rm --name "tandem-e2e-$c-$$" --network host "${opts[@]}")
    echo "    podman ${opts[*]} ${mounts[*]/#/-v }"
    for e in "${env[@]}"; do args+=(-e "$e"); done
    for m in "${mounts[@]}"; do args+=(-v "$m"); done
    podman "${args[@]}" "$IMAGE" "${cmd[@]}" >"$work/$c.log" 2>&1 &
  fi
  pid[$c]=$!
}

logs() { for c in prefill decode router; do echo "--- $c log:"; tail -n 20 "$work/$c.log"; done; }

start prefill
start decode
start router
router="http://127.0.0.1:$PORT_router"
ops="http://127.0.0.1:$PORT_router_metrics"

ready=""
for _ in $(seq 600); do
  if curl -sf "$ops/health/ready" >/dev/null 2>&1; then ready=1; break; fi
  for c in prefill decode router; do
    kill -0 "${pid[$c]}" 2>/dev/null || { echo "$c exited early"; break 2; }
  done
  sleep 0.2
done
if [ -n "$ready" ]; then ok "router /health/ready"; else bad "router /health/ready"; logs; fi
# What the workers' readiness probes ask: their operations port, apart from gRPC.
for c in prefill decode; do
  port_ref="PORT_${c}_metrics"
  if curl -sf "http://127.0.0.1:${!port_ref}/health/ready" >/dev/null 2>&1; then
    ok "$c /health/ready on its operations port"
  else
    bad "$c /health/ready on its operations port"
  fi
done

if command -v etcdctl >/dev/null; then
  keys="$(etcdctl_ get --prefix "$prefix" --keys-only | grep -c . || true)"
  [ "$keys" = 2 ] && ok "2 workers registered under $prefix" || bad "$keys registrations under $prefix (want 2)"
fi

body="{\"model\": \"$MODEL_NAME\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}"
code="$(curl -s -o "$work/anon.json" -w '%{http_code}' "$router/v1/completions" \
  -H 'content-type: application/json' -d "$body")"
[ "$code" = 401 ] && ok "no API key: 401" || bad "no API key: $code (want 401)"
code="$(curl -s -o "$work/completion.json" -w '%{http_code}' "$router/v1/completions" \
  -H 'content-type: application/json' -H "authorization: Bearer $API_KEY" -d "$body")"
if [ "$code" = 200 ]; then
  ok "/v1/completions with the Secret's key: 200: $(head -c 300 "$work/completion.json")"
else
  bad "/v1/completions: $code $(head -c 300 "$work/completion.json")"; logs
fi

# The chart's `helm test` pod script (deploy/helm/tandem/templates/tests.yaml) against this
# router: only its address and its key file differ from the pod's.
printf '%s\n' "$API_KEY" >"$work/helm-test-keys"
if script="$(HELM="$HELM" "$PY" tests/deploy/helm.py test-script "$router" "$work/helm-test-keys")" \
    && sh -c "$script" >"$work/helm-test.log" 2>&1; then
  ok "the chart's helm test passes: $(tr '\n' ' ' <"$work/helm-test.log")"
else
  bad "the chart's helm test: $(cat "$work/helm-test.log" 2>/dev/null)"
fi
curl -s "$ops/metrics" | grep -E '^router_workers' | sed 's/^/     /' || true

# Stop as Kubernetes does: SIGTERM, then terminationGracePeriodSeconds to exit.
declare -A term_at=()
term() { term_at[$1]=$SECONDS; kill -TERM "${pid[$1]}"; }
await() {
  local c="$1" grace_ref="$1_grace" rc=0
  while kill -0 "${pid[$c]}" 2>/dev/null && [ $((SECONDS - term_at[$c])) -le "${!grace_ref}" ]; do
    sleep 0.1
  done
  if kill -0 "${pid[$c]}" 2>/dev/null; then
    bad "$c still running ${!grace_ref} s after SIGTERM"; kill -9 "${pid[$c]}"
  fi
  wait "${pid[$c]}" || rc=$?
  unset "pid[$c]"
  if [ "$rc" = 0 ]; then
    ok "$c: SIGTERM, exit 0 within $((SECONDS - term_at[$c] + 1)) s"
  else
    bad "$c: SIGTERM, exit $rc"; tail -n 20 "$work/$c.log"
  fi
}

# An upgrade must not drop requests: a long generation in flight when both workers get
# SIGTERM still completes, since the decode node drains before it exits.
long="{\"model\": \"$MODEL_NAME\", \"prompt\": \"Tell me a long story.\", \"max_tokens\": 100, \"ignore_eos\": true, \"temperature\": 0}"
curl -s -o "$work/long.json" -w '%{http_code}' "$router/v1/completions" \
  -H 'content-type: application/json' -H "authorization: Bearer $API_KEY" -d "$long" \
  >"$work/long.code" &
long_pid=$!
for _ in $(seq 200); do
  curl -s "http://127.0.0.1:$PORT_decode_metrics/metrics" | grep -Eq '^decode_running_sequences 1' && break
  sleep 0.05
done
term prefill
term decode
await prefill
await decode
wait "$long_pid" || true
tokens="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["completion_tokens"])' "$work/long.json" 2>/dev/null || echo none)"
if [ "$(cat "$work/long.code")" = 200 ] && [ "$tokens" = 100 ]; then
  ok "a 100-token request in flight across the workers' SIGTERM completed (200 OK, 100 tokens)"
else
  bad "request across SIGTERM: $(cat "$work/long.code") $(head -c 300 "$work/long.json")"
fi
if sed 's/\x1b\[[0-9;]*m//g' "$work/decode.log" | grep -q 'draining: no new work in_flight=[1-9]'; then
  ok "decode drained with the request in flight"
else
  bad "decode had nothing in flight at SIGTERM: $(grep -a draining "$work/decode.log")"
fi
if command -v etcdctl >/dev/null; then
  keys="$(etcdctl_ get --prefix "$prefix" --keys-only | grep -c . || true)"
  [ "$keys" = 0 ] && ok "workers deregistered" || bad "$keys registrations left after SIGTERM"
fi
term router
await router

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
