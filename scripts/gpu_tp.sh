#!/usr/bin/env bash
# One GPU job for tensor parallelism, on a host of 2 (or 4) GPUs: build the
# kernels, run the GPU tests of tensor parallelism, measure the NCCL all-reduce,
# then the standard workload and batch-1 decode on the qwen3-8b shape at TP = 1,
# 2 (and 4 when 4 GPUs are visible), and the all-reduce's share of a step.
# Everything it writes goes to $OUT (default: build/gpu-out/tp, ignored by git);
# the summary it prints last is also $OUT/tp_summary.json.
#
#   bash scripts/gpu_tp.sh
#   STAGES="bench" TPS="1 2" bash scripts/gpu_tp.sh
#   PRESET=qwen3-0.6b bash scripts/gpu_tp.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out/tp}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES="${STAGES:-env build tests bench}"
PRESET="${PRESET:-qwen3-8b}"
PY="${PYTHON:-python3}"
NGPU=$(nvidia-smi -L | wc -l)
if [[ -z "${TPS:-}" ]]; then
  TPS="1 2"
  (( NGPU >= 4 )) && TPS="1 2 4"
fi
stage() { [[ " $STAGES " == *" $1 "* ]]; }
source scripts/gpu_env.sh

if stage env; then
  { nvidia-smi -L; nvidia-smi topo -m
    "$PY" -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'
  } 2>&1 | tee "$OUT/env.txt"
fi
if stage build; then build_kernels_unless_built; fi
if stage tests; then
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider --timeout 280 \
    -m "gpu and tensor_parallel" tests/python/test_tensor_parallel.py 2>&1 \
    | tee "$OUT/tests.log" | tail -8
fi
if stage bench; then
  timeout 120 "$PY" benchmarks/allreduce.py --world-size "$NGPU" --output "$OUT/allreduce.json" \
    2>&1 | tail -20
  for tp in $TPS; do
    echo "== TP = $tp: the standard workload on $PRESET"
    timeout "${THROUGHPUT_TIMEOUT:-600}" "$PY" benchmarks/throughput.py --preset "$PRESET" \
      --backends mini-vllm --tensor-parallel-size "$tp" \
      --output "$OUT/throughput_tp$tp.json" 2>&1 | tail -6
    echo "== TP = $tp: batch-1 decode on $PRESET"
    timeout 300 "$PY" benchmarks/latency.py --preset "$PRESET" --backends mini-vllm \
      --prompt-lens 128 --tensor-parallel-size "$tp" --output "$OUT/latency_tp$tp.json" \
      2>&1 | tail -4
    if (( tp > 1 )); then
      echo "== TP = $tp: the all-reduce's share of a step"
      timeout 300 "$PY" benchmarks/tp_profile.py --preset "$PRESET" --tensor-parallel-size "$tp" \
        --output "$OUT/tp_profile_tp$tp.json" 2>&1 | tail -4
    fi
  done
  "$PY" - "$OUT" $TPS <<'EOF'
import json, sys
from pathlib import Path
out, tps = Path(sys.argv[1]), [int(t) for t in sys.argv[2:]]
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
rows, base = [], {}
for tp in tps:
    thr, lat = load(f"throughput_tp{tp}.json"), load(f"latency_tp{tp}.json")
    prof = load(f"tp_profile_tp{tp}.json")
    r = (thr or {}).get("results", {}).get("mini-vllm", {})
    m = ((lat or {}).get("results", {}).get("mini-vllm", {}).get("by_prompt_len", {})
         .get("128", {}))
    row = {"tp": tp, "output_tok_s": r.get("output_tok_s"),
           "fraction_of_floor": r.get("fraction_of_floor"),
           "floor_output_tok_s": (thr or {}).get("floor", {}).get("floor_output_tok_s"),
           "tpot_ms": m.get("tpot_ms"),
           "tpot_floor_ms": ((lat or {}).get("floors", {}).get("128", {})
                             .get("decode_floor_ms")),
           "allreduce_share": {b: v["communication_share"]
                               for b, v in (prof or {}).get("results", {}).items()}}
    if tp == 1:
        base = row
    if base.get("output_tok_s") and row["output_tok_s"]:
        row["throughput_vs_tp1"] = row["output_tok_s"] / base["output_tok_s"]
    if base.get("tpot_ms") and row["tpot_ms"]:
        row["latency_vs_tp1"] = row["tpot_ms"] / base["tpot_ms"]
    rows.append(row)
ar = load("allreduce.json")
summary = {"rows": rows, "nccl_busbw_bytes_per_s": (ar or {}).get("busbw_bytes_per_s"),
           "bar": "TP=2: throughput >= 1.7x TP=1, batch-1 latency <= 0.6x"}
(out / "tp_summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
fi
