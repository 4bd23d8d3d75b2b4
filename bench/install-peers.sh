#!/usr/bin/env bash
# Installs the peers the bench compares against into one scratch virtualenv. Never run by CI:
# the peers are large (llama.cpp builds from source twice, about 10 minutes on two cores) and
# only the figures in bench/README.md need them.
#
#   bash bench/install-peers.sh [VENV]      # default VENV: ~/.cache/tandem-peers
#
# Afterwards: VENV/llama.cpp/build/bin/llama-server (llama.cpp's own server, from the source
# llama-cpp-python vendors) and llama-bench and llama-quantize beside it, VENV/llama.cpp
# itself (the converter bench/make-models.py runs, the gguf-py bench/make-moe-model.py writes
# with), VENV/bin/python -m llama_cpp (teacher-forced references:
# scripts/oracle_llama_cpp.py), VENV/bin/python -m sglang_router.launch_router,
# VENV/bin/vllm-router, VENV/bin/aiperf.
set -euo pipefail

venv="${1:-$HOME/.cache/tandem-peers}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "sglang-router==0.3.2" "vllm-router==0.1.17" "aiperf==0.13.0"
# Built for this CPU's vector units, as our release build is (README: "Build target").
CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install --quiet --no-cache-dir \
  "llama-cpp-python[server]==0.3.36"
"$venv/bin/pip" install --quiet numpy cmake ninja safetensors==0.8.0 torch==2.15.0 \
  transformers==5.23.0 sentencepiece==0.2.1
# The native server, which batches continuously, from the llama.cpp tree the sdist vendors.
src=$(mktemp -d)
"$venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -d "$src"
tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
rm -rf "$venv/llama.cpp"
mv "$src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$venv/llama.cpp"
"$venv/bin/cmake" -S "$venv/llama.cpp" -B "$venv/llama.cpp/build" -G Ninja \
  -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
"$venv/bin/cmake" --build "$venv/llama.cpp/build" --target llama-server llama-bench llama-batched-bench \
  llama-quantize >/dev/null
"$venv/bin/python" -c 'import llama_cpp, sglang_router; print("llama_cpp", llama_cpp.__version__)'
"$venv/llama.cpp/build/bin/llama-server" --version
"$venv/llama.cpp/build/bin/llama-bench" --help >/dev/null
command -v "$venv/bin/vllm-router" "$venv/bin/aiperf" >/dev/null
echo "peers installed in $venv"
