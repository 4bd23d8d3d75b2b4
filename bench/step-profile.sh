#!/usr/bin/env bash
# Where a decode step's CPU time goes: `perf record -e cpu-clock` samples of engine-bench's
# decode steps alone (sampling is off through the load, the bandwidth probe and the
# contexts' prefill, which engine-bench turns it around through perf's control FIFOs),
# each sample put in a part of the step by its leaf symbol (bench/step-parts.py). Prints the
# parts' shares of both threads' samples; issue 46 item 5 reads "outside the products".
# Run it once per build to compare, alternating; one profile moves by a few points.
#
#   BIN=target/release/engine-bench BATCH=16 CONTEXT=256 STEPS=100 bash bench/step-profile.sh
#
# KV=q8_0 profiles caches of Q8_0 blocks (engine-bench's --kv-cache-dtype).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/smollm2-135m-instruct-q4_1.gguf}
BIN=${BIN:-target/release/engine-bench}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
mkfifo "$DIR/ctl" "$DIR/ack"
perf record -q -e cpu-clock -D -1 --control "fifo:$DIR/ctl,$DIR/ack" -o "$DIR/perf.data" -- \
    "$BIN" --model "$MODEL" --batches "${BATCH:-16}" --prefill-tokens 16 \
    --context "${CONTEXT:-256}" --steps "${STEPS:-100}" --kv-cache-dtype "${KV:-f16}" \
    --perf-ctl "$DIR/ctl" --perf-ack "$DIR/ack" | grep -E '^\| [0-9]'
perf script -i "$DIR/perf.data" -F tid,ip,sym 2>/dev/null | python3 bench/step-parts.py
