#!/usr/bin/env bash
# Figure 5: the same GGUF (SmolLM2-135M Q4_1) served by llama.cpp's own server (the native
# `llama-server`, continuous batching, built by bench/install-peers.sh) and by Tandem,
# colocated (router + one worker) and PD (router + a prefill and a decode node), one after
# the other, ROUNDS times; `tandem-conditional` in SERVERS adds PD with prompts up to
# LOCAL_PREFILL tokens (64) computed by the decode node. Each server gets the same loadgen levels (completions API, greedy,
# exact output lengths), and is started afresh for each, llama-server with one slot per
# stream (`-np`), two threads and a context of 1024 tokens per slot:
#   batch1   one stream, 16-token prompts, 128 tokens out: decode tokens/s = 1000 / TPOT p50
#   c8, c32  8 and 32 closed-loop streams, 64-token prompts, 64 out: output tokens/s
#   ttft512  one stream, 512-token prompts, 1 token out: TTFT p50
# Writes bench/results/vs-llama-cpp/<server>-<level>-r<round>.json and prints a table.
#
#   ROUNDS=2 bash bench/vs-llama-cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/smollm2-135m-instruct-q4_1.gguf}
VENV=${VENV:-$HOME/.cache/tandem-peers}
LLAMA_SERVER=${LLAMA_SERVER:-$VENV/llama.cpp/build/bin/llama-server}
ROUNDS=${ROUNDS:-2}
SERVERS=${SERVERS:-llama-cpp tandem-colocated tandem-pd}
LOCAL_PREFILL=${LOCAL_PREFILL:-64}
OUT=${OUT:-bench/results/vs-llama-cpp}
BIN=${BIN:-target/release}
LOGS=$(mktemp -d)
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap stop EXIT
mkdir -p "$OUT"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_ok() { # url
    for _ in $(seq 1 1200); do
        curl -sf "$1" >/dev/null && return 0
        sleep 0.1
    done
    echo "$1 not ready; logs in $LOGS" >&2
    exit 1
}

start() { # server, streams; sets PORT
    local R P D M
    R=$(free_port); M=$(free_port)
    case $1 in
    llama-cpp)
        "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$R" -t 2 -np "$2" \
            -c $(($2 * 1024)) --alias bench --no-webui >"$LOGS/llama.log" 2>&1 &
        PIDS+=($!)
        wait_ok "http://127.0.0.1:$R/health"
        ;;
    tandem-colocated)
        D=$(free_port)
        "$BIN/tandem-decode" --model "$MODEL" --listen "127.0.0.1:$D" >"$LOGS/c.log" 2>&1 &
        PIDS+=($!)
        "$BIN/tandem-router" --model "$MODEL" --model-name bench --listen "127.0.0.1:$R" \
            --metrics-listen "127.0.0.1:$M" \
            --mode colocated --decode-nodes "127.0.0.1:$D" >"$LOGS/rc.log" 2>&1 &
        PIDS+=($!)
        wait_ok "http://127.0.0.1:$M/health/ready"
        ;;
    tandem-pd | tandem-conditional)
        local local_args=()
        # Conditional disaggregation: prompts up to LOCAL_PREFILL tokens stay on the decode
        # node (`--local-prefill-max-tokens`).
        [ "$1" = tandem-conditional ] && local_args=(--local-prefill-max-tokens "$LOCAL_PREFILL")
        P=$(free_port); D=$(free_port)
        "$BIN/tandem-prefill" --model "$MODEL" --listen "127.0.0.1:$P" \
    --decode-nodes "127.0.0.1:$D" >"$LOGS/p.log" 2>&1 &
        PIDS+=($!)
        "$BIN/tandem-decode" --model "$MODEL" --listen "127.0.0.1:$D" >"$LOGS/d.log" 2>&1 &
        PIDS+=($!)
        "$BIN/tandem-router" --model "$MODEL" --model-name bench --listen "127.0.0.1:$R" \
            --metrics-listen "127.0.0.1:$M" \
            --prefill-nodes "127.0.0.1:$P" --decode-nodes "127.0.0.1:$D" "${local_args[@]}" \
            >"$LOGS/r.log" 2>&1 &
        PIDS+=($!)
        wait_ok "http://127.0.0.1:$M/health/ready"
        ;;
    esac
    PORT=$R
}

level() { # server, round, port, name, loadgen args...
    local server=$1 round=$2 port=$3 name=$4
    shift 4
    # A new connection per request for every server: llama-server closes kept-alive
    # connections as the client reuses them ("connection closed before message completed").
    "$BIN/loadgen" --url "http://127.0.0.1:$port" --model bench --api completions --mix fixed \
        --fresh-connections --label "$server" --json "$OUT/$server-$name-r$round.json" "$@" \
        >/dev/null
}

# name, streams, loadgen args
LEVELS=(
    "batch1 1 --requests 4 --prompt-tokens 16 --output-tokens 128"
    "c8 8 --requests 32 --prompt-tokens 64 --output-tokens 64"
    "c32 32 --requests 64 --prompt-tokens 64 --output-tokens 64"
    "ttft512 1 --requests 3 --prompt-tokens 512 --output-tokens 1"
)
for round in $(seq 1 "$ROUNDS"); do
    for server in $SERVERS; do
        for spec in "${LEVELS[@]}"; do
            read -r name streams args <<<"$spec"
            echo "== round $round: $server $name ($(uptime | sed 's/.*load/load/'))"
            start "$server" "$streams"
            # One request first so that no level pays for a cold start.
            level "$server" "$round" "$PORT" warmup --concurrency 1 --requests 1 \
                --prompt-tokens 16 --output-tokens 8
            # shellcheck disable=SC2086 # the level's arguments split on purpose
            level "$server" "$round" "$PORT" "$name" --concurrency "$streams" $args
            stop
        done
    done
done

python3 - "$OUT" "$ROUNDS" $SERVERS <<'EOF'
import json, sys
out, rounds, servers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def s(server, level, r):
    return json.load(open(f"{out}/{server}-{level}-r{r}.json"))["levels"][0]["summary"]
print("| round | server | batch-1 decode tok/s | c8 output tok/s | c32 output tok/s | TTFT 512 p50 ms | errors |")
print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
for r in range(1, rounds + 1):
    for sv in servers:
        lv = {l: s(sv, l, r) for l in ("batch1", "c8", "c32", "ttft512")}
        errors = sum(x["errors"] for x in lv.values())
        print(f"| {r} | {sv} | {1000 / lv['batch1']['tpot_ms']['p50']:.1f} | "
              f"{lv['c8']['output_tokens_per_s']:.1f} | {lv['c32']['output_tokens_per_s']:.1f} | "
              f"{lv['ttft512']['ttft_ms']['p50']:.0f} | {errors} |")
EOF
