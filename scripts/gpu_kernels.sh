#!/usr/bin/env bash
# One GPU run for the kernels: build, test, benchmark, profile.
# Everything it writes goes to $OUT (default: build/gpu-out, ignored by git).
#
#   bash scripts/gpu_kernels.sh                       # all stages
#   STAGES="build tests" bash scripts/gpu_kernels.sh
#   TABLES="main versions" bash scripts/gpu_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES="${STAGES:-env build tests bench ncu}"
TABLES="${TABLES:-main heads32 block_sizes versions tuning prefill}"
PY="${PYTHON:-python3}"

stage() { [[ " $STAGES " == *" $1 "* ]]; }

if stage env; then
  {
    nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv
    "$PY" -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda)
print(torch.ops.aten._flash_attention_forward.default._schema)'
    nvcc --version | tail -1; cmake --version | head -1
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
fi
if stage build; then
  start=$(date +%s)
  CUDA_ARCHS="${CUDA_ARCHS:-90}" PYTHON="$PY" \
    CMAKE_ARGS="-DMINI_VLLM_PTXAS_VERBOSE=ON" bash scripts/build_kernels.sh > "$OUT/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - start )) s"; tail -2 "$OUT/build.log"
fi
if stage tests; then
  timeout "${TEST_TIMEOUT:-120}" "$PY" -m pytest tests/python/test_kernels.py -q -p no:cacheprovider \
    --timeout 120 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if stage bench; then
  timeout "${BENCH_TIMEOUT:-280}" "$PY" benchmarks/kernels.py --tables $TABLES \
    --flex-budget "${FLEX_BUDGET:-60}" --out "$OUT/kernels_h200.json" 2>&1 | tee "$OUT/bench.log" | tail -70
fi
if stage ncu; then
  for shape in ${NCU_SHAPES:-64,4096,16 1,8192,16}; do
    timeout 50 ncu --clock-control none -k regex:paged_attention_v5 --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats \
      "$PY" benchmarks/kernels.py --profile "$shape" >> "$OUT/ncu.txt" 2>&1
  done
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|Theoretical Occ" "$OUT/ncu.txt" | head -40
fi
