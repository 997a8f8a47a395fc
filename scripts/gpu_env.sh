# shellcheck shell=bash
# What the GPU jobs (scripts/gpu_*.sh) do the same way. Sourced by a job after it
# has moved to the repository root and set $OUT (where it writes) and $PY (the
# Python it runs):
#
#   source scripts/gpu_env.sh
#   if stage build; then build_kernels_unless_built; fi

# Build mini_vllm._C (for $CUDA_ARCHS, default sm_90) into $OUT/build.log, unless
# it imports already: a job that a previous one prepared starts at once.
build_kernels_unless_built() {
  if "$PY" -c 'import mini_vllm._C' 2>/dev/null; then
    echo "kernels: mini_vllm._C imports, not rebuilt"
  else
    local start
    start=$(date +%s)
    CUDA_ARCHS="${CUDA_ARCHS:-90}" PYTHON="$PY" bash scripts/build_kernels.sh > "$OUT/build.log" 2>&1
    echo "build rc=$? in $(( $(date +%s) - start )) s"; tail -2 "$OUT/build.log"
  fi
}
