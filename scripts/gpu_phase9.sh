#!/usr/bin/env bash
# One GPU run for phase 9: build the kernels (unless they import already), run
# the GPU tests of the engine's fast path, then the benchmarks.
# Everything it writes goes to $OUT (default: build/gpu-out, ignored by git).
#
#   bash scripts/gpu_phase9.sh                          # all stages
#   STAGES="build tests" bash scripts/gpu_phase9.sh
#   BENCH="throughput latency" BACKENDS="mini-vllm transformers" bash scripts/gpu_phase9.sh
#   BENCH="serving kernels_v7 kernels_gemv" bash scripts/gpu_phase9.sh   # also: step_profile
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES="${STAGES:-env build tests bench}"
BENCH="${BENCH:-step_profile throughput latency}"
BACKENDS="${BACKENDS:-mini-vllm transformers}"
PY="${PYTHON:-python3}"

source scripts/gpu_env.sh
stage() { [[ " $STAGES " == *" $1 "* ]]; }
bench() { [[ " $BENCH " == *" $1 "* ]]; }

if stage env; then
  { nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv
    "$PY" -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda)'
  } 2>&1 | tee "$OUT/env.txt"
fi
if stage build; then
  build_kernels_unless_built
fi
if stage tests; then
  timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider --timeout 200 -m gpu \
    ${TESTS:-tests/python/test_fused_kernels.py tests/python/test_gemv.py \
      tests/python/test_phase9_gpu.py tests/python/test_phase5.py} 2>&1 \
    | tee "$OUT/tests.log" | tail -15
fi
if stage bench; then
  if bench step_profile; then
    timeout 200 "$PY" benchmarks/step_profile.py --output "$OUT/step_profile.json" 2>&1 | tail -14
    timeout 120 "$PY" benchmarks/step_profile.py --batch 1 --context 128 --no-engine \
      --output "$OUT/step_profile_b1.json" 2>&1 | tail -8
  fi
  if bench throughput; then
    timeout "${THROUGHPUT_TIMEOUT:-420}" "$PY" benchmarks/throughput.py --backends $BACKENDS \
      --breakdown --output "$OUT/throughput.json" 2>&1 | tail -30
  fi
  if bench latency; then
    timeout 240 "$PY" benchmarks/latency.py --backends $BACKENDS --output "$OUT/latency.json" \
      2>&1 | tail -10
  fi
  if bench serving; then  # needs fastapi, uvicorn and pydantic (the package's dependencies)
    timeout 300 "$PY" benchmarks/serving.py --launch --compare-offline --request-rates 16 inf \
      --num-requests 256 --output "$OUT/serving.json" 2>&1 | tail -8
  fi
  if bench kernels_gemv; then
    timeout 200 "$PY" benchmarks/kernels.py --tables gemv --out "$OUT/kernels_gemv_h200.json" \
      2>&1 | tail -14
  fi
  if bench kernels_v7; then
    timeout 360 "$PY" benchmarks/kernels.py --tables v7 v7parts --out "$OUT/kernels_v7_h200.json" \
      2>&1 | tail -30
  fi
fi
