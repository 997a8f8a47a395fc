#!/usr/bin/env bash
# One GPU job for structured outputs (chapter 18): the GPU tests of
# tests/python/test_structured_output.py, then the standard throughput workload twice
# in the same process tree, plain and with every request under a JSON schema
# (`benchmarks/throughput.py --json-schema records`), and the mask's costs at
# Qwen3's vocabulary width (`benchmarks/structured_output.py`). The bar: the
# constrained run keeps at least 90 % of the plain run's output tok/s.
# Everything it writes goes to $OUT (default: build/gpu-out, ignored by git):
# structured_output_throughput.json, structured_output_cuda.json, tests.log.
#
#   bash scripts/gpu_structured_output.sh                  # everything (~5 min)
#   STAGES="bench" bash scripts/gpu_structured_output.sh
#   WHEELS=wheels/ bash scripts/gpu_structured_output.sh   # install xgrammar from wheels
#
# The machine needs xgrammar (and jsonschema for the tests): with WHEELS set, they
# are installed from that folder (`pip download xgrammar jsonschema -d wheels/` on a
# machine with a network). Copy the two JSON files to benchmarks/results/ and run
# `python scripts/figures.py` to put them in the book.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES="${STAGES:-env deps build tests bench micro}"
PY="${PYTHON:-python3}"

source scripts/gpu_env.sh
stage() { [[ " $STAGES " == *" $1 "* ]]; }

if stage env; then
  { nvidia-smi -L
    "$PY" -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda)'
  } 2>&1 | tee "$OUT/env.txt"
fi
if stage deps; then
  if ! "$PY" -c 'import xgrammar, jsonschema' 2>/dev/null; then
    if [[ -n "${WHEELS:-}" ]]; then
      "$PY" -m pip install -q --no-index --find-links "$WHEELS" xgrammar jsonschema
    fi
    "$PY" -c 'import xgrammar, jsonschema' || {
      echo "xgrammar and jsonschema are needed: set WHEELS to a folder of their wheels"; exit 1; }
  fi
  "$PY" -c 'import xgrammar; print("xgrammar", xgrammar.__version__)' | tee -a "$OUT/env.txt"
fi
if stage build; then
  build_kernels_unless_built
fi
if stage tests; then
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider --timeout 240 -m gpu \
    tests/python/test_structured_output.py 2>&1 | tee "$OUT/tests.log" | tail -15
fi
if stage bench; then
  timeout "${THROUGHPUT_TIMEOUT:-540}" "$PY" benchmarks/throughput.py --backends mini-vllm \
    --json-schema records --output "$OUT/structured_output_throughput.json" 2>&1 | tail -12
fi
if stage micro; then
  timeout 300 "$PY" benchmarks/structured_output.py --vocab-size 151936 \
    --output "$OUT/structured_output_cuda.json" 2>&1 | tail -30
fi
