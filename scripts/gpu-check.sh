#!/usr/bin/env bash
# Every GPU check in one call on a lent GPU machine (docs/gpu.md), from what
# scripts/gpu-build.sh put in .gpu/. Results go under $OUT as each step ends, so a call cut
# short still brings back the steps before: log.txt (every step's output), engine-tests.txt,
# results.json (each measurement's JSON by name) and nvidia-smi.txt, within the call's
# eight files back. Each step has its own time limit, and the whole fits a 10-minute call.
#
#   run: bash scripts/gpu-check.sh      (carry: [".gpu"])
#   here, timing the CPU path: GPU_DEVICE=cpu GPU_SIZES=0.5b GPU_BATCHES=1,4 \
#       OUT=/tmp/gpu-out bash scripts/gpu-check.sh
#
# Steps: the engine's integration tests on the GPU (common::device() is CUDA in a cuda
# build: the transformers and llama.cpp oracles, PD's cache moves, the K-quant files);
# engine-bench on the generated small model (f32 folder and Q4_K file) and on a
# Qwen2.5-1.5B-shaped folder (f16, random weights, bench/make-models.py --folder);
# PyTorch's transformers on the same folders as the floor (bench/torch-floor.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the folder for results}"
DEVICE="${GPU_DEVICE:-cuda}"
BATCHES="${GPU_BATCHES:-1,16,64}"
WORK="${GPU_WORK:-/tmp/gpu-work}"
BIN="$WORK/bin"
LOG="$OUT/log.txt"
mkdir -p "$OUT" "$BIN"
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS" | tee -a "$LOG"; }
# Adds a measurement's JSON file to results.json under its name.
keep() {
  python3 - "$OUT/results.json" "$1" "$2" <<'PY'
import json, os, sys
path, name, src = sys.argv[1:]
doc = json.load(open(path)) if os.path.exists(path) else {}
doc[name] = json.load(open(src)) if os.path.exists(src) else None
json.dump(doc, open(path, "w"), indent=1)
PY
}

step "unpack"
cp -r .gpu/. "$BIN/"
# Python's lzma rather than an xz the image may lack.
find "$BIN" -name '*.xz' -exec python3 -c '
import lzma, shutil, sys
for f in sys.argv[1:]:
    with lzma.open(f) as src, open(f[:-3], "wb") as dst:
        shutil.copyfileobj(src, dst)
' {} +
chmod +x "$BIN"/engine-bench "$BIN"/tandem-model "$BIN"/engine-tests
if [ "$DEVICE" != cpu ]; then
  # cuBLAS, cuRAND and the runtime from the CUDA wheels beside PyTorch (the binaries
  # name their CUDA 13 sonames); the driver's libcuda.so.1 from its mounted folder.
  site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  libs="$(find "$site/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)"
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64; do
    [ -d "$d" ] && libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  ldd "$BIN/engine-bench" >>"$LOG" 2>&1
fi

step "engine tests"
TANDEM_MODELS="$BIN" timeout 240 bash scripts/gpu-engine-tests.sh "$BIN/engine-tests" \
  >"$OUT/engine-tests.txt" 2>&1
echo "engine tests: exit $?" | tee -a "$LOG"
grep -E '^test result|FAILED|panicked' "$OUT/engine-tests.txt" >>"$LOG"

step "models"
"$BIN/tandem-model" --out "$WORK/small" --size small --gguf q4_k >>"$LOG" 2>&1
TANDEM_MODELS="$BIN" python3 bench/make-models.py --folder "$WORK" "${GPU_SIZES:-1.5b}" \
  >>"$LOG" 2>&1

bench() {
  local name="$1" model="$2"
  step "engine-bench $name"
  timeout 120 "$BIN/engine-bench" --device "$DEVICE" --model "$model" --batches "$BATCHES" \
    --json "$WORK/bench-$name.json" >>"$LOG" 2>&1
  echo "engine-bench $name: exit $?" | tee -a "$LOG"
  keep "engine-bench $name" "$WORK/bench-$name.json"
}
floor() {
  local name="$1" model="$2" dtype="$3"
  step "torch $name"
  timeout 120 python3 bench/torch-floor.py "$model" --device "$DEVICE" --dtype "$dtype" \
    --batches "$BATCHES" --json "$WORK/torch-$name.json" >>"$LOG" 2>&1
  echo "torch $name: exit $?" | tee -a "$LOG"
  keep "torch $name" "$WORK/torch-$name.json"
}
bench small-f32 "$WORK/small"
bench small-q4k "$WORK/small/model-q4k.gguf"
floor small-f32 "$WORK/small" float32
for size in ${GPU_SIZES:-1.5b}; do
  bench "$size" "$WORK/qwen2.5-$size"
  floor "$size-bf16" "$WORK/qwen2.5-$size" bfloat16
  floor "$size-f32" "$WORK/qwen2.5-$size" float32
done
step "done"
