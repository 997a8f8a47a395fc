"""The all-reduce's share of a tensor-parallel step, from a profile of rank 0.

    python benchmarks/tp_profile.py --preset qwen3-8b --tensor-parallel-size 2 \\
        --output benchmarks/runs/tp_profile_tp2.json

Builds the engine (random weights of the preset's shape), runs one warm-up
batch, then profiles one batch of `--batch` requests (`--prompt-len` tokens
each, `--output-len` generated) with `torch.profiler` in the driver, which is
rank 0. Every kernel rank 0 ran is put in one of two heaps: NCCL's (the
all-reduces, the logits' all-gather and the broadcast of the previous
step's samples) and the rest. The share is NCCL's time over all kernel time:
it includes the time a rank waits in the collective for the slower rank, so
it is what communication costs this rank, not only the bytes on the wire.
On the CPU (gloo) the same split is made over the CPU operators instead.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RUNS_DIR,
    TEMPERATURE,
    environment,
    prepare_model_dir,
    resolve_device,
    write_json,
)

# Names of the kernels (GPU) and operators (CPU) that are communication.
_COMM_MARKERS = ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "broadcast",
                 "gloo")


def is_communication(name: str) -> bool:
    """Whether a profiled kernel or operator is one of the collectives."""
    lowered = name.lower()
    return any(m in lowered for m in _COMM_MARKERS)


def profile_batch(llm: Any, prompts: list[list[int]], output_len: int,
                  cuda: bool) -> dict[str, Any]:
    """Profile one `generate` of `prompts` and split rank 0's time into NCCL and the rest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mini_vllm import SamplingParams

    params = SamplingParams(temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=0.0,
                            ignore_eos=True, max_tokens=output_len)
    requests = [{"prompt_token_ids": p} for p in prompts]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps0 = llm.engine.stats["num_steps"]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(requests, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = llm.engine.stats["num_steps"] - steps0
    comm = other = 0.0
    by_name: dict[str, float] = {}
    for event in prof.key_averages():
        # Kernels on the GPU; on the CPU, the operators' own time (no double counting).
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0 or (cuda and event.device_type.name != "CUDA"):
            continue
        if is_communication(event.key):
            comm += us
            by_name[event.key] = by_name.get(event.key, 0.0) + us
        else:
            other += us
    total = comm + other
    return {"wall_s": wall, "steps": steps, "kernel_time_us": total,
            "communication_us": comm, "communication_share": comm / total if total else 0.0,
            "communication_per_step_us": comm / steps if steps else 0.0,
            "communication_kernels": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:8])}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --preset")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64],
                   help="batch sizes to profile (one profile each)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--output", default=str(RUNS_DIR / "tp_profile.json"))
    ns = p.parse_args(argv)
    ns.device = resolve_device(ns.device)
    from mini_vllm import LLM

    cuda = ns.device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="mini-vllm-tp-") as tmp:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp))
        llm = LLM(str(model_dir), tensor_parallel_size=ns.tensor_parallel_size,
                  load_format=load_format, device=ns.device, enforce_eager=ns.enforce_eager,
                  max_model_len=ns.prompt_len + ns.output_len + 16,
                  max_num_seqs=max(ns.batch), enable_prefix_caching=False)
        vocab = llm.engine.config.model_config.vocab_size
        results = {}
        for b in ns.batch:
            prompts = [[(31 * i + 7 * j + 3) % min(vocab, 10000) for j in range(ns.prompt_len)]
                       for i in range(b)]
            profile_batch(llm, prompts[:1], 8, cuda)  # warm-up (graphs, allocator)
            results[str(b)] = profile_batch(llm, prompts, ns.output_len, cuda)
            r = results[str(b)]
            print(f"batch {b}: {r['steps']} steps, communication "
                  f"{100 * r['communication_share']:.1f} % of rank 0's kernel time "
                  f"({r['communication_per_step_us']:.0f} us a step)", flush=True)
        llm.engine.shutdown()
    report = {"benchmark": "tp_profile", "environment": environment(ns.device),
              "args": vars(ns), "results": results}
    print(f"wrote {write_json(ns.output, report)}")
    return report


if __name__ == "__main__":
    main()
