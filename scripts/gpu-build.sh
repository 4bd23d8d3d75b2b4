#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a lent GPU machine, which has no Rust, into
# .gpu/ (ignored by git; the device call carries it): engine-bench and the engine's tests
# with the `cuda` feature, tandem-model, and the Qwen tokenizer's files for the speed
# models, without their line tables and xz-compressed to travel under the call's 64 MiB
# (the CPU build's three binaries: 115 MB as built, 9 MB so). docs/gpu.md says how a
# session uses it.
#
#   bash scripts/gpu-build.sh          # with CUDA: 13 minutes on two cores, warm target/
#   GPU_BUILD=cpu bash scripts/gpu-build.sh   # without: to time gpu-check.sh here
set -euo pipefail
cd "$(dirname "$0")/.."

PROTOC="$(bash scripts/get-protoc.sh)"
export PROTOC
features=()
if [ "${GPU_BUILD:-cuda}" = cuda ]; then
  CUDA_HOME="$(bash scripts/get-cuda.sh --link)"
  # Hopper (sm_90) machine code for candle's statically built kernels; its PTX kernels
  # are compiled by the driver at start.
  export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  export LIBRARY_PATH="$CUDA_HOME/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  features=(--features cuda)
fi

cargo build --release "${features[@]}" -p bench --bin engine-bench
# With the tests' features: their build makes tandem-model too, over this one.
cargo build --release "${features[@]}" -p engine --bin tandem-model
tests="$(cargo test --release "${features[@]}" -p engine --test engine --no-run \
  --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "engine" \
            and m["target"]["kind"] == ["test"]:
        print(m["executable"])
')"

rm -rf .gpu
mkdir -p .gpu/qwen3
cp target/release/engine-bench target/release/tandem-model .gpu/
cp "$tests" .gpu/engine-tests
cp models/qwen3/tokenizer.json models/qwen3/tokenizer_config.json .gpu/qwen3/
strip --strip-debug .gpu/engine-bench .gpu/tandem-model .gpu/engine-tests
xz -9 -T0 .gpu/engine-bench .gpu/tandem-model .gpu/engine-tests .gpu/qwen3/tokenizer.json
du -sh .gpu
