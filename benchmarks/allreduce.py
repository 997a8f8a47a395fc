"""NCCL all-reduce bandwidth between the GPUs of this host (tensor parallelism's floor).

    python benchmarks/allreduce.py --world-size 2 --output benchmarks/runs/allreduce.json

One process per GPU joins a NCCL group and times `all_reduce` of bfloat16
buffers from 8 KiB to 256 MiB with CUDA events. For each size it reports
the algorithm bandwidth (`bytes / time`) and the bus bandwidth
(`algbw × 2 (N - 1) / N`, nccl-tests' convention: what each link carries in a
ring all-reduce, comparable across N). The largest size's bus bandwidth is
the one the tensor-parallel floor uses (`common.tensor_parallel_floor`); the
sizes a decode step reduces (`[batch, hidden]`, a few MiB or less) show how
far below it small messages fall.

`measure_allreduce` is also what `throughput.py` and `latency.py` call, in
the same job as their runs, when `--tensor-parallel-size` is above 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RUNS_DIR, environment, write_json

DEFAULT_SIZES = [2**k for k in range(13, 29, 1)]  # 8 KiB (one token of 4,096) .. 256 MiB


def _worker(rank: int, world_size: int, port: int, sizes: list[int], iters: int,
            queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):  # warm-up (the first call sets up the communicator)
            dist.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
        algbw = nbytes / seconds
        rows.append({"bytes": nbytes, "time_us": seconds * 1e6, "algbw_bytes_per_s": algbw,
                     "busbw_bytes_per_s": algbw * 2 * (world_size - 1) / world_size})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def measure_allreduce(world_size: int, sizes: Sequence[int] = DEFAULT_SIZES,
                      iters: int = 50) -> dict[str, Any]:
    """Time NCCL all-reduce over GPUs `0 .. world_size - 1` (one process each).

    Returns:
        `{"world_size", "sizes": [rows], "busbw_bytes_per_s"}`: the last from the
        largest size.
    """
    import torch.multiprocessing as mp

    from mini_vllm.distributed.parallel_state import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, list(sizes), iters, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"all-reduce worker exited with code {p.exitcode}")
    return {"world_size": world_size, "sizes": rows,
            "busbw_bytes_per_s": rows[-1]["busbw_bytes_per_s"]}


def allreduce_time_s(result: dict[str, Any], nbytes: int) -> float:
    """The measured time of one all-reduce of `nbytes` (the smallest measured size at
    least that large): small messages cost their latency, not bytes over bandwidth."""
    rows = [r for r in result["sizes"] if r["bytes"] >= nbytes] or result["sizes"][-1:]
    return rows[0]["time_us"] / 1e6


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=None,
                   help="GPUs to reduce over (default: every visible GPU)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--output", default=str(RUNS_DIR / "allreduce.json"))
    ns = p.parse_args(argv)
    import torch

    n = ns.world_size or torch.cuda.device_count()
    if n < 2:
        raise SystemExit("all-reduce needs at least 2 GPUs")
    result = measure_allreduce(n, iters=ns.iters)
    for row in result["sizes"]:
        print(f"{row['bytes'] / 2**20:10.3f} MiB  {row['time_us']:9.1f} us  "
              f"algbw {row['algbw_bytes_per_s'] / 1e9:7.1f} GB/s  "
              f"busbw {row['busbw_bytes_per_s'] / 1e9:7.1f} GB/s")
    report = {"benchmark": "allreduce", "environment": environment("cuda"), **result}
    print(f"wrote {write_json(ns.output, report)}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    main()
