#!/usr/bin/env bash
# Build the CUDA kernels into mini_vllm/_C*.so (needs nvcc, CMake >= 3.24, pybind11).
#
#   bash scripts/build_kernels.sh                 # all default GPU architectures
#   CUDA_ARCHS=90 bash scripts/build_kernels.sh   # only H100/H200: faster
#   BUILD_DIR=build-dev bash scripts/build_kernels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
args=(-S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PYTHON")
if [[ -n "${CUDA_ARCHS:-}" ]]; then
  args+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
fi
if command -v ninja >/dev/null 2>&1; then
  args+=(-G Ninja)
fi
cmake "${args[@]}" ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
ls mini_vllm/_C*.so
