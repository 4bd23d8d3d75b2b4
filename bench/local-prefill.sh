#!/usr/bin/env bash
# Where a short prompt is cheaper to compute: one prefill node and one decode node on SmolLM2,
# two routers over them, A plain PD and B with --local-prefill-max-tokens past every prompt
# (each computed by the decode node). For each prompt length, requests of one output token go
# to A and B alternately, one at a time; prints the median and range of each (after two
# warm-up pairs). Every prompt is new, so the prefill node's prefix cache serves none. The
# crossover is where --local-prefill-max-tokens pays.
#
#   bash bench/local-prefill.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export TANDEM_MODEL=${TANDEM_MODEL:-$PWD/models/smollm2-135m-instruct-q4_1.gguf}
BIN=${BIN:-target/release}
ROUNDS=${ROUNDS:-12}
LOGS=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
PREFILL_LISTEN=127.0.0.1:51051 PREFILL_DECODE_NODES=127.0.0.1:51052 \
  "$BIN/tandem-prefill" >"$LOGS/prefill.log" 2>&1 & PIDS+=($!)
DECODE_LISTEN=127.0.0.1:51052 "$BIN/tandem-decode" >"$LOGS/decode.log" 2>&1 & PIDS+=($!)
for r in a b; do
  port=$([ $r = a ] && echo 51080 || echo 51081)
  local_max=$([ $r = a ] && echo 0 || echo 1000000)
  ROUTER_LISTEN=127.0.0.1:$port ROUTER_METRICS_LISTEN=127.0.0.1:$((port + 10)) \
    ROUTER_PREFILL_NODES=127.0.0.1:51051 \
    ROUTER_DECODE_NODES=127.0.0.1:51052 ROUTER_LOCAL_PREFILL_MAX_TOKENS=$local_max \
    "$BIN/tandem-router" >"$LOGS/router-$r.log" 2>&1 & PIDS+=($!)
done
for port in 51080 51081; do
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$((port + 10))/health/ready" >/dev/null && break
    sleep 0.5
  done
done
ROUNDS=$ROUNDS python3 - <<'PY'
import json, os, statistics, time, urllib.request

def call(port, prompt):
    body = json.dumps({"model": os.path.splitext(os.path.basename(os.environ["TANDEM_MODEL"]))[0],
                       "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        out = json.loads(r.read())
    return (time.perf_counter() - t) * 1e3, out["usage"]["prompt_tokens"]

words = "the quick brown fox jumps over a lazy dog while seven sailors sing softly".split()
sent = 0
for n in [4, 16, 32, 64, 128, 256, 512]:
    body = " ".join(words[i % len(words)] + str(i // len(words)) for i in range(n // 2))
    a, b = [], []
    for r in range(int(os.environ["ROUNDS"])):
        # Each prompt starts with its own number, so the prefill node's prefix cache never
        # serves one (the decode node has none).
        sent += 2
        ta, tokens = call(51080, f"{sent} {body}")
        tb, _ = call(51081, f"{sent + 1} {body}")
        if r >= 2:
            a.append(ta)
            b.append(tb)
    print(f"prompt {tokens:4d} tokens: PD median {statistics.median(a):7.2f} ms "
          f"[{min(a):.2f}-{max(a):.2f}], decode node median {statistics.median(b):7.2f} ms "
          f"[{min(b):.2f}-{max(b):.2f}]", flush=True)
PY
