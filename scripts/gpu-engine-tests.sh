#!/usr/bin/env bash
# The engine's integration tests as a lent GPU machine runs them (scripts/gpu-check.sh):
# every one but those that read fetched models, which a device call cannot carry (only the
# Qwen tokenizer's files travel, in $TANDEM_MODELS/qwen3). CI runs the same list on the
# CPU with only those files in its models folder, so that a test which comes to need a
# fetched model fails there, not in a lease's few minutes.
#
#   TANDEM_MODELS=DIR bash scripts/gpu-engine-tests.sh .gpu/engine-tests
#   TANDEM_MODELS=DIR bash scripts/gpu-engine-tests.sh cargo test --release --workspace --test engine --
#
# Skipped: the tokenizer tests (they read fetched files and run no model); SmolLM2's
# (94 MB, past what a call carries), `llama_cpp::batched_decode_*` among them, which
# compare it with llama.cpp over f16 and Q8_0 caches; the templates', which read the
# fetched models' too; and the step kernels' emulated check, for machines without a GPU.
set -euo pipefail
[ "$#" -gt 0 ] || { echo "usage: $0 TEST-COMMAND..." >&2; exit 2; }
exec "$@" --test-threads 2 \
  --skip smollm2:: --skip templates:: --skip loading::incremental_decoding \
  --skip step_kernels:: \
  --skip loading::token_bytes --skip loading::byte_level_decoding \
  --skip loading::fast_encoding --skip llama_cpp::batched_decode_ \
  --skip loading::the_predicted_weight_memory
