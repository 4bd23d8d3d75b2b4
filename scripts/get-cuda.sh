#!/usr/bin/env bash
# Prints a CUDA_HOME for building the `cuda` feature (docs/gpu.md): NVIDIA's CUDA 13.0
# compiler and headers as their PyPI wheels carry them, installed under
# ${TANDEM_CACHE:-~/.cache/tandem}/cuda-13.0. 13.0 because the lent GPU machines' driver is
# CUDA 13.0's, which loads no PTX from a newer compiler. Each wheel is pinned to 13.0:
# nvcc's own requirement on nvidia-nvvm is unpinned and would bring a newer cicc, whose PTX
# 13.0's ptxas refuses.
#
#   export CUDA_HOME="$(bash scripts/get-cuda.sh)"           # nvcc and headers: enough to check
#   export CUDA_HOME="$(bash scripts/get-cuda.sh --link)"    # and the libraries to link against
#
# With --link it adds cuBLAS, cuRAND and NVRTC (0.8 GB more) and a stub libcuda.so, made
# from the driver API's header, for the linker alone: the driver's own library is loaded
# on the GPU machine.
set -euo pipefail

LINK=""
[ "${1:-}" = "--link" ] && LINK=1
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"
DEST="$CACHE/cuda-13.0"
ROOT="$DEST/nvidia/cu13"

wheels=(
  "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88"
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85"
)
if [ -n "$LINK" ]; then
  wheels+=("nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.0.35" "nvidia-cuda-nvrtc==13.0.88")
fi

# The wheels a finished install holds, one a line.
installed="$DEST/wheels.txt"
missing=""
for w in "${wheels[@]}"; do
  grep -qxF "$w" "$installed" 2>/dev/null || missing=1
done
if [ -n "$missing" ]; then
  # All in one call into an empty folder: the wheels share `nvidia/cu13`, which a later
  # `pip install --target` would replace whole, dropping the earlier wheels' files.
  rm -rf "$DEST"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$DEST" \
    "${wheels[@]}" >&2
  printf '%s\n' "${wheels[@]}" >"$installed"
fi
ln -sfn "$ROOT/lib" "$ROOT/lib64"

if [ -n "$LINK" ]; then
  lib="$ROOT/lib"
  # The unversioned names the linker looks for.
  for so in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13; do
    ln -sfn "$so" "$lib/${so%%.so.*}.so"
  done
  if [ ! -e "$lib/libcuda.so" ]; then
    # Every function the driver API's header declares, under the names its macros give
    # them (cuMemAlloc is cuMemAlloc_v2), as an empty function of a shared object named
    # as the driver's: enough for the linker, never run.
    cc -E -P -I"$ROOT/include" "$ROOT/include/cuda.h" | tr '\n' ' ' |
      grep -oE 'CUresult +[A-Za-z0-9_]+ *\(' | sed -E 's/CUresult +//; s/ *\(//' |
      sort -u | awk '{print "void " $1 "(void) {}"}' >"$DEST/cuda-stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/libcuda.so" "$DEST/cuda-stub.c"
  fi
fi
echo "$ROOT"
