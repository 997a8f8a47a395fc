#!/usr/bin/env bash
# Compile every CUDA source with CMake + nvcc on a machine without a GPU, and
# fail on any compile error. Builds for sm_90 and sm_80 only (the full build
# adds 86 and 89) into a throw-away directory; nothing is written into the
# package. Needs nvcc, CMake >= 3.24, a C++ compiler and pybind11.
#
#   bash scripts/check_kernels_compile.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_kernels_compile: nvcc not found (install the CUDA toolkit)" >&2
  exit 1
fi
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
BUILD_DIR="$(mktemp -d)"
trap 'rm -rf "$BUILD_DIR"' EXIT
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80-real;90-real}" \
  -DPython_EXECUTABLE="$PYTHON" -DMINI_VLLM_OUTPUT_DIR="$BUILD_DIR/out" >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
ls "$BUILD_DIR"/out/_C*.so >/dev/null
echo "check_kernels_compile: ok ($(nvcc --version | tail -1))"
