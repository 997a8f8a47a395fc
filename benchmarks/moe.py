"""The experts of one MoE layer: the reference loop, the sorted loop and the grouped GEMM.

What it measures: the GPU time of one `FusedMoE` forward (router logits given) in
Qwen3-30B-A3B's shape (128 experts of width 768, hidden 2048, 8 per token) for a
ladder of token counts, by each implementation:

- `reference`: `forward_native`, one batch per expert some token chose (host syncs);
- `sorted_loop`: `forward_fast` without the grouped GEMM: rows sorted by expert, one
  product per expert, the expert counts read on the host once;
- `grouped`: `forward_fast` with PyTorch's grouped GEMM (no host sync: what a CUDA
  graph holds).

Each time is set against the layer's floor: the bytes of the experts the tokens
chose (expected under uniform routing, `ModelShape.experts_read`) over the copy
bandwidth, or the FLOPs of their products over the matmul rate, whichever is longer,
both measured in the same run. Each path is checked against the reference first.

    python benchmarks/moe.py --output benchmarks/runs/moe.json
    python benchmarks/moe.py --device cpu --tokens 1 16 --dtype float32   # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RUNS_DIR,
    ModelShape,
    environment,
    format_table,
    measure_copy_bandwidth,
    measure_matmul_flops,
    resolve_device,
    time_calls,
    write_json,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 8192],
                   help="token counts to time")
    p.add_argument("--experts", type=int, default=128, help="experts of the layer")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--intermediate", type=int, default=768, help="width of one expert")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=20, help="timed calls per case")
    p.add_argument("--output", default=str(RUNS_DIR / "moe.json"), help="JSON results")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from mini_vllm.layers.fused_moe import FusedMoE, _grouped_mm_fn
    from mini_vllm.model_config import resolve_dtype

    ns = build_parser().parse_args(argv)
    device = torch.device(resolve_device(ns.device))
    dtype = resolve_dtype(ns.dtype)
    copy = measure_copy_bandwidth(str(device))
    matmul = measure_matmul_flops(str(device), ns.dtype)
    bw, rate = copy["bandwidth_bytes_per_s"], matmul["flops_per_s"]
    shape = ModelShape(num_layers=1, hidden_size=ns.hidden, intermediate_size=0, num_heads=1,
                       num_kv_heads=1, head_dim=1, vocab_size=1, tie_word_embeddings=True,
                       num_experts=ns.experts, num_experts_per_tok=ns.top_k,
                       moe_intermediate_size=ns.intermediate, num_moe_layers=1)
    gen = torch.Generator(device=device).manual_seed(0)
    moe = FusedMoE(ns.experts, ns.top_k, ns.hidden, ns.intermediate, renormalize=True,
                   device=device, dtype=dtype)
    moe.w13.normal_(0, ns.hidden**-0.5, generator=gen)
    moe.w2.normal_(0, ns.intermediate**-0.5, generator=gen)
    moe.use_fast = True
    can_group = _grouped_mm_fn() is not None
    rows = []
    for t in ns.tokens:
        x = torch.randn(t, ns.hidden, device=device, generator=gen).to(dtype)
        logits = torch.randn(t, ns.experts, device=device, generator=gen).to(dtype)
        want = moe.forward_native(x, logits).float()
        paths = {"reference": functools.partial(moe.forward_native, x, logits),
                 "sorted_loop": functools.partial(moe.forward_fast, x, logits)}
        if can_group:
            paths["grouped"] = functools.partial(moe.forward_fast, x, logits)
        nbytes = shape.experts_read(t) * shape.expert_params * dtype.itemsize
        flops = 2.0 * t * ns.top_k * shape.expert_params
        floor_s = max(nbytes / bw, flops / rate)
        row: dict[str, Any] = {"tokens": t, "experts_read": shape.experts_read(t),
                               "floor_ms": 1e3 * floor_s}
        for name, fn in paths.items():
            moe.grouped = name == "grouped"
            got = fn().float()
            error = ((got - want).norm() / want.norm()).item()
            if error > 2e-2:
                raise AssertionError(f"{name} at {t} tokens: relative error {error:.3g}")
            seconds = statistics.median(time_calls(fn, device, ns.iters, warmup=3))
            row[f"{name}_ms"] = 1e3 * seconds
            row[f"{name}_fraction_of_floor"] = floor_s / seconds
        rows.append(row)
    report = {"benchmark": "moe", "environment": environment(str(device)), "args": vars(ns),
              "copy_bandwidth": copy, "matmul": matmul, "results": rows}
    write_json(ns.output, report)
    columns = ["tokens", "experts_read", "floor_ms"] + [
        f"{name}_{what}" for name in ("reference", "sorted_loop", "grouped")
        for what in ("ms", "fraction_of_floor") if f"{name}_ms" in rows[0]]
    print(format_table(rows, columns))
    print(f"wrote {ns.output}")
    return report


if __name__ == "__main__":
    main()
