#!/usr/bin/env bash
# loadgen against aiperf: one server (the generated `small` model, colocated: router and
# decode node pinned to core 0), the same closed-loop load from each tool in turn (clients
# pinned to core 1), ROUNDS times alternated. Prints TTFT, inter-token latency and
# end-to-end latency p50 for every run, and each round's aiperf/loadgen ratios. aiperf
# comes from bench/install-peers.sh.
#
#   ROUNDS=4 bash bench/vs-aiperf.sh
#   CONCURRENCY=1 REQUESTS=24 ROUNDS=3 bash bench/vs-aiperf.sh   # TTFT without queueing
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/small}
VENV=${VENV:-$HOME/.cache/tandem-peers}
ROUNDS=${ROUNDS:-4}
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-48}
OUT=${OUT:-bench/results/vs-aiperf}
BIN=${BIN:-target/release}
LOGS=$(mktemp -d)
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT
mkdir -p "$OUT"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

D=$(free_port); R=$(free_port); M=$(free_port)
taskset -c 0 "$BIN/tandem-decode" --model "$MODEL" --listen "127.0.0.1:$D" >"$LOGS/d.log" 2>&1 &
PIDS+=($!)
taskset -c 0 "$BIN/tandem-router" --model "$MODEL" --model-name small --mode colocated \
    --listen "127.0.0.1:$R" --metrics-listen "127.0.0.1:$M" --decode-nodes "127.0.0.1:$D" >"$LOGS/r.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$M/health/ready" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$M/health/ready" >/dev/null || { echo "router not ready; logs in $LOGS" >&2; exit 1; }
# One request first, so that neither tool's first run pays the server's warm-up.
curl -sf "http://127.0.0.1:$R/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "small", "prompt": "warm up", "max_tokens": 8}' >/dev/null

for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round ($(uptime | sed 's/.*load/load/'))"
    # `--prompt-tokens 57` gives 128 prompt tokens with this tokenizer (per `usage`).
    taskset -c 1 "$BIN/loadgen" --url "http://127.0.0.1:$R" --model small --api completions \
        --concurrency "$CONCURRENCY" --requests "$REQUESTS" --mix fixed --prompt-tokens 57 \
        --output-tokens 32 --json "$OUT/loadgen-r$round.json" >/dev/null
    rm -rf "$OUT/aiperf-r$round"
    taskset -c 1 "$VENV/bin/aiperf" profile --model small --url "http://127.0.0.1:$R" \
        --endpoint-type completions --streaming --tokenizer "$MODEL" --isl 128 --isl-stddev 0 \
        --osl 32 --osl-stddev 0 --use-legacy-max-tokens --extra-inputs ignore_eos:true \
        --extra-inputs min_tokens:32 --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
        --ui none --no-gpu-telemetry --no-server-metrics --artifact-dir "$OUT/aiperf-r$round" \
        >"$LOGS/aiperf-r$round.log" 2>&1
    # Keep only the summary: the per-request exports are large.
    find "$OUT/aiperf-r$round" -type f ! -name profile_export_aiperf.json -delete
    find "$OUT/aiperf-r$round" -type d -empty -delete
done

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("| round | TTFT loadgen | TTFT aiperf | ratio | ITL loadgen | ITL aiperf | ratio | latency loadgen | latency aiperf | ratio |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for r in range(1, rounds + 1):
    lg = json.load(open(f"{out}/loadgen-r{r}.json"))["levels"][0]["summary"]
    ap = json.load(open(f"{out}/aiperf-r{r}/profile_export_aiperf.json"))
    pairs = [(lg["ttft_ms"]["p50"], ap["time_to_first_token"]["p50"]),
             (lg["tpot_ms"]["p50"], ap["inter_token_latency"]["p50"]),
             (lg["latency_ms"]["p50"], ap["request_latency"]["p50"])]
    cells = " | ".join(f"{a:.1f} | {b:.1f} | {b / a:.3f}" for a, b in pairs)
    print(f"| {r} | {cells} |")
EOF
