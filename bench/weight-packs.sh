#!/usr/bin/env bash
# What a weight pack (--weights-cache) changes for one GGUF model: engine-bench's load time
# and resident memory (private, and mapped files) repacking at load against mapping a pack,
# alternated ROUNDS times; then a prefill and a decode node on this host started together
# each way, with each one's proportional share of memory (Pss: a page two processes map
# counts half to each) and the host's used memory once both are ready.
#
#   MODEL=models/speed/qwen2.5-3b-q4_k_m.gguf ROUNDS=3 bash bench/weight-packs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/speed/qwen2.5-3b-q4_k_m.gguf}
ROUNDS=${ROUNDS:-3}
BIN=${BIN:-target/release}
PACKS=$(mktemp -d)
LOGS=$(mktemp -d)
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap 'stop; rm -rf "$PACKS" "$LOGS"' EXIT
cat "$MODEL" >/dev/null

bench() { # label [engine-bench flags]
    local label=$1; shift
    echo "$label: $("$BIN/engine-bench" --model "$MODEL" --batches 1 --steps 4 \
        --prefill-tokens 16 "$@" | grep -E '^loaded')"
}
ready() { until curl -sf -o /dev/null "http://127.0.0.1:$1/health/ready"; do sleep 0.2; done; }
pss() { # label pid
    awk -v l="$1" '/^Pss:/ {s=$2} /^Pss_Anon:/ {a=$2}
        END {printf "%s: Pss %d MB (%d MB private)\n", l, s/1024, a/1024}' "/proc/$2/smaps_rollup"
}

bench "writing the pack" --weights-cache "$PACKS"
for round in $(seq 1 "$ROUNDS"); do
    bench "round $round repacked"
    bench "round $round packed" --weights-cache "$PACKS"
done
for way in repacked packed; do
    flags=()
    [ "$way" = packed ] && flags=(--weights-cache "$PACKS")
    "$BIN/tandem-decode" --model "$MODEL" --listen 127.0.0.1:50071 \
        --metrics-listen 127.0.0.1:9471 "${flags[@]}" >"$LOGS/d.log" 2>&1 &
    PIDS+=($!)
    "$BIN/tandem-prefill" --model "$MODEL" --listen 127.0.0.1:50072 \
        --metrics-listen 127.0.0.1:9472 "${flags[@]}" >"$LOGS/p.log" 2>&1 &
    PIDS+=($!)
    ready 9471
    ready 9472
    pss "$way decode node" "${PIDS[0]}"
    pss "$way prefill node" "${PIDS[1]}"
    echo "$way: host memory used $(free -m | awk '/^Mem:/ {print $3}') MB with both ready"
    stop
done
