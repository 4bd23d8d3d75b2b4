#!/usr/bin/env bash
# Starts a local Tandem cluster: a router on 127.0.0.1:8080, one prefill node and one decode
# node, each its own process, serving SmolLM2-135M-Instruct (fetched if missing). Ctrl-C
# stops all three.
#
#   bash scripts/quickstart.sh [MODEL]
#
# MODEL (or TANDEM_MODEL): another model folder or GGUF file, or a Hugging Face Hub name
# (Qwen/Qwen3-0.6B, org/name@rev, org/name:Q4_K_M), fetched into HF_HOME's cache.
# Environment (all optional):
# ROUTER_LISTEN, ROUTER_METRICS_LISTEN (the router's /metrics and /health/ready),
# PREFILL_LISTEN, DECODE_LISTEN, TANDEM_BIN_DIR (prebuilt binaries: skips the build), and
# every other env twin of the three binaries' flags (see their --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

TANDEM_MODEL="${1:-${TANDEM_MODEL:-}}"
if [ -z "$TANDEM_MODEL" ]; then
  TANDEM_MODEL="$(bash scripts/fetch-smollm2.sh)"
  export ROUTER_MODEL_NAME="${ROUTER_MODEL_NAME:-smollm2}"
fi
export TANDEM_MODEL
export ROUTER_LISTEN="${ROUTER_LISTEN:-127.0.0.1:8080}"
export ROUTER_METRICS_LISTEN="${ROUTER_METRICS_LISTEN:-127.0.0.1:9464}"
export PREFILL_LISTEN="${PREFILL_LISTEN:-127.0.0.1:50051}"
export DECODE_LISTEN="${DECODE_LISTEN:-127.0.0.1:50052}"
export ROUTER_PREFILL_NODES="$PREFILL_LISTEN" ROUTER_DECODE_NODES="$DECODE_LISTEN"
# The prefill node sends KV caches only to decode nodes it knows.
export PREFILL_DECODE_NODES="$DECODE_LISTEN"

bin="${TANDEM_BIN_DIR:-}"
if [ -z "$bin" ]; then
  # The build scripts run protoc: the machine's, or a pinned one from crates.io.
  PROTOC="${PROTOC:-$(bash scripts/get-protoc.sh)}"
  export PROTOC
  cargo build --release -p router -p prefill-node -p decode-node
  bin="$root/target/release"
fi

pids=()
stop() {
  trap - INT TERM EXIT
  kill "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
}
trap stop INT TERM EXIT

"$bin/tandem-prefill" & pids+=($!)
"$bin/tandem-decode" & pids+=($!)
"$bin/tandem-router" & pids+=($!)
echo "tandem: router on http://$ROUTER_LISTEN (model $TANDEM_MODEL), metrics on http://$ROUTER_METRICS_LISTEN; Ctrl-C stops it" >&2
# If any of the three exits, stop the others.
wait -n "${pids[@]}"
