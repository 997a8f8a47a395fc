#!/usr/bin/env bash
# This tree against another on the same GPU, side by side: the same benchmarks,
# alternated (base, this, base, this ...), each writing JSON to $OUT.
#
#   git archive <commit> | tar -x -C /tmp/base      # the tree to compare against
#   BASE=/tmp/base bash scripts/gpu_compare.sh
#   BASE=/tmp/base PAIRS=2 BENCH="throughput latency serving" bash scripts/gpu_compare.sh
#
# The base tree runs with its own Python sources and this tree's built kernels
# (mini_vllm/_C*.so is copied over when it has none), so only a base whose csrc/
# matches this one's compares like for like. Serving needs fastapi, uvicorn and
# pydantic importable (the package's dependencies).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out}"
BASE="${BASE:?BASE: the directory of the tree to compare against}"
PAIRS="${PAIRS:-2}"
BENCH="${BENCH:-throughput latency serving}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if ! ls "$BASE"/mini_vllm/_C*.so >/dev/null 2>&1; then
  cp mini_vllm/_C*.so "$BASE/mini_vllm/"
fi

run() {  # run TREE NAME: every benchmark of $BENCH in TREE, JSON as $OUT/<bench>_NAME.json
  local tree=$1 name=$2
  for b in $BENCH; do
    case $b in
      throughput) (cd "$tree" && timeout 300 "$PY" benchmarks/throughput.py \
          --backends mini-vllm --breakdown --output "$OUT/throughput_$name.json" \
          2>&1 | grep -E "mini-vllm +\|" | head -2) ;;
      latency) (cd "$tree" && timeout 200 "$PY" benchmarks/latency.py --backends mini-vllm \
          --output "$OUT/latency_$name.json" 2>&1 | grep -E "mini-vllm +\|" | head -4) ;;
      serving) (cd "$tree" && timeout 300 "$PY" benchmarks/serving.py --launch \
          --compare-offline --request-rates inf --num-requests 256 \
          --output "$OUT/serving_$name.json" 2>&1 | tail -4) ;;
    esac
    echo "[$name] $b rc=$?"
  done
}

for i in $(seq 1 "$PAIRS"); do
  run "$BASE" "before_$i"
  run . "after_$i"
done
