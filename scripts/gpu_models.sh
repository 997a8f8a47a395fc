#!/usr/bin/env bash
# One GPU job for the model families (chapter "More models"): build the kernels
# (unless they import already), run the GPU tests of tests/python/test_models.py,
# time the experts of one MoE layer, then the standard throughput workload on each
# real shape with random weights (mini-vllm only), Qwen3-8B first: the bar is each
# dense family's fraction of its floor against Qwen3's, measured in the same job.
# Everything it writes goes to $OUT (default: build/gpu-out, ignored by git): one
# JSON per shape, moe.json, tests.log, and models_summary.json gathering them.
#
#   bash scripts/gpu_models.sh                                   # everything (~20 min)
#   SHAPES="qwen3-8b llama3-8b qwen2.5-7b" bash scripts/gpu_models.sh
#   STAGES="bench" SHAPES="mistral-7b gpt2-xl qwen3-30b-a3b" bash scripts/gpu_models.sh
#
# GPT-2 XL has 1,024 positions: its workload draws prompts and outputs of 100-500
# tokens (the standard draw's seed and request count). Qwen3-30B-A3B's 61 GB of
# bf16 weights leave an 80 GB H100 about 8 GB of KV cache (an H200 about 60 GB).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES="${STAGES:-env build tests moe bench summary}"
SHAPES="${SHAPES:-qwen3-8b llama3-8b qwen2.5-7b mistral-7b gpt2-xl qwen3-30b-a3b}"
PY="${PYTHON:-python3}"

source scripts/gpu_env.sh
stage() { [[ " $STAGES " == *" $1 "* ]]; }

if stage env; then
  { nvidia-smi -L
    "$PY" -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda)'
    "$PY" -c 'import transformers; print("transformers", transformers.__version__)'
  } 2>&1 | tee "$OUT/env.txt"
fi
if stage build; then
  build_kernels_unless_built
fi
if stage tests; then
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider --timeout 240 -m gpu \
    tests/python/test_models.py 2>&1 | tee "$OUT/tests.log" | tail -15
fi
if stage moe; then
  timeout 300 "$PY" benchmarks/moe.py --output "$OUT/moe.json" 2>&1 | tail -10
fi
if stage bench; then
  for shape in $SHAPES; do
    extra=()
    if [[ "$shape" == gpt2-xl ]]; then
      extra=(--max-model-len 1024 --input-len-range 100 500 --max-tokens-range 100 500)
    fi
    echo "== $shape"
    timeout "${THROUGHPUT_TIMEOUT:-540}" "$PY" benchmarks/throughput.py --preset "$shape" \
      --backends mini-vllm "${extra[@]}" --output "$OUT/throughput_$shape.json" 2>&1 | tail -9
  done
fi
if stage summary; then
  "$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for path in sorted(out.glob("throughput_*.json")):
    d = json.loads(path.read_text())
    r = d["results"]["mini-vllm"]
    shape = path.stem.removeprefix("throughput_")
    rows[shape] = {"status": r.get("status"), "output_tok_s": r.get("output_tok_s"),
                   "fraction_of_floor": r.get("fraction_of_floor"),
                   "fraction_of_byte_floor": r.get("fraction_of_byte_floor"),
                   "floor_s": d["floor"]["floor_s"], "byte_floor_s": d["floor"]["byte_floor_s"],
                   "device": d["environment"].get("gpu") or d["environment"].get("device")}
base = (rows.get("qwen3-8b") or {}).get("fraction_of_floor")
for shape, row in rows.items():
    f = row["fraction_of_floor"]
    row["points_below_qwen3_8b"] = None if f is None or base is None else 100 * (base - f)
    gap = row["points_below_qwen3_8b"]
    print(f"{shape:15s} {row['status']:6s} {row['output_tok_s'] or 0:10,.0f} tok/s  "
          f"{100 * (f or 0):5.1f} % of floor  {100 * (row['fraction_of_byte_floor'] or 0):5.1f} % "
          f"of byte floor  " + ("" if gap is None else f"{gap:.1f} points below qwen3-8b"))
(out / "models_summary.json").write_text(json.dumps(rows, indent=2) + "\n")
EOF
fi
