#!/usr/bin/env bash
# Figure 7: the engine on the sizes people run against llama.cpp's own benchmarks on the
# same GGUF, alternated ROUNDS times, each model in turn:
#   engine-bench         prefill of 512 tokens; decode at batch 1 and 16 (16 steps each,
#                        every sequence 128 tokens in), both cores
#   llama-bench          -t 2 -p 512 -n 32: prefill of 512, batch-1 decode from empty
#   llama-batched-bench  -t 2 -npp 128 -ntg 32 -npl 16: 16 sequences of 128 tokens, 32
#                        steps together (its S_TG)
# Make the models first: LLAMA_CPP=DIR python3 bench/make-models.py models/speed.
# Writes OUT/<tool>-<model>-r<round>.json and prints a table with the ratios and batch 1's
# read bandwidth against the machine's (engine-bench's probe), and the engine's resident
# memory after load against the file's size.
#
#   ROUNDS=3 MODELS=models/speed/qwen2.5-1.5b-q4_k_m.gguf bash bench/vs-llama-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$HOME/.cache/tandem-peers}
LLAMA_BIN=${LLAMA_BIN:-$VENV/llama.cpp/build/bin}
MODELS=${MODELS:-$(ls models/speed/*.gguf)}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-bench/results/vs-llama-bench}
BIN=${BIN:-target/release}
mkdir -p "$OUT"

for round in $(seq 1 "$ROUNDS"); do
    for model in $MODELS; do
        name=$(basename "$model" .gguf)
        echo "== round $round: $name ($(uptime | sed 's/.*load/load/'))"
        "$BIN/engine-bench" --model "$model" --batches 1,16 --steps 16 \
            --json "$OUT/tandem-$name-r$round.json" >/dev/null
        "$LLAMA_BIN/llama-bench" -m "$model" -t 2 -p 512 -n 32 -r 1 -o json \
            >"$OUT/llama-bench-$name-r$round.json" 2>/dev/null
        "$LLAMA_BIN/llama-batched-bench" -m "$model" -t 2 -c 8192 -b 2048 -ub 512 \
            -npp 128 -ntg 32 -npl 16 --output-format jsonl 2>/dev/null |
            grep '^{' >"$OUT/llama-batched-$name-r$round.json"
    done
done

python3 - "$OUT" "$ROUNDS" $MODELS <<'EOF'
import json, os, sys
out, rounds, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| model | round | prefill 512 tok/s | ratio | batch 1 tok/s | ratio | batch 1 GB/s (of probe) "
      "| batch 16 tok/s | ratio | resident after load / file GB |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for m in models:
    name = os.path.basename(m)[: -len(".gguf")]
    for r in range(1, rounds + 1):
        ours = json.load(open(f"{out}/tandem-{name}-r{r}.json"))
        lb = json.load(open(f"{out}/llama-bench-{name}-r{r}.json"))
        pp = next(t["avg_ts"] for t in lb if t["n_prompt"] > 0)
        tg = next(t["avg_ts"] for t in lb if t["n_gen"] > 0)
        b16 = json.loads(open(f"{out}/llama-batched-{name}-r{r}.json").readline())["speed_tg"]
        d = {x["batch"]: x for x in ours["decode"]}
        gbs = d[1]["tokens_per_s"] * d[1]["bytes_per_step"] / 1e9
        share = gbs * 1e9 / ours["bandwidth_bytes_per_s"]
        print(f"| {name} | {r} | {ours['prefill_tokens_per_s']:.1f} / {pp:.1f} | "
              f"{ours['prefill_tokens_per_s'] / pp:.2f} | {d[1]['tokens_per_s']:.1f} / {tg:.1f} | "
              f"{d[1]['tokens_per_s'] / tg:.2f} | {gbs:.1f} ({share:.0%}) | "
              f"{d[16]['tokens_per_s']:.1f} / {b16:.1f} | {d[16]['tokens_per_s'] / b16:.2f} | "
              f"{ours['resident_after_load_bytes'] / 1e9:.2f} / {ours['file_bytes'] / 1e9:.2f} |")
EOF
