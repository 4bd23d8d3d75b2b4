#!/usr/bin/env bash
# Time to the first served request: from starting the servers to the first completion
# (one token, greedy) that comes back 200, for llama.cpp's llama-server and Tandem
# colocated (router + one decode node) on the same GGUF, alternated ROUNDS times, with the
# resident memory of each serving process once it served. The file is read once before
# the first round, so every start finds it in the page cache, as a restart would. Tandem
# runs twice a round: repacking the weights at load, and mapping them from a weight pack
# (--weights-cache) that an unmeasured start wrote before the first round; the decode
# node's memory is shown with its private part (RssAnon; the rest is mapped files).
#
#   MODEL=models/speed/qwen2.5-3b-q4_k_m.gguf ROUNDS=3 bash bench/first-request.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/speed/qwen2.5-3b-q4_k_m.gguf}
VENV=${VENV:-$HOME/.cache/tandem-peers}
LLAMA_SERVER=${LLAMA_SERVER:-$VENV/llama.cpp/build/bin/llama-server}
ROUNDS=${ROUNDS:-3}
BIN=${BIN:-target/release}
LOGS=$(mktemp -d)
PACKS=$(mktemp -d)
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap 'stop; rm -rf "$PACKS"' EXIT
cat "$MODEL" >/dev/null

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
rss_mb() { awk '/VmRSS/ {printf "%d", $2 / 1024}' "/proc/$1/status"; }
private_mb() { awk '/RssAnon/ {printf "%d", $2 / 1024}' "/proc/$1/status"; }

served() { # port: polls until a completion comes back 200
    local body='{"model":"bench","prompt":"Hello","max_tokens":1,"temperature":0}'
    until curl -sf -o /dev/null -H 'content-type: application/json' -d "$body" \
        "http://127.0.0.1:$1/v1/completions"; do
        sleep 0.05
    done
}

tandem() { # label [decode node flags]: starts Tandem colocated, prints its time to serve
    local label=$1; shift
    R=$(free_port); D=$(free_port); M=$(free_port)
    t0=$(now)
    "$BIN/tandem-decode" --model "$MODEL" --listen "127.0.0.1:$D" "$@" >"$LOGS/d.log" 2>&1 &
    PIDS+=($!)
    "$BIN/tandem-router" --model "$MODEL" --model-name bench --listen "127.0.0.1:$R" \
        --metrics-listen "127.0.0.1:$M" --mode colocated --decode-nodes "127.0.0.1:$D" \
        >"$LOGS/r.log" 2>&1 &
    PIDS+=($!)
    served "$R"
    [ -z "$label" ] || echo "$label: $(since "$t0") s, decode node $(rss_mb "${PIDS[0]}") MB" \
        "($(private_mb "${PIDS[0]}") MB private), router $(rss_mb "${PIDS[1]}") MB"
    stop
}

tandem "" --weights-cache "$PACKS"  # writes the pack the packed starts map
for round in $(seq 1 "$ROUNDS"); do
    R=$(free_port)
    t0=$(now)
    "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$R" -t 2 -c 4096 --alias bench \
        --no-webui >"$LOGS/llama.log" 2>&1 &
    PIDS+=($!)
    served "$R"
    echo "round $round llama-server: $(since "$t0") s, $(rss_mb "${PIDS[0]}") MB"
    stop

    tandem "round $round tandem colocated"
    tandem "round $round tandem colocated, packed" --weights-cache "$PACKS"
done
