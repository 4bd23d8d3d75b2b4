#!/usr/bin/env bash
# Figure 2: PD with the prefill node pinned to core 0 and the decode node to core 1, against
# one colocated worker on both cores, under the same Poisson load (loadgen), one after the
# other in the same run. Writes bench/results/pd-pinned.json and colocated.json (and a PNG
# when matplotlib is importable).
#
#   MODEL=models/smollm2-135m-instruct-q4_1.gguf RATES=0.1,0.2,0.3 REQUESTS=16 \
#     bash bench/pd-vs-colocated.sh
#
# SETUPS="pd" or SETUPS="colocated" runs one of the two; "conditional" adds the pinned PD
# pair behind a router with --local-prefill-max-tokens $LOCAL_MAX (default 128): short
# prompts computed by the decode node when it has room (conditional.json). CONCURRENCY=1,4
# runs closed-loop levels (that many clients) in place of the Poisson RATES.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/smollm2-135m-instruct-q4_1.gguf}
RATES=${RATES:-0.1,0.2,0.3}
REQUESTS=${REQUESTS:-16}
LOAD=${LOAD:---mix fixed --prompt-tokens 512 --output-tokens 64}
SLO=${SLO:---slo-ttft-ms 5000 --slo-tpot-ms 100}
OUT=${OUT:-bench/results}
SETUPS=${SETUPS:-pd colocated}
LOCAL_MAX=${LOCAL_MAX:-128}
BIN=${BIN:-target/release}
LOGS=$(mktemp -d)
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap stop EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_ready() {
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$1/health/ready" >/dev/null && return 0
        sleep 0.1
    done
    echo "router on :$1 not ready; logs in $LOGS" >&2
    exit 1
}

LEVELS=(--rates "$RATES")
if [ -n "${CONCURRENCY:-}" ]; then LEVELS=(--concurrency "$CONCURRENCY"); fi
run() { # label, router port
    "$BIN/loadgen" --url "http://127.0.0.1:$2" --model bench --api completions \
        "${LEVELS[@]}" --requests "$REQUESTS" $LOAD $SLO --label "$1" --json "$OUT/$1.json"
}

pinned_pd() { # label, local-prefill-max-tokens
P=$(free_port); D=$(free_port); R=$(free_port); M=$(free_port)
taskset -c 0 "$BIN/tandem-prefill" --model "$MODEL" --listen "127.0.0.1:$P" \
    --decode-nodes "127.0.0.1:$D" >"$LOGS/p.log" 2>&1 & PIDS+=($!)
taskset -c 1 "$BIN/tandem-decode" --model "$MODEL" --listen "127.0.0.1:$D" >"$LOGS/d.log" 2>&1 & PIDS+=($!)
"$BIN/tandem-router" --model "$MODEL" --model-name bench --listen "127.0.0.1:$R" --metrics-listen "127.0.0.1:$M" \
    --prefill-nodes "127.0.0.1:$P" --decode-nodes "127.0.0.1:$D" \
    --local-prefill-max-tokens "$2" >"$LOGS/r.log" 2>&1 & PIDS+=($!)
wait_ready "$M"
run "$1" "$R"
curl -s "http://127.0.0.1:$M/metrics" | grep '^router_prefill_placements_total' || true
stop
}

if [[ " $SETUPS " == *" pd "* ]]; then
echo "== PD: prefill on core 0, decode on core 1"
pinned_pd pd-pinned 0
fi

if [[ " $SETUPS " == *" conditional "* ]]; then
echo "== conditional: PD pinned, prompts up to $LOCAL_MAX tokens on the decode node when it has room"
pinned_pd conditional "$LOCAL_MAX"
fi

if [[ " $SETUPS " == *" colocated "* ]]; then
echo "== colocated: one worker on both cores"
D=$(free_port); R=$(free_port); M=$(free_port)
taskset -c 0,1 "$BIN/tandem-decode" --model "$MODEL" --listen "127.0.0.1:$D" >"$LOGS/c.log" 2>&1 & PIDS+=($!)
"$BIN/tandem-router" --model "$MODEL" --model-name bench --listen "127.0.0.1:$R" --metrics-listen "127.0.0.1:$M" --mode colocated \
    --decode-nodes "127.0.0.1:$D" >"$LOGS/rc.log" 2>&1 & PIDS+=($!)
wait_ready "$M"
run colocated "$R"
stop
fi

if [ -f "$OUT/pd-pinned.json" ] && [ -f "$OUT/colocated.json" ] && python3 -c 'import matplotlib' 2>/dev/null; then
    RUNS=("$OUT/pd-pinned.json" "$OUT/colocated.json")
    if [ -f "$OUT/conditional.json" ]; then RUNS+=("$OUT/conditional.json"); fi
    python3 bench/plot.py "$OUT/pd-vs-colocated.png" "${RUNS[@]}"
fi
