#!/usr/bin/env bash
# Installs the peers the bench compares against into one scratch virtualenv. Never run by CI:
# the peers are large (llama.cpp builds from source, about 5 minutes on two cores) and only the
# figures in bench/README.md need them.
#
#   bash bench/install-peers.sh [VENV]      # default VENV: ~/.cache/tandem-peers
#
# Afterwards: VENV/bin/python -m llama_cpp.server, VENV/bin/python -m sglang_router.launch_router,
# VENV/bin/vllm-router, VENV/bin/aiperf.
set -euo pipefail

venv="${1:-$HOME/.cache/tandem-peers}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "sglang-router==0.3.2" "vllm-router==0.1.17" "aiperf==0.13.0"
# Built for this CPU's vector units, as our release build is (README: "Build target").
CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install --quiet --no-cache-dir \
  "llama-cpp-python[server]==0.3.36"
"$venv/bin/python" -c 'import llama_cpp, sglang_router; print("llama_cpp", llama_cpp.__version__)'
command -v "$venv/bin/vllm-router" "$venv/bin/aiperf" >/dev/null
echo "peers installed in $venv"
