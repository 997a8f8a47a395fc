"""Paged decode attention: achieved bandwidth against the copy bandwidth and torch's paths.

For each shape (batch x context, block size, query / KV heads, head_dim 128,
bf16) it times

* ``ours``: ``mini_vllm.ops.paged_decode_attention`` (the default version
  unless ``--version`` says otherwise; the main table also times the others
  of versions 5, 6 and 7 as ``ours_v5`` / ``ours_v6`` / ``ours_v7``),
* ``gather_sdpa``: gather the paged K/V into a padded batch, then
  ``scaled_dot_product_attention`` (a paged path in plain PyTorch),
* ``sdpa_contig``: SDPA over K/V stored contiguously (not paged: the cost of
  attention without the paging),
* ``flex_contig``: compiled FlexAttention over the contiguous K/V (on a subset
  of shapes: every shape compiles anew),

and reports each as bytes that must move over time: Q, K, V and the output,
K/V counted once per KV head, against a device-to-device copy (bytes read +
written) measured in the same run. Timing: the calls are captured in a CUDA
graph that rotates over enough copies of the inputs to defeat the 60 MB L2,
the graph is replayed many times between CUDA events, and the median of
several such measurements is kept.

Run it from the repository root after ``bash scripts/build_kernels.sh``::

    python benchmarks/kernels.py                      # all tables -> benchmarks/runs/kernels.json
    python benchmarks/kernels.py --tables main --out main.json
    python benchmarks/kernels.py --tables v7 --out v7.json  # version 7 vs 5 vs SDPA, ~3 min
    python benchmarks/kernels.py --tables mixed --out benchmarks/results/kernels_mixed_h200.json
    python benchmarks/kernels.py --dry-run            # tiny shapes, checks every path (CPU ok)
    python benchmarks/kernels.py --report benchmarks/results/kernels_h200.json  # markdown tables

Tables: ``main`` (16/8 heads, block 16), ``heads32`` (32/8 heads),
``block_sizes``, ``versions`` (the chapter's kernel versions),
``pipeline`` (version 6's unroll and ring depths against version 5 and SDPA
on contiguous K/V, at the shapes of the bar), ``v7`` (version 7, the
tensor-core kernel, as the wrapper picks it and at fixed warps / stages, against
version 5 and SDPA on contiguous K/V, at the shapes of the bar and at
Qwen3-8B's 32/8 heads), ``v7parts`` (version 7 at fixed partition sizes,
two warps / stages each, against SDPA on contiguous K/V at the bar's
shapes), ``v7blocks`` (version 7 as the wrapper picks it against SDPA on
contiguous K/V at the bar's shapes, with blocks of 16 to 128 tokens handed out
in random order), ``v7layout`` (version 7 over the token-major cache and
over the same cache stored head-major, one head's rows of a block contiguous,
against SDPA on contiguous K/V at the bar's shapes, blocks of 16 and 64),
``v7order`` (version 7 over the token-major and the head-major cache with the
blocks handed out in order and scattered, against SDPA on contiguous K/V, at
the bar's 128-sequence shapes and 64 and 256 x 4096),
``v7wave`` (version 7 at one warp a CTA, 2 to 4 stages, against its default
ring and SDPA on contiguous K/V at the bar's shapes: at 3 stages eight CTAs fit
an H200 SM, so 128 sequences' grid runs as one wave),
``v8`` (version 8, version 7's tiles cut evenly over a persistent
grid, against version 7 and SDPA on contiguous K/V), ``v9`` (version 9, version
7's tiles copied by the TMA, against version 7 and SDPA on contiguous K/V, at
the v7 table's shapes), ``mixed`` (version 7 on batches of contexts from
100 to 2,047 tokens, its grid taking the sequences in the drawn order or
longest first, with the default ring and the wide ones), ``layout`` (one KV
head with blocks in order: the paged cache then holds the bytes in SDPA's
contiguous order), ``tuning`` (partition sizes and unroll depths), ``prefill``,
``gemv`` (the skinny GEMM of decode's linear layers against cuBLAS at 1 to
16 rows, Qwen3-0.6B's and Qwen3-8B's shapes; bytes are the weight, x and y,
each once), ``gemm`` (``gemm_wgmma`` against cuBLAS at 24 to 256 rows),
``gemm_plans`` (``gemm_wgmma`` at every plan, tile width by rows per CTA by
splits of K, at Qwen3-0.6B's shapes: the sweep that sets the constants of its
``plan_cycles``; path ``ours_r128s4t64`` is 128 rows, 4 splits, 64 outputs),
``silu_plans`` (the same for gate_up_proj with SiLU · mul in its epilogue,
at 24 to 128 rows, 128 rows per CTA),
``gemm_l2`` (Qwen3-0.6B's products at 8 to 256 rows on our kernels, the
GEMV to 16 rows and ``gemm_wgmma`` above, and on cuBLAS, each with its weight
read from HBM and from the L2)::

    python benchmarks/kernels.py --tables gemm_l2 --out benchmarks/results/kernels_gemm_l2_h200.json

and ``fused`` (q/k-norm + RoPE with the KV write and SiLU · mul, as a Qwen3-0.6B
layer calls them, at 1 to 8,192 tokens)::

    python benchmarks/kernels.py --tables fused --out benchmarks/results/kernels_fused_h200.json

and ``silu_epilogue`` (Qwen3-0.6B's gate_up_proj with SiLU · mul in the
product's epilogue, against the product and the ``silu_and_mul`` kernel, ours
and cuBLAS's, at 1 to 256 rows)::

    python benchmarks/kernels.py --tables silu_epilogue \\
        --out benchmarks/results/kernels_silu_epilogue_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_vllm import ops
from mini_vllm.ops.gemv import GEMV_MAX_ROWS, gemm_wgmma
from mini_vllm.ops.prefill import _gather_paged, flash_wgmma_supported
from mini_vllm.ops.reference import paged_decode_attention_ref

# Where a run writes by default: a folder that git ignores (the committed runs in
# benchmarks/results/ were each written with an explicit --out).
RUNS_DIR = Path(__file__).resolve().parent / "runs"

L2_DEFEAT_BYTES = 512 * 2**20  # rotate inputs until this many bytes are touched per graph
MAX_ROTATIONS = 32
HEAD_DIM = 128
DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------
def l2_rotations(nbytes: int) -> int:
    """Copies of a call's inputs to rotate through, `nbytes` each, so that a
    graph of the calls touches L2_DEFEAT_BYTES (at most MAX_ROTATIONS)."""
    return max(1, min(MAX_ROTATIONS, math.ceil(L2_DEFEAT_BYTES / nbytes)))


def time_calls(calls: list[Callable[[], object]], use_graph: bool, target_ms: float = 30.0,
               trials: int = 5) -> float:
    """Median seconds per call of `calls` (one per input rotation), on the current device."""
    for fn in calls:  # warm-up (also compiles / autotunes)
        fn()
    torch.cuda.synchronize()
    run: Callable[[], None]
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        run = graph.replay
    else:
        def run() -> None:
            for fn in calls:
                fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = max(1, min(1000, int(target_ms / once)))
    samples = []
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / (reps * len(calls)))
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int = 4 * 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_calls([lambda: dst.copy_(src)], use_graph=False, target_ms=100.0)


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------
class DecodeCase:
    """R rotations of one decode shape: a paged cache plus its contiguous twin."""

    def __init__(self, batch: int, ctx: int, block_size: int, num_q_heads: int,
                 num_kv_heads: int, device: torch.device, contiguous: bool,
                 gather_index: bool, scattered: bool = True, seed: int = 0,
                 head_major: bool = False) -> None:
        torch.manual_seed(seed)
        self.batch, self.ctx, self.block_size = batch, ctx, block_size
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        kv_bytes = 2 * batch * ctx * num_kv_heads * HEAD_DIM * 2
        self.rotations = l2_rotations(kv_bytes)
        blocks_per_seq = math.ceil(ctx / block_size)
        num_blocks = self.rotations * batch * blocks_per_seq + 1
        shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=DTYPE, device=device)
        self.v_cache = torch.randn(shape, dtype=DTYPE, device=device)
        # Blocks handed out in a random order, as a long-running pool does
        # (or in order, to measure what the scattering costs).
        if scattered:
            perm = torch.randperm(num_blocks - 1, device=device).to(torch.int32) + 1
        else:
            perm = torch.arange(1, num_blocks, dtype=torch.int32, device=device)
        tables = perm[: self.rotations * batch * blocks_per_seq].view(
            self.rotations, batch, blocks_per_seq)
        self.block_tables = [tables[r].contiguous() for r in range(self.rotations)]
        self.context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.queries = [torch.randn((batch, num_q_heads, HEAD_DIM), dtype=DTYPE, device=device)
                        for _ in range(self.rotations)]
        self.outs = [torch.empty_like(q) for q in self.queries]
        self.scale = HEAD_DIM ** -0.5
        self.slots: list[torch.Tensor] = []
        if gather_index:  # [batch, ctx] cache slot of every token, built once (not timed)
            pos = torch.arange(ctx, device=device)
            for table in self.block_tables:
                self.slots.append(table[:, pos // block_size].long() * block_size
                                  + pos % block_size)
        # The same cache stored head-major ([block][head][token][dim]: one
        # head's rows of a block contiguous), seen as [block, token, head, dim].
        self.k_head_major = self.v_head_major = None
        if head_major:
            self.k_head_major = self.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
            self.v_head_major = self.v_cache.transpose(1, 2).contiguous().transpose(1, 2)
        self.k_contig: list[torch.Tensor] = []
        self.v_contig: list[torch.Tensor] = []
        if contiguous:  # [batch, Hkv, ctx, D], the same values as the paged cache
            for r in range(self.rotations):
                k, v = self.gather(r)
                self.k_contig.append(k.contiguous())
                self.v_contig.append(v.contiguous())

    @property
    def bytes_moved(self) -> int:
        """Q + K + V + output, K/V once per KV head."""
        q = self.batch * self.num_q_heads * HEAD_DIM * 2
        kv = 2 * self.batch * self.ctx * self.num_kv_heads * HEAD_DIM * 2
        return 2 * q + kv

    def gather(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of rotation r as [batch, Hkv, ctx, D] (non-contiguous views of a copy)."""
        slots = self.slots[r] if self.slots else None
        if slots is None:
            pos = torch.arange(self.ctx, device=self.k_cache.device)
            slots = (self.block_tables[r][:, pos // self.block_size].long() * self.block_size
                     + pos % self.block_size)
        flat = (-1, self.num_kv_heads, HEAD_DIM)
        k = self.k_cache.view(flat)[slots]  # [batch, ctx, Hkv, D]
        v = self.v_cache.view(flat)[slots]
        return k.transpose(1, 2), v.transpose(1, 2)


def path_calls(case: DecodeCase, path: str, **kw: object) -> list[Callable[[], object]]:
    """One callable per rotation for a decode path."""
    calls: list[Callable[[], object]] = []
    # a variant of ours over the head-major copy of the cache
    k, v = ((case.k_head_major, case.v_head_major) if kw.get("head_major")
            else (case.k_cache, case.v_cache))
    kernel_kw = {n: a for n, a in kw.items() if n != "head_major"}
    for r in range(case.rotations):
        q, out, table = case.queries[r], case.outs[r], case.block_tables[r]
        if path.startswith("ours"):  # "ours" or a named variant ("ours_gt4")
            calls.append(lambda q=q, out=out, table=table: ops.paged_decode_attention(
                q, k, v, table, case.context_lens, case.scale, case.ctx, out=out, **kernel_kw))
        elif path == "gather_sdpa":
            def fn(q: torch.Tensor = q, r: int = r) -> torch.Tensor:
                k, v = case.gather(r)
                return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=case.scale,
                                                      enable_gqa=True)
            calls.append(fn)
        elif path == "sdpa_contig":
            calls.append(lambda q=q, k=case.k_contig[r], v=case.v_contig[r]:
                         F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=case.scale,
                                                        enable_gqa=True))
        elif path == "flex_contig":
            flex = kw["flex"]
            calls.append(lambda q=q, k=case.k_contig[r], v=case.v_contig[r], flex=flex:
                         flex(q.unsqueeze(2), k, v, scale=case.scale, enable_gqa=True))
        else:
            raise ValueError(path)
    return calls


def check_path(case: DecodeCase, path: str, **kw: object) -> float:
    """Relative error of a path's output against the torch reference (rotation 0)."""
    out = path_calls(case, path, **kw)[0]()
    if path.startswith("ours"):
        out = case.outs[0]
    out = out.reshape(case.batch, case.num_q_heads, HEAD_DIM).float()
    ref = paged_decode_attention_ref(case.queries[0], case.k_cache, case.v_cache,
                                     case.block_tables[0], case.context_lens, case.scale).float()
    return ((out - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------
def bench_decode(shapes: list[tuple[int, int, int, int, int]], paths: list[str], copy_bw: float,
                 device: torch.device, flex_budget_s: float = 0.0, check: bool = True,
                 ours_kw: dict | None = None, scattered: bool = True,
                 variants: dict[str, dict] | None = None) -> list[dict]:
    """Time every path at every (batch, ctx, block_size, Hq, Hkv) shape."""
    rows = []
    flex = None
    flex_spent = 0.0
    if "flex_contig" in paths:
        from torch._dynamo import config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        dynamo_config.recompile_limit = 1000  # one compile per shape
        flex = torch.compile(flex_attention, dynamic=False)
    for batch, ctx, block_size, hq, hkv in shapes:
        want = [p for p in paths if p != "flex_contig" or flex_spent < flex_budget_s]
        case = DecodeCase(batch, ctx, block_size, hq, hkv, device,
                          contiguous=any(p.endswith("contig") for p in want),
                          gather_index="gather_sdpa" in want, scattered=scattered,
                          head_major=any((variants or {}).get(p, {}).get("head_major")
                                         for p in want))
        row = {"batch": batch, "context": ctx, "block_size": block_size, "num_q_heads": hq,
               "num_kv_heads": hkv, "bytes": case.bytes_moved, "rotations": case.rotations,
               "paths": {}}
        for path in want:
            kw = dict(ours_kw or {}) if path == "ours" else dict((variants or {}).get(path, {}))
            if path == "flex_contig":
                kw["flex"] = flex
            t0 = time.perf_counter()
            try:
                err = check_path(case, path, **kw) if check else None
                sec = time_calls(path_calls(case, path, **kw), use_graph=True)
            except Exception as e:  # noqa: BLE001 - a path may not support a shape: record it
                row["paths"][path] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            finally:
                if path == "flex_contig":
                    flex_spent += time.perf_counter() - t0
            bw = case.bytes_moved / sec
            row["paths"][path] = {"us": sec * 1e6, "gbps": bw / 1e9,
                                  "frac_copy": bw / copy_bw, "rel_err": err}
        rows.append(row)
        print_row(row)
        del case
        torch.cuda.empty_cache()
    return rows


def print_row(row: dict) -> None:
    cells = []
    for path, r in row["paths"].items():
        if "error" in r:
            cells.append(f"{path}=ERR")
        else:
            cells.append(f"{path}={r['us']:8.1f}us {100 * r['frac_copy']:5.1f}%")
    print(f"  b={row['batch']:>3} ctx={row['context']:>5} bs={row['block_size']:>3} "
          f"h={row['num_q_heads']}/{row['num_kv_heads']}  " + "  ".join(cells), flush=True)


def _prefill_paths(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   qsl: torch.Tensor, ctx: torch.Tensor, starts: list[int], lens: list[int],
                   fresh: bool) -> dict[str, Callable[[], object]]:
    """The prefill paths of one batch, as zero-argument callables."""
    kw = {"query_start_loc_cpu": starts, "context_lens_cpu": lens}
    scale = HEAD_DIM ** -0.5
    cu = F.pad(torch.cumsum(ctx, 0, dtype=torch.int32), (1, 0))
    paths = {}
    if flash_wgmma_supported(query.device, query.dtype, query.shape[2],
                             query.shape[1] // key.shape[1]):
        # ours (the engine's choice where it runs: the step's own K/V for fresh
        # prompts, the cache through the block tables otherwise), then the same
        # always reading the cache
        paths["flash_wgmma"] = lambda: ops.prefill_attention(
            query, k_cache, v_cache, tables, qsl, ctx, scale, backend="flash_wgmma",
            key=key if fresh else None, value=value if fresh else None, **kw)
        paths["flash_wgmma_paged"] = lambda: ops.prefill_attention(
            query, k_cache, v_cache, tables, qsl, ctx, scale, backend="flash_wgmma", **kw)
    return paths | {
        # PyTorch's FlashAttention-2, no gather when no sequence has a cached prefix
        "flash_varlen": lambda: ops.prefill_attention(
            query, k_cache, v_cache, tables, qsl, ctx, scale, backend="flash_varlen",
            key=key if fresh else None, value=value if fresh else None, **kw),
        "flash_varlen_gather": lambda: ops.prefill_attention(
            query, k_cache, v_cache, tables, qsl, ctx, scale, backend="flash_varlen", **kw),
        "sdpa_per_seq": lambda: ops.prefill_attention(
            query, k_cache, v_cache, tables, qsl, ctx, scale, backend="sdpa", **kw),
        "gather_only": lambda: _gather_paged(k_cache, v_cache, tables, ctx, cu, sum(lens),
                                             max(lens)),
    }


def _workload_chunk(tokens: int) -> list[int]:
    """Prompt lengths drawn as the standard workload draws them (100 to 1,024
    tokens, seed 0), the last cut so that they add up to `tokens`."""
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(rng.randint(100, 1024))
    lens[-1] -= sum(lens) - tokens
    return lens


def bench_prefill(device: torch.device) -> list[dict]:
    """Prefill paths: (cached prefix, new tokens) per sequence, 16/8 heads, block 16."""
    cases = {
        "4 x 2048 prompts": [(0, 2048)] * 4,
        "16 x 512 prompts": [(0, 512)] * 16,
        "4 x 512 after a 1536 prefix": [(1536, 512)] * 4,
        "16 x 128 after a 4096 prefix": [(4096, 128)] * 16,
        "1 x 8192 prompt": [(0, 8192)],
        # a prefill step of the standard throughput workload: prompts of 100 to
        # 1,024 tokens packed into one step of 8,192
        "8192 tokens of workload prompts": [(0, n) for n in _workload_chunk(8192)],
        # the same, its first prompt the rest of one that the step before began
        "the same after a 500-token prefix": [(500, 300)]
        + [(0, n) for n in _workload_chunk(8192 - 300)],
    }
    rows = []
    for name, seqs in cases.items():
        lens = [p + n for p, n in seqs]
        starts = [0]
        for _, n in seqs:
            starts.append(starts[-1] + n)
        bs, hkv, hq = 16, 8, 16
        nb = sum(math.ceil(n / bs) for n in lens) + 1
        k_cache = torch.randn((nb, bs, hkv, HEAD_DIM), dtype=DTYPE, device=device)
        v_cache = torch.randn_like(k_cache)
        perm = (torch.randperm(nb - 1, device=device) + 1).to(torch.int32)
        width = max(math.ceil(n / bs) for n in lens)
        tables = torch.zeros((len(seqs), width), dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(lens):
            k = math.ceil(n / bs)
            tables[i, :k] = perm[used : used + k]
            used += k
        qsl = torch.tensor(starts, dtype=torch.int32, device=device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
        query = torch.randn((starts[-1], hq, HEAD_DIM), dtype=DTYPE, device=device)
        key = torch.randn((starts[-1], hkv, HEAD_DIM), dtype=DTYPE, device=device)
        value = torch.randn_like(key)
        paths = _prefill_paths(query, key, value, k_cache, v_cache, tables, qsl, ctx, starts,
                               lens, fresh=all(p == 0 for p, _ in seqs))
        row = {"case": name, "new_tokens": starts[-1], "context_tokens": sum(lens), "paths": {}}
        for path, fn in paths.items():
            try:
                row["paths"][path] = {"us": time_calls([fn], use_graph=False) * 1e6}
            except Exception as e:  # noqa: BLE001 - a path may fail: record it
                row["paths"][path] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(f"  {name:32s} " + "  ".join(
            f"{p}={r.get('us', float('nan')):9.1f}us" for p, r in row["paths"].items()),
            flush=True)
    return rows


# (layer, K, N) of every linear layer of a decode step: in_features, out_features.
GEMV_SHAPES = {
    "Qwen3-0.6B": [("qkv_proj", 1024, 4096), ("o_proj", 2048, 1024),
                   ("gate_up_proj", 1024, 6144), ("down_proj", 3072, 1024),
                   ("lm_head", 1024, 151936)],
    "Qwen3-8B": [("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096),
                 ("gate_up_proj", 4096, 24576), ("down_proj", 12288, 4096),
                 ("lm_head", 4096, 151936)],
}
GEMV_ROWS = (1, 2, 4, 8, 16)
# The wgmma GEMM: decode batches of 17 to 256 sequences, the layers whose
# tiles of 128 outputs fill the GPU at most once (the lm_head stays cuBLAS's).
GEMM_ROWS = (24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
GEMM_PLAN_ROWS = (32, 64, 96, 128, 192, 256)
# The gemm_l2 table: decode batches on the GEMV (8, 16) and on gemm_wgmma.
GEMM_L2_ROWS = (8, 16, 64, 128, 256)
GEMM_PLAN_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def plan_variants(rows_per_cta: tuple[int, ...] = (128, 256)) -> dict[str, dict]:
    """`gemm_wgmma`'s arguments for every plan of the sweeps, named
    `r<rows>s<splits>t<outputs>` (the names `report_plans` reads)."""
    return {f"r{r}s{s}t{t}": {"rows_per_cta": r, "splits": s, "tile_n": t}
            for t in (128, 64) for r in rows_per_cta for s in GEMM_PLAN_SPLITS}
GEMM_SHAPES = {"Qwen3-0.6B": GEMV_SHAPES["Qwen3-0.6B"][:4],
               "Qwen3-8B": GEMV_SHAPES["Qwen3-8B"][:2] + GEMV_SHAPES["Qwen3-8B"][3:4]}


def engine_product(x: torch.Tensor, weight: torch.Tensor, **kw: object) -> torch.Tensor:
    """Our kernel for a decode step's product as the engine picks it by rows: the GEMV
    up to 16 rows, `gemm_wgmma` above (the model sends 129 or more rows to cuBLAS)."""
    return (ops.gemv if x.shape[0] <= GEMV_MAX_ROWS else gemm_wgmma)(x, weight, **kw)


# --8<-- [start:bench_gemv]
def bench_gemv(copy_bw: float, device: torch.device, rows: tuple[int, ...] = GEMV_ROWS,
               shapes: dict[str, list[tuple[str, int, int]]] | None = None,
               check: bool = True, product: Callable[..., torch.Tensor] = ops.gemv,
               variants: dict[str, dict] | None = None, from_l2: bool = False) -> list[dict]:
    """Our skinny GEMM (`product`: `ops.gemv`, or `gemm_wgmma` for the gemm table)
    against `F.linear` (cuBLAS) at every shape and row count.

    Each call reads the weight `[N, K]` once, x `[rows, K]` and writes y
    `[rows, N]`: those bytes over the time, against the copy bandwidth. The
    weights rotate through enough copies to defeat the L2, as the decode
    table's K/V do; the calls are replayed from a CUDA graph. `variants`
    adds paths `ours_<name>` that pass extra keyword arguments (e.g. splits).
    `from_l2` adds `ours_l2` and `cublas_l2`: every call multiplies by the same weight,
    which then stays in the L2, so they time the product with its weight read
    from the L2 rather than from HBM.
    """
    result = []
    for model, layers in (shapes or GEMV_SHAPES).items():
        for layer, k, n in layers:
            weight_bytes = n * k * DTYPE.itemsize
            rotations = l2_rotations(weight_bytes)
            weights = [torch.randn(n, k, device=device, dtype=DTYPE) * k ** -0.5
                       for _ in range(rotations)]
            for m in rows:
                xs = [torch.randn(m, k, device=device, dtype=DTYPE) for _ in range(rotations)]
                outs = [torch.empty(m, n, device=device, dtype=DTYPE) for _ in range(rotations)]
                moved = weight_bytes + (m * k + m * n) * DTYPE.itemsize
                row = {"model": model, "layer": layer, "k": k, "n": n, "rows": m,
                       "bytes": moved, "rotations": rotations, "paths": {}}
                ref = (xs[0].double() @ weights[0].double().T) if check else None
                paths: dict[str, list[Callable[[], object]]] = {
                    "ours": [lambda x=x, w=w, o=o: product(x, w, out=o)
                             for x, w, o in zip(xs, weights, outs)],
                    "cublas": [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)],
                }
                if from_l2:  # the same weight every call: after the first, it is in the L2
                    paths["ours_l2"] = [lambda x=x, o=o, w=weights[0]: product(x, w, out=o)
                                        for x, o in zip(xs, outs)]
                    paths["cublas_l2"] = [lambda x=x, w=weights[0]: F.linear(x, w) for x in xs]
                for name, kw in (variants or {}).items():
                    paths[f"ours_{name}"] = [lambda x=x, w=w, o=o, kw=kw: product(x, w, out=o, **kw)
                                             for x, w, o in zip(xs, weights, outs)]
                for path, calls in paths.items():
                    try:
                        err = None
                        if ref is not None:
                            y = calls[0]()
                            y = outs[0] if path.startswith("ours") else y
                            err = ((y.double() - ref).norm() / ref.norm()).item()
                        sec = time_calls(calls, use_graph=True)
                    except Exception as e:  # noqa: BLE001 - record the failure, keep going
                        row["paths"][path] = {"error": f"{type(e).__name__}: {e}"[:300]}
                        continue
                    bw = moved / sec
                    row["paths"][path] = {"us": sec * 1e6, "gbps": bw / 1e9,
                                          "frac_copy": bw / copy_bw, "rel_err": err}
                result.append(row)
                print(f"  {model:10s} {layer:12s} {k:>5} x {n:>6}  rows={m}  "
                      + "  ".join(f"{p}={r['us']:8.1f}us {100 * r['frac_copy']:5.1f}%"
                                  if "us" in r else f"{p}=ERR"
                                  for p, r in row["paths"].items()),
                      flush=True)
            del weights
            torch.cuda.empty_cache()
    return result
# --8<-- [end:bench_gemv]


def bar_report(main: list[dict]) -> dict:
    """The phase's bar on the main table (16/8 heads, head_dim 128, bf16)."""
    res = {"bw_90pct_at_batch64_ctx1k": True, "ge_sdpa_contig_at_batch64_ctx1k": True,
           "beats_paged_torch_everywhere": True, "misses": []}
    # ours / SDPA-contiguous time at the bar's shapes: < 1 is faster.
    ratios = [r["paths"]["ours"]["us"] / r["paths"]["sdpa_contig"]["us"] for r in main
              if r["batch"] >= 64 and r["context"] >= 1024
              and "us" in r["paths"].get("ours", {}) and "us" in r["paths"].get("sdpa_contig", {})]
    if ratios:
        res["time_vs_sdpa_contig_at_batch64_ctx1k"] = {"min": min(ratios), "max": max(ratios)}
    for row in main:
        p = row["paths"]
        ours = p.get("ours", {})
        if "us" not in ours:
            res["misses"].append(f"ours failed at {row['batch']}x{row['context']}")
            continue
        big = row["batch"] >= 64 and row["context"] >= 1024
        if big and ours["frac_copy"] < 0.9:
            res["bw_90pct_at_batch64_ctx1k"] = False
            res["misses"].append(f"{row['batch']}x{row['context']}: "
                                 f"{100 * ours['frac_copy']:.1f}% of copy")
        sdpa = p.get("sdpa_contig", {})
        if big and "us" in sdpa and ours["us"] > sdpa["us"]:
            res["ge_sdpa_contig_at_batch64_ctx1k"] = False
            res["misses"].append(f"{row['batch']}x{row['context']}: slower than sdpa_contig "
                                 f"({ours['us']:.1f} vs {sdpa['us']:.1f} us)")
        for other in ("gather_sdpa",):
            o = p.get(other, {})
            if "us" in o and ours["us"] >= o["us"]:
                res["beats_paged_torch_everywhere"] = False
                res["misses"].append(f"{row['batch']}x{row['context']}: not faster than {other}")
    return res


def v7_bar_report(rows: list[dict]) -> dict:
    """Each version-7 variant (and version 5) against SDPA on contiguous K/V.

    At the bar's shapes (16/8 heads, batch >= 64, context >= 1k): min and max of
    ours / SDPA time (< 1 is faster) and whether it is never slower; at 32/8
    heads: the share of the copy bandwidth reached, batch >= 16.
    """
    res: dict = {}
    names = [p for p in rows[0]["paths"] if p.startswith("ours")] if rows else []
    for name in names:
        ratios, frac32 = [], []
        for r in rows:
            ours, sdpa = r["paths"].get(name, {}), r["paths"].get("sdpa_contig", {})
            if "us" not in ours:
                continue
            if (r["num_q_heads"] == 16 and r["batch"] >= 64 and r["context"] >= 1024
                    and "us" in sdpa):
                ratios.append(ours["us"] / sdpa["us"])
            if r["num_q_heads"] == 32 and r["batch"] >= 16:
                frac32.append(ours["frac_copy"])
        entry: dict = {}
        if ratios:
            entry["time_vs_sdpa_contig_at_batch64_ctx1k"] = {"min": min(ratios),
                                                             "max": max(ratios)}
            entry["ge_sdpa_contig_at_batch64_ctx1k"] = max(ratios) <= 1.0
        if frac32:
            entry["frac_copy_32_8_heads_batch16"] = {"min": min(frac32), "max": max(frac32)}
        res[name] = entry
    return res


# ----------------------------------------------------------------------------
# Mixed context lengths: what a decode step of the standard workload looks like
# ----------------------------------------------------------------------------
MIXED_BATCHES = (2, 4, 8, 16, 32, 64, 96, 128, 192, 256)


def mixed_lengths(batch: int, seed: int = 0) -> list[int]:
    """Context lengths of a server's decode batch: a prompt of the standard workload
    (randint(100, 1024) tokens) plus 0 to 1023 tokens generated so far, since its
    requests arrived at different times. (In the offline workload every request
    starts at once, so the contexts of a step differ by their prompts only.)"""
    rng = random.Random(seed)
    return [rng.randint(100, 1024) + rng.randint(0, 1023) for _ in range(batch)]


class MixedCase:
    """R rotations of one decode batch whose sequences have different lengths."""

    def __init__(self, lens: list[int], device: torch.device, num_q_heads: int = 16,
                 num_kv_heads: int = 8, block_size: int = 16) -> None:
        torch.manual_seed(0)
        self.lens, self.batch, self.block_size = lens, len(lens), block_size
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        kv_bytes = 2 * sum(lens) * num_kv_heads * HEAD_DIM * 2
        self.rotations = l2_rotations(kv_bytes)
        blocks = [math.ceil(n / block_size) for n in lens]
        num_blocks = self.rotations * sum(blocks) + 1
        shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=DTYPE, device=device)
        self.v_cache = torch.randn(shape, dtype=DTYPE, device=device)
        perm = (torch.randperm(num_blocks - 1) + 1).to(torch.int32).tolist()
        self.block_tables = []
        for _ in range(self.rotations):
            table = torch.zeros((self.batch, max(blocks)), dtype=torch.int32)
            for i, nb in enumerate(blocks):
                table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
                del perm[:nb]
            self.block_tables.append(table.to(device))
        self.context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.queries = [torch.randn((self.batch, num_q_heads, HEAD_DIM), dtype=DTYPE,
                                    device=device) for _ in range(self.rotations)]
        self.outs = [torch.empty_like(q) for q in self.queries]
        self.scale = HEAD_DIM ** -0.5

    @property
    def bytes_moved(self) -> int:
        """Q + K + V + output, K/V once per KV head."""
        q = self.batch * self.num_q_heads * HEAD_DIM * 2
        return 2 * q + 2 * sum(self.lens) * self.num_kv_heads * HEAD_DIM * 2

    def calls(self, order: torch.Tensor | None, sort_rows: bool = False,
              **kw: object) -> list[Callable[[], object]]:
        """Our kernel over every rotation, its grid taking the sequences in `order`;
        with `sort_rows`, the batch's rows themselves put in `order` first (so any
        grid, even one that fits at once, takes them in that order)."""
        calls = []
        for r in range(self.rotations):
            q, table, lens, seq_order = (self.queries[r], self.block_tables[r],
                                         self.context_lens, order)
            if sort_rows:
                q, table, lens, seq_order = q[order], table[order], lens[order], None
            calls.append(lambda q=q, o=self.outs[r], t=table, n=lens, s=seq_order:
                         ops.paged_decode_attention(q, self.k_cache, self.v_cache, t, n,
                                                    self.scale, max(self.lens), out=o,
                                                    seq_order=s, **kw))
        return calls

    def error(self, order: torch.Tensor | None, sort_rows: bool = False, **kw: object) -> float:
        """Relative error of rotation 0 against the torch reference."""
        self.calls(order, sort_rows, **kw)[0]()
        rows = order if sort_rows else slice(None)
        ref = paged_decode_attention_ref(self.queries[0][rows], self.k_cache, self.v_cache,
                                         self.block_tables[0][rows], self.context_lens[rows],
                                         self.scale).float()
        return ((self.outs[0].float() - ref).norm() / ref.norm()).item()


# name: (order, keyword arguments of MixedCase.calls): "drawn" or "longest" first
MIXED_PATHS = {
    "v7": ("drawn", {"version": 7}),
    "v7_longest_first": ("longest", {"version": 7}),
    "v7_rows_sorted": ("longest", {"version": 7, "sort_rows": True}),
    "v7_longest_first_p1024": ("longest", {"version": 7, "partition_size": 1024}),
    "v7_longest_first_p512": ("longest", {"version": 7, "partition_size": 512}),
    "v8": ("drawn", {"version": 8}),
    "v7_longest_first_w4s2": ("longest", {"version": 7, "unroll": 4, "stages": 2}),
    "v7_longest_first_w4s3": ("longest", {"version": 7, "unroll": 4, "stages": 3}),
}


def bench_mixed(copy_bw: float, device: torch.device) -> list[dict]:
    """Version 7 on batches of mixed lengths: its grid taking the sequences in the drawn
    order, and longest first (`seq_order`, as the engine runs it)."""
    rows = []
    for batch in MIXED_BATCHES:
        lens = mixed_lengths(batch)
        case = MixedCase(lens, device)
        longest_first = torch.from_numpy(ops.longest_first(lens)).to(device)
        row = {"batch": batch, "context_min": min(lens), "context_max": max(lens),
               "context_mean": sum(lens) / batch, "bytes": case.bytes_moved,
               "rotations": case.rotations, "paths": {}}
        for name, (which, kw) in MIXED_PATHS.items():
            order = longest_first if which == "longest" else None
            err = case.error(order, **kw)
            sec = time_calls(case.calls(order, **kw), use_graph=True)
            bw = case.bytes_moved / sec
            row["paths"][name] = {"us": sec * 1e6, "gbps": bw / 1e9, "frac_copy": bw / copy_bw,
                                  "rel_err": err}
        rows.append(row)
        print(f"  b={batch:>3} ctx {min(lens)}-{max(lens)}  " + "  ".join(
            f"{n}={r['us']:7.1f}us {100 * r['frac_copy']:5.1f}%"
            for n, r in row["paths"].items()), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def main_shapes() -> list[tuple[int, int, int, int, int]]:
    return [(b, c, 16, 16, 8) for b in (1, 8, 32, 64, 128, 256)
            for c in (128, 512, 1024, 2048, 4096, 8192)]


# (unroll, stages) of version 6 in the pipeline table; the first is the default.
PIPELINE_DEPTHS = ((2, 3), (2, 4), (2, 6), (1, 8), (4, 2), (4, 3), (4, 4))


def pipeline_shapes() -> list[tuple[int, int, int, int, int]]:
    """The shapes of the bar (batch >= 64, context >= 1k) and three smaller ones."""
    return ([(b, c, 16, 16, 8) for b in (64, 128, 256) for c in (1024, 2048, 4096, 8192)]
            + [(1, 8192, 16, 16, 8), (8, 4096, 16, 16, 8), (32, 1024, 16, 16, 8)])


# (warps, stages) of version 7 in the v7 table, beside `ours_v7` (what the
# wrapper picks: the first, or the fourth for a grid of many waves).
V7_DEPTHS = ((2, 3), (2, 2), (2, 4), (4, 2), (4, 3), (1, 4))
# Block sizes of the v7blocks table.
V7_BLOCK_SIZES = (16, 32, 64, 128)
# Block sizes of the v7layout table.
V7_LAYOUT_BLOCK_SIZES = (16, 64)
# Partition sizes of the v7parts table.
V7_PARTITIONS = (256, 512, 1024, 2048, 4096)


def v7_shapes() -> list[tuple[int, int, int, int, int]]:
    """The pipeline table's shapes (16/8 heads), then Qwen3-8B's 32/8 heads."""
    return pipeline_shapes() + [(b, c, 16, 32, 8) for b, c in
                                ((1, 8192), (16, 4096), (64, 1024), (64, 4096), (256, 1024))]


def v8_shapes() -> list[tuple[int, int, int, int, int]]:
    """The pipeline table's shapes, then 66 sequences: 528 CTAs of version 7, exactly
    one wave on an H200, where version 8's ranges are whole sequences."""
    return pipeline_shapes() + [(66, 1024, 16, 16, 8), (66, 4096, 16, 16, 8)]


# (warps, stages) of version 9 in the v9 table, beside `ours_v9` (as the wrapper picks it).
V9_DEPTHS = ((2, 2), (2, 4), (4, 3))


def bench_in_order_and_scattered(shapes: list[tuple[int, int, int, int, int]],
                                 paths: list[str], copy_bw: float, device: torch.device,
                                 **kw: object) -> list[dict]:
    """`bench_decode` with the blocks handed out in order, then scattered; each row
    says which (`scattered`)."""
    rows = []
    for scattered in (False, True):
        for r in bench_decode(shapes, paths, copy_bw, device, scattered=scattered, **kw):
            rows.append(r | {"scattered": scattered})
    return rows


def ring_variants(version: int, depths: tuple[tuple[int, int], ...]) -> dict[str, dict]:
    """`ours_v{version}` as the wrapper picks its ring, then at each (warps, stages)."""
    return {f"ours_v{version}": {"version": version}} | {
        f"ours_v{version}_w{w}s{st}": {"version": version, "unroll": w, "stages": st}
        for w, st in depths}


# The fused element-wise kernels of a Qwen3-0.6B layer, as the model calls them
# (norms folded: both take the residual row's 1 / rms), at decode batches and
# prefill chunks.
FUSED_TOKENS = (1, 16, 64, 128, 256, 1024, 8192)
FUSED_SHAPE = {"num_q_heads": 16, "num_kv_heads": 8, "head_dim": 128, "hidden": 1024,
               "intermediate": 3072}


# --8<-- [start:bench_fused]
def bench_fused(copy_bw: float, device: torch.device,
                tokens: tuple[int, ...] = FUSED_TOKENS) -> list[dict]:
    """q/k-norm + RoPE with the KV-cache write, and SiLU · mul, at Qwen3-0.6B's shapes.

    Bytes: q/k-norm + RoPE reads the token's q, k and v heads and its residual
    row and writes q, k and v back and k and v into the cache (the rotary
    table and the norm weights are not counted); SiLU · mul reads gate, up and
    the residual row and writes the product. Inputs rotate through enough
    copies to defeat the L2, as in the other tables (in a decode step they come
    straight from the product before, mostly from the L2). Paths: each kernel
    as the model calls it, and q/k-norm + RoPE at one, two and four heads a warp
    (`qk_norm_rope_h1`, `_h2`, `_h4`).
    """
    from mini_vllm.layers import RotaryEmbedding
    from mini_vllm.ops import layer_ops

    hq, hkv, d = FUSED_SHAPE["num_q_heads"], FUSED_SHAPE["num_kv_heads"], FUSED_SHAPE["head_dim"]
    hidden, inter = FUSED_SHAPE["hidden"], FUSED_SHAPE["intermediate"]
    e = DTYPE.itemsize
    rope = RotaryEmbedding(d, 4096, 1e6, device=device)
    qw = (1 + 0.1 * torch.randn(d, device=device)).to(DTYPE)
    kw = (1 + 0.1 * torch.randn(d, device=device)).to(DTYPE)
    result = []
    for t in tokens:
        qkv_bytes = t * (hq + 2 * hkv) * d * e
        per_call = {"qk_norm_rope": 2 * qkv_bytes + 2 * t * hkv * d * e + t * hidden * e,
                    "silu_and_mul": t * 3 * inter * e + t * hidden * e}
        rotations = l2_rotations(max(per_call.values()))
        blocks = -(-t // 16) + 1
        k_cache = torch.zeros(blocks, 16, hkv, d, device=device, dtype=DTYPE)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(t, device=device) + 16  # block 0 is padding
        positions = torch.randint(0, 4096, (t,), device=device)
        qkvs = [torch.randn(t, (hq + 2 * hkv) * d, device=device, dtype=DTYPE)
                for _ in range(rotations)]
        gate_ups = [torch.randn(t, 2 * inter, device=device, dtype=DTYPE)
                    for _ in range(rotations)]
        residuals = [torch.randn(t, hidden, device=device, dtype=DTYPE) for _ in range(rotations)]
        # path -> (kernel, calls): each kernel as the model calls it, then q/k-norm
        # + RoPE with each number of heads per warp forced ("qk_norm_rope_h4").
        calls = {
            f"qk_norm_rope{f'_h{h}' if h else ''}": ("qk_norm_rope", [
                lambda x=x, r=r, pos=positions, cache=(k_cache, v_cache), slots=slots, h=h:
                layer_ops.qk_norm_rope(x, qw, kw, rope.cos_sin_cache, pos, hq, hkv, d, 1e-6,
                                       kv_cache=cache, slot_mapping=slots, residual=r,
                                       heads_per_warp=h)
                for x, r in zip(qkvs, residuals)])
            for h in (0, 1, 2, 4)}
        calls["silu_and_mul"] = ("silu_and_mul", [lambda x=x, r=r: layer_ops.silu_and_mul(x, r)
                                                  for x, r in zip(gate_ups, residuals)])
        row = {"tokens": t, "rotations": rotations, "paths": {}}
        for name, (kernel, fns) in calls.items():
            sec = time_calls(fns, use_graph=True)
            bw = per_call[kernel] / sec
            row["paths"][name] = {"us": sec * 1e6, "bytes": per_call[kernel], "gbps": bw / 1e9,
                                  "frac_copy": bw / copy_bw}
        result.append(row)
        print(f"  tokens={t:5d}  " + "  ".join(
            f"{n}={r['us']:8.2f}us {100 * r['frac_copy']:5.1f}%" for n, r in row["paths"].items()),
            flush=True)
        del qkvs, gate_ups, residuals
        torch.cuda.empty_cache()
    return result
# --8<-- [end:bench_fused]


# Decode batches for the silu_epilogue table: the GEMV to 16 rows, gemm_wgmma above.
SILU_EPILOGUE_ROWS = (1, 4, 8, 16, 24, 32, 64, 96, 128, 192, 256)
# Rows of the silu_plans table: those where the model runs gemm_wgmma with SiLU · mul.
SILU_PLAN_ROWS = (24, 32, 48, 64, 96, 128)


# --8<-- [start:bench_silu_epilogue]
def bench_silu_epilogue(copy_bw: float, device: torch.device,
                        rows: tuple[int, ...] = SILU_EPILOGUE_ROWS,
                        variants: dict[str, dict] | None = None) -> list[dict]:
    """Qwen3-0.6B's gate_up_proj and SiLU · mul (norm folded) as one launch and as two.

    Paths: ``fused`` (our product with SiLU · mul in its epilogue,
    ``silu_eps``), ``separate`` (our product, then the ``silu_and_mul`` kernel:
    the model's path before the epilogue) and ``cublas_separate`` (cuBLAS, then
    ``silu_and_mul``: the model's path above 128 rows); with `variants`, also
    ``fused_<name>`` for each: ``gemm_wgmma`` with SiLU · mul at the plan its
    arguments force (the silu_plans table). Bytes: the weight, x and the
    [rows, intermediate] output once each. Weights rotate to defeat the L2 and
    the calls replay from a CUDA graph, as in the gemv table.
    """
    from mini_vllm.ops import layer_ops

    hidden, inter, eps = FUSED_SHAPE["hidden"], FUSED_SHAPE["intermediate"], 1e-6
    weight_bytes = 2 * inter * hidden * DTYPE.itemsize
    rotations = l2_rotations(weight_bytes)
    weights = [torch.randn(2 * inter, hidden, device=device, dtype=DTYPE) * hidden ** -0.5
               for _ in range(rotations)]
    result = []
    for m in rows:
        xs = [torch.randn(m, hidden, device=device, dtype=DTYPE) for _ in range(rotations)]
        outs = [torch.empty(m, inter, device=device, dtype=DTYPE) for _ in range(rotations)]
        moved = weight_bytes + (m * hidden + m * inter) * DTYPE.itemsize
        pairs = list(zip(xs, weights, outs))
        paths: dict[str, list[Callable[[], object]]] = {
            "fused": [lambda x=x, w=w, o=o: engine_product(x, w, out=o, silu_eps=eps)
                      for x, w, o in pairs],
            "separate": [lambda x=x, w=w: layer_ops.silu_and_mul(engine_product(x, w), x, eps)
                         for x, w, _ in pairs],
            "cublas_separate": [lambda x=x, w=w: layer_ops.silu_and_mul(F.linear(x, w), x, eps)
                                for x, w, _ in pairs],
        }
        for name, kw in (variants or {}).items():
            paths[f"fused_{name}"] = [
                lambda x=x, w=w, o=o, kw=kw: gemm_wgmma(x, w, out=o, silu_eps=eps, **kw)
                for x, w, o in pairs]
        row = {"layer": "gate_up_proj", "k": hidden, "n": 2 * inter, "rows": m, "bytes": moved,
               "rotations": rotations, "paths": {}}
        for name, calls in paths.items():
            sec = time_calls(calls, use_graph=True)
            row["paths"][name] = {"us": sec * 1e6, "gbps": moved / sec / 1e9,
                                  "frac_copy": moved / sec / copy_bw}
        result.append(row)
        print(f"  rows={m:4d}  " + "  ".join(f"{n}={r['us']:7.2f}us"
                                             for n, r in row["paths"].items()), flush=True)
    return result
# --8<-- [end:bench_silu_epilogue]


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    result: dict = {
        "device": props.name, "num_sms": props.multi_processor_count,
        "torch": torch.__version__, "python": platform.python_version(),
        "dtype": "bfloat16", "head_dim": HEAD_DIM,
    }
    copy_bw = copy_bandwidth(device)
    result["copy_bandwidth_gbps"] = copy_bw / 1e9
    print(f"{props.name}: device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write)")
    tables = args.tables

    def save() -> None:  # after every table, so a run cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    ours_kw = {"version": args.version}
    result["version"] = args.version
    if "pipeline" in tables:
        print("pipeline: version 6 depths (unroll/stages) vs version 5 and SDPA, contiguous")
        variants = {"ours_v5": {"version": 5}}
        variants |= {f"ours_v6_u{u}s{st}": {"version": 6, "unroll": u, "stages": st}
                     for u, st in PIPELINE_DEPTHS}
        result["pipeline"] = bench_decode(pipeline_shapes(), [*variants, "sdpa_contig"], copy_bw,
                                          device, check=False, variants=variants)
        save()
    if "v7" in tables:
        print("v7: version 7 (warps/stages) vs version 5 and SDPA, contiguous")
        variants = {"ours_v5": {"version": 5}, **ring_variants(7, V7_DEPTHS)}
        result["v7"] = bench_decode(v7_shapes(), [*variants, "sdpa_contig"], copy_bw, device,
                                    variants=variants)
        result["v7_bar"] = v7_bar_report(result["v7"])
        save()
    if "v7parts" in tables:
        print("v7parts: version 7's partition size (tokens per CTA) vs SDPA, contiguous")
        variants = {"ours_v7": {"version": 7}}
        variants |= {f"ours_v7_p{size}_w{w}s{st}": {"version": 7, "partition_size": size,
                                                     "unroll": w, "stages": st}
                     for size in V7_PARTITIONS for w, st in ((2, 3), (4, 2))}
        result["v7parts"] = bench_decode(pipeline_shapes()[:12], [*variants, "sdpa_contig"],
                                         copy_bw, device, check=False, variants=variants)
        result["v7parts_bar"] = v7_bar_report(result["v7parts"])
        save()
    if "v7blocks" in tables:
        print("v7blocks: version 7 at each block size vs SDPA, contiguous (the bar's shapes)")
        shapes = [(b, c, bs, 16, 8) for bs in V7_BLOCK_SIZES for b, c, *_ in
                  pipeline_shapes()[:12]]
        result["v7blocks"] = bench_decode(shapes, ["ours_v7", "sdpa_contig"], copy_bw, device,
                                          variants={"ours_v7": {"version": 7}})
        result["v7blocks_bar"] = {
            str(bs): v7_bar_report([r for r in result["v7blocks"] if r["block_size"] == bs])
            for bs in V7_BLOCK_SIZES}
        save()
    if "v7wave" in tables:
        print("v7wave: version 7 at one warp a CTA (8 CTAs an SM at 3 stages: 1,024 CTAs in "
              "one wave) vs the wrapper's ring and SDPA, contiguous (the bar's shapes)")
        variants = {"ours_v7": {"version": 7}} | {
            f"ours_v7_w1s{st}": {"version": 7, "unroll": 1, "stages": st} for st in (2, 3, 4)}
        result["v7wave"] = bench_decode(pipeline_shapes()[:12], [*variants, "sdpa_contig"],
                                        copy_bw, device, variants=variants)
        save()
    if "v7order" in tables:
        print("v7order: version 7 over blocks handed out in order and scattered, token-major "
              "and head-major, vs SDPA, contiguous (the bar's 128-sequence shapes, 64 and 256 "
              "x 4096)")
        variants = {"ours_v7": {"version": 7}, "ours_v7_head_major": {"version": 7,
                                                                      "head_major": True}}
        shapes = [(b, c, 16, 16, 8) for b, c in ((64, 4096), (128, 1024), (128, 2048),
                                                 (128, 4096), (128, 8192), (256, 4096))]
        result["v7order"] = bench_in_order_and_scattered(
            shapes, [*variants, "sdpa_contig"], copy_bw, device, variants=variants)
        save()
    if "v7layout" in tables:
        print("v7layout: version 7 over a token-major and a head-major cache vs SDPA, "
              "contiguous (the bar's shapes)")
        variants = {"ours_v7": {"version": 7}, "ours_v7_head_major": {"version": 7,
                                                                      "head_major": True}}
        shapes = [(b, c, bs, 16, 8) for bs in V7_LAYOUT_BLOCK_SIZES for b, c, *_ in
                  pipeline_shapes()[:12]]
        result["v7layout"] = bench_decode(shapes, [*variants, "sdpa_contig"], copy_bw, device,
                                          variants=variants)
        save()
    if "mixed" in tables:
        print("mixed: version 7 on batches of mixed context lengths, drawn order and "
              "longest first")
        result["mixed"] = bench_mixed(copy_bw, device)
        save()
    if "v8" in tables:
        print("v8: version 8 (stream-K over a persistent grid) vs version 7 and SDPA, contiguous")
        variants = {"ours_v7": {"version": 7}, "ours_v8": {"version": 8}}
        result["v8"] = bench_decode(v8_shapes(), [*variants, "sdpa_contig"], copy_bw, device,
                                    variants=variants)
        save()
    if "v9" in tables:
        print("v9: version 9 (v7's tiles copied by the TMA) vs version 7 and SDPA, contiguous")
        variants = {"ours_v7": {"version": 7}, **ring_variants(9, V9_DEPTHS)}
        result["v9"] = bench_decode(v7_shapes(), [*variants, "sdpa_contig"], copy_bw, device,
                                    variants=variants)
        save()
    # The other fast versions, timed beside `ours` in the same rows.
    others = {f"ours_v{v}": {"version": v} for v in (5, 6, 7) if v != args.version}
    if "layout" in tables:
        print("layout: one KV head, blocks in order (SDPA's byte order) vs scattered")
        result["layout"] = bench_in_order_and_scattered(
            [(512, 4096, 16, 2, 1), (2048, 1024, 16, 2, 1)], ["ours", *others, "sdpa_contig"],
            copy_bw, device, ours_kw=ours_kw, variants=others)
        save()
    torch_paths = ["ours", *others, "gather_sdpa", "sdpa_contig", "flex_contig"]
    if "main" in tables:
        print(f"main: 16 q / 8 kv heads, block 16 (ours: version {args.version})")
        result["main"] = bench_decode(main_shapes(), torch_paths, copy_bw, device,
                                      flex_budget_s=args.flex_budget, ours_kw=ours_kw,
                                      variants=others)
        result["bar"] = bar_report(result["main"])
        save()
    if "heads32" in tables:
        print("heads32: 32 q / 8 kv heads, block 16")
        shapes = [(b, c, 16, 32, 8) for b in (1, 16, 64, 256) for c in (128, 1024, 4096, 8192)]
        v7 = {} if args.version == 7 else {"ours_v7": {"version": 7}}
        result["heads32"] = bench_decode(
            shapes, ["ours", "ours_gt4", *v7, "gather_sdpa", "sdpa_contig"], copy_bw, device,
            ours_kw=ours_kw, variants={"ours_gt4": {**ours_kw, "group_per_cta": 4}, **v7})
        save()
    if "block_sizes" in tables:
        print("block_sizes: 16 q / 8 kv heads")
        shapes = [(b, c, bs, 16, 8) for b, c in ((1, 8192), (8, 512), (64, 2048), (256, 1024))
                  for bs in (16, 32, 64, 128, 256)]
        result["block_sizes"] = bench_decode(shapes, ["ours", "gather_sdpa"], copy_bw, device,
                                             ours_kw=ours_kw)
        save()
    if "versions" in tables:
        print("versions: 16 q / 8 kv heads, block 16")
        shapes = [(1, 1024, 16, 16, 8), (8, 8192, 16, 16, 8), (64, 1024, 16, 16, 8),
                  (64, 4096, 16, 16, 8), (256, 2048, 16, 16, 8)]
        result["versions"] = []
        has_tma = torch.cuda.get_device_capability(device)[0] >= 9
        for v in (v for v in ops.DECODE_VERSIONS if v != 9 or has_tma):  # v9 needs sm_90
            rows = bench_decode(shapes, ["ours"], copy_bw, device, ours_kw={"version": v})
            for r in rows:
                r["version"] = v
            result["versions"] += rows
        save()
    if "tuning" in tables:
        print("tuning: partition sizes, unroll depths, block order (16/8 heads, block 16)")
        shapes = [(1, 8192, 16, 16, 8), (8, 4096, 16, 16, 8), (64, 1024, 16, 16, 8),
                  (64, 4096, 16, 16, 8), (256, 1024, 16, 16, 8), (256, 8192, 16, 16, 8)]
        result["tuning"] = bench_decode([(512, 4096, 16, 2, 1), (2048, 1024, 16, 2, 1)],
                                        ["ours", "sdpa_contig"], copy_bw, device)
        variants = ([{"unroll": u, "partition_size": p} for u in (2, 4)
                     for p in (64, 128, 256, 512, 1024, 2048, 4096)]
                    + [{"unroll": u} for u in (2, 4)]
                    + [{"version": 4, "unroll": u} for u in (2, 4, 8)]
                    + [{"cluster": c} for c in (2, 8)]
                    + [{"scattered": False}])
        for kw in variants:
            print(f" {kw}")
            if "partition_size" in kw or kw.get("version") == 4:
                shapes_kw = shapes
            elif "cluster" in kw or "scattered" in kw:
                # one KV head: every head's rows are contiguous (a locality probe)
                shapes_kw = [*shapes, (512, 4096, 16, 2, 1), (2048, 1024, 16, 2, 1)]
            else:  # the GQA group of 4 steps differently: tune it too
                shapes_kw = [*shapes, (8, 4096, 16, 32, 8), (64, 4096, 16, 32, 8),
                             (256, 1024, 16, 32, 8)]
            ours_kw = {k: v for k, v in kw.items() if k != "scattered"}
            rows = bench_decode(shapes_kw, ["ours"], copy_bw, device, check=False, ours_kw=ours_kw,
                                scattered=kw.get("scattered", True))
            for r in rows:
                r.update(kw)
            result["tuning"] += rows
        save()
    if "prefill" in tables:
        print("prefill: 16 q / 8 kv heads, block 16")
        result["prefill"] = bench_prefill(device)
        save()
    if "gemv" in tables:
        print(f"gemv: y = x @ W.T at {GEMV_ROWS} rows, ours vs cuBLAS (F.linear), bf16")
        result["gemv"] = bench_gemv(copy_bw, device)
        save()
    if "fused" in tables:
        print("fused: q/k-norm + RoPE (with the KV write) and SiLU · mul, Qwen3-0.6B, bf16")
        result["fused"] = bench_fused(copy_bw, device)
        save()
    if "silu_epilogue" in tables:
        print("silu_epilogue: Qwen3-0.6B's gate_up_proj + SiLU · mul in one launch and in two, "
              "bf16")
        result["silu_epilogue"] = bench_silu_epilogue(copy_bw, device)
        save()
    if "silu_plans" in tables:
        print(f"silu_plans: gate_up_proj + SiLU · mul on gemm_wgmma at every plan (tile width "
              f"x splits), {SILU_PLAN_ROWS} rows, bf16")
        result["silu_plans"] = bench_silu_epilogue(
            copy_bw, device, rows=SILU_PLAN_ROWS, variants=plan_variants(rows_per_cta=(128,)))
        save()
    if "gemm" in tables:
        print(f"gemm: y = x @ W.T at {GEMM_ROWS} rows, gemm_wgmma vs cuBLAS (F.linear), bf16")
        result["gemm"] = bench_gemv(copy_bw, device, rows=GEMM_ROWS, shapes=GEMM_SHAPES,
                                    product=gemm_wgmma,
                                    variants={f"s{s}": {"splits": s} for s in (4, 8, 16)})
        save()
    if "gemm_l2" in tables:
        print(f"gemm_l2: Qwen3-0.6B's products at {GEMM_L2_ROWS} rows as the engine runs them "
              "and with cuBLAS, the weight read from HBM and from the L2, bf16")
        result["gemm_l2"] = bench_gemv(
            copy_bw, device, rows=GEMM_L2_ROWS, shapes={"Qwen3-0.6B": GEMM_SHAPES["Qwen3-0.6B"]},
            product=engine_product, from_l2=True)
        save()
    if "gemm_plans" in tables:
        print(f"gemm_plans: gemm_wgmma at every plan (tile width x rows per CTA x splits), "
              f"{GEMM_PLAN_ROWS} rows, bf16")
        result["gemm_plans"] = bench_gemv(
            copy_bw, device, rows=GEMM_PLAN_ROWS, shapes={"Qwen3-0.6B": GEMM_SHAPES["Qwen3-0.6B"]},
            product=gemm_wgmma, variants=plan_variants())
        save()
    return result


PATH_NAMES = {"ours": "ours", "ours_v5": "ours, v5", "ours_v6": "ours, v6", "ours_v7": "ours, v7",
              "ours_gt4": "ours, 4 heads/CTA",
              "gather_sdpa": "gather + SDPA", "sdpa_contig": "SDPA, contiguous",
              "flex_contig": "Flex, contiguous"}


def _cell(r: dict | None) -> str:
    if not r or "us" not in r:
        return "-"
    return f"{r['us']:.1f} µs · {100 * r['frac_copy']:.0f} %"


def print_by_block_size(rows: list[dict], title: str, cell: Callable[[dict], str]) -> None:
    """A table of (batch × context) rows by block-size columns; `cell` formats one
    shape's paths."""
    sizes = sorted({r["block_size"] for r in rows})
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    by = {(r["batch"], r["context"], r["block_size"]): r["paths"] for r in rows}
    print(title + "\n")
    print("| batch × context | " + " | ".join(f"block {bs}" for bs in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for b, c in shapes:
        print(f"| {b} × {c} | " + " | ".join(cell(by.get((b, c, bs), {})) for bs in sizes)
              + " |")
    print()


def print_versus(rows: list[dict], new: str, old: str, table: str) -> None:
    """A table's rows as markdown: `new` against `old` and SDPA on contiguous K/V."""
    a, b = new.removeprefix("ours_"), old.removeprefix("ours_")
    print(f"**{table}** (µs per call; last columns: {a} / {b}, {a} / SDPA)\n")
    print(f"| heads | batch × context | {b} | {a} | SDPA, contig. | {a} / {b} | {a} / SDPA |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        us = {n: v["us"] for n, v in r["paths"].items() if "us" in v}
        if not {new, old, "sdpa_contig"} <= us.keys():
            continue
        print(f"| {r['num_q_heads']}/{r['num_kv_heads']} | {r['batch']} × {r['context']} "
              f"| {us[old]:.1f} | {us[new]:.1f} | {us['sdpa_contig']:.1f} "
              f"| {us[new] / us[old]:.3f} | {us[new] / us['sdpa_contig']:.3f} |")
    print()


def print_paths_table(rows: list[dict], heading: str,
                      leads: dict[str, Callable[[dict], str]], cell: str) -> None:
    """A markdown table of `rows`: the `leads` columns, then one column per path, each
    cell `cell` formatted with the path's `us` and `pct` (its share of the copy)."""
    names = list(rows[0]["paths"])
    print(heading + "\n")
    print("| " + " | ".join([*leads, *names]) + " |")
    print("|" + "---|" * (len(leads) + len(names)))
    for r in rows:
        cells = [lead(r) for lead in leads.values()]
        cells += [cell.format(us=r["paths"][n]["us"], pct=100 * r["paths"][n]["frac_copy"])
                  for n in names]
        print("| " + " | ".join(cells) + " |")
    print()


def report_plans(rows: list[dict], heading: str, chosen: str, prefix: str) -> None:
    """A sweep of forced plans (paths `prefix` + plan name): per layer and row count,
    the plan the kernel chose (path `chosen`) against the sweep's fastest."""
    print(heading + "\n")
    print("| layer | rows | chosen | fastest plan | chosen − fastest |")
    print("|---|---|---|---|---|")
    for r in rows:
        plans = {n[len(prefix):]: v["us"] for n, v in r["paths"].items()
                 if n.startswith(prefix) and "us" in v}
        best = min(plans, key=plans.get)
        us = r["paths"][chosen]["us"]
        print(f"| {r['layer']} | {r['rows']} | {us:.2f} µs | {best}: {plans[best]:.2f} µs | "
              f"{us - plans[best]:+.2f} µs |")
    print()


def report(path: Path) -> None:
    """Print the results of a JSON file as the markdown tables of chapter 8."""
    d = json.loads(path.read_text())
    print(f"{d['device']}, PyTorch {d['torch']}, copy {d['copy_bandwidth_gbps'] / 1e3:.2f} TB/s "
          "(read + write); each cell: time per call · achieved bandwidth / copy bandwidth\n")
    version = d.get("version", 5)
    for table in ("main", "heads32", "block_sizes"):
        rows = d.get(table)
        if not rows:
            continue
        paths = [p for p in PATH_NAMES if any(p in r["paths"] for r in rows)]
        print(f"(ours: version {version})\n")
        first = "block size | " if table == "block_sizes" else ""
        print(f"**{table}**\n")
        print(f"| batch × context | {first}" + " | ".join(PATH_NAMES[p] for p in paths) + " |")
        print("|---|" + ("---|" if first else "") + "---|" * len(paths))
        for r in rows:
            bs = f"{r['block_size']} | " if first else ""
            print(f"| {r['batch']} × {r['context']} | {bs}"
                  + " | ".join(_cell(r["paths"].get(p)) for p in paths) + " |")
        print()
    if d.get("versions"):
        shapes = sorted({(r["batch"], r["context"]) for r in d["versions"]})
        print("**versions**\n")
        print("| version | " + " | ".join(f"{b} × {c}" for b, c in shapes) + " |")
        print("|---|" + "---|" * len(shapes))
        for v in sorted({r["version"] for r in d["versions"]}):
            by = {(r["batch"], r["context"]): r for r in d["versions"] if r["version"] == v}
            print(f"| v{v} | " + " | ".join(_cell(by[s]["paths"].get("ours")) for s in shapes)
                  + " |")
        print()
    if d.get("pipeline"):
        rows = d["pipeline"]
        names = list(rows[0]["paths"])
        print("**pipeline** (µs per call; version 6 as unroll/stages)\n")
        print("| batch × context | " + " | ".join(
            n.removeprefix("ours_").replace("v6_", "v6 ").replace("sdpa_contig", "SDPA, contig.")
            for n in names) + " |")
        print("|---|" + "---|" * len(names))
        for r in rows:
            best = min(v["us"] for v in r["paths"].values() if "us" in v)
            print(f"| {r['batch']} × {r['context']} | " + " | ".join(
                "-" if "us" not in r["paths"].get(n, {}) else
                (f"**{r['paths'][n]['us']:.1f}**" if r["paths"][n]["us"] == best
                 else f"{r['paths'][n]['us']:.1f}") for n in names) + " |")
        print()
    if d.get("v7"):
        rows = d["v7"]
        names = list(rows[0]["paths"])
        default = ("ours_v7" if "ours_v7" in names
                   else f"ours_v7_w{V7_DEPTHS[0][0]}s{V7_DEPTHS[0][1]}")
        print("**v7** (µs per call; version 7 as the wrapper picks it, then at fixed "
              "warps/stages; last column: v7 default / SDPA)\n")
        print("| heads | batch × context | " + " | ".join(
            n.removeprefix("ours_").replace("v7_w", "v7 w").replace("sdpa_contig", "SDPA, contig.")
            for n in names) + " | v7 / SDPA |")
        print("|---|---|" + "---|" * (len(names) + 1))
        for r in rows:
            us = {n: v["us"] for n, v in r["paths"].items() if "us" in v}
            best = min(us.values(), default=None)
            ratio = (f"{us[default] / us['sdpa_contig']:.3f}"
                     if default in us and "sdpa_contig" in us else "-")
            print(f"| {r['num_q_heads']}/{r['num_kv_heads']} | {r['batch']} × {r['context']} | "
                  + " | ".join("-" if n not in us else
                               (f"**{us[n]:.1f}**" if us[n] == best else f"{us[n]:.1f}")
                               for n in names) + f" | {ratio} |")
        print()
        if d.get("v7_bar"):
            print("**v7 bar**:", json.dumps(d["v7_bar"]), "\n")
    if d.get("v7blocks"):
        def v7_vs_sdpa(p: dict) -> str:
            v7, sdpa = p.get("ours_v7", {}).get("us"), p.get("sdpa_contig", {}).get("us")
            return f"{v7:.1f} / {sdpa:.1f} ({v7 / sdpa:.3f})" if v7 and sdpa else "-"

        print_by_block_size(d["v7blocks"], "**v7blocks** (16/8 heads, blocks in random order; "
                            "each cell: v7 / SDPA on contiguous K/V, µs per call, and their "
                            "ratio)", v7_vs_sdpa)
    if d.get("v7layout"):
        def layouts(p: dict) -> str:
            us = [p.get(n, {}).get("us") for n in ("ours_v7", "ours_v7_head_major",
                                                   "sdpa_contig")]
            return " / ".join("-" if u is None else f"{u:.1f}" for u in us)

        print_by_block_size(d["v7layout"], "**v7layout** (16/8 heads, blocks in random order; "
                            "each cell: v7 over the token-major cache / over the head-major "
                            "cache / SDPA on contiguous K/V, µs per call)", layouts)
    if d.get("v7order"):
        print_paths_table(
            d["v7order"], "**v7order** (16/8 heads, block 16; v7 over the token-major and "
            "the head-major cache, and SDPA on contiguous K/V; µs per call)",
            {"batch × context": lambda r: f"{r['batch']} × {r['context']}",
             "blocks": lambda r: "scattered" if r["scattered"] else "in order"}, "{us:.1f}")
    if d.get("v7wave"):
        print_paths_table(
            d["v7wave"], "**v7wave** (16/8 heads, block 16; v7 as the wrapper picks its "
            "ring, then one warp a CTA at 2 to 4 stages, and SDPA on contiguous K/V; µs "
            "per call)", {"batch × context": lambda r: f"{r['batch']} × {r['context']}"},
            "{us:.1f}")
    for new in ("v8", "v9"):
        if d.get(new):
            print_versus(d[new], f"ours_{new}", "ours_v7", new)
    if d.get("mixed"):
        print_paths_table(
            d["mixed"], "**mixed** (16/8 heads, block 16, contexts of a prompt of 100-1024 "
            "tokens plus 0-1023 generated; µs per call · achieved bandwidth / copy bandwidth)",
            {"batch": lambda r: str(r["batch"]),
             "contexts": lambda r: f"{r['context_min']}–{r['context_max']}"},
            "{us:.1f} · {pct:.0f} %")
    if d.get("layout"):
        names = list(d["layout"][0]["paths"])
        print("**layout** (2 query / 1 KV head; µs per call)\n")
        print("| batch × context | blocks | " + " | ".join(PATH_NAMES.get(n, n) for n in names)
              + " |")
        print("|---|---|" + "---|" * len(names))
        for r in d["layout"]:
            print(f"| {r['batch']} × {r['context']} | "
                  f"{'scattered' if r['scattered'] else 'in order'} | " + " | ".join(
                      f"{r['paths'][n]['us']:.1f}" if "us" in r["paths"].get(n, {}) else "-"
                      for n in names) + " |")
        print()
    if d.get("prefill"):
        names = list(d["prefill"][0]["paths"])
        print("**prefill** (µs per call)\n")
        print("| batch | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for r in d["prefill"]:
            print(f"| {r['case']} | " + " | ".join(
                f"{r['paths'][n]['us']:.0f}" if "us" in r["paths"][n] else "-" for n in names)
                  + " |")
        print()
    if d.get("gemv"):
        report_gemv(d["gemv"])
    if d.get("gemm_l2"):
        print_paths_table(
            d["gemm_l2"], "**gemm_l2** (Qwen3-0.6B, bf16; ours: the GEMV to 16 rows, then "
            "gemm_wgmma; `_l2`: the weight read from the L2; µs per call)",
            {"layer": lambda r: r["layer"], "rows": lambda r: str(r["rows"])}, "{us:.2f}")
    if d.get("silu_epilogue"):
        print_paths_table(
            d["silu_epilogue"], "**silu_epilogue** (Qwen3-0.6B's gate_up_proj + SiLU · mul, "
            "bf16; µs per call)", {"rows": lambda r: str(r["rows"])}, "{us:.2f}")
    if d.get("gemm_plans"):
        report_plans(d["gemm_plans"], "**gemm_plans** (gemm_wgmma, bf16: the plan it chose "
                     "against every plan, `r<rows>s<splits>t<outputs>`)", "ours", "ours_")
    if d.get("silu_plans"):
        report_plans(d["silu_plans"], "**silu_plans** (gate_up_proj + SiLU · mul on "
                     "gemm_wgmma, bf16: the plan it chose against every plan)", "fused",
                     "fused_")
    if d.get("fused"):
        print_paths_table(
            d["fused"], "**fused** (Qwen3-0.6B, bf16; time per call · bytes over time as a "
            "share of the copy bandwidth)", {"tokens": lambda r: f"{r['tokens']:,}"},
            "{us:.2f} µs · {pct:.0f} %")
    tuning = [r for r in d.get("tuning", []) if "partition_size" in r and r.get("unroll") == 4]
    if tuning:
        sizes = sorted({r["partition_size"] for r in tuning})
        shapes = sorted({(r["batch"], r["context"]) for r in tuning})
        print("**partition size** (version 5, µs per call)\n")
        print("| batch × context | " + " | ".join(str(s) for s in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for b, c in shapes:
            by = {r["partition_size"]: r["paths"]["ours"] for r in tuning
                  if (r["batch"], r["context"]) == (b, c)}
            best = min(v["us"] for v in by.values())
            print(f"| {b} × {c} | " + " | ".join(
                (f"**{by[s]['us']:.1f}**" if by[s]["us"] == best else f"{by[s]['us']:.1f}")
                for s in sizes) + " |")
        print()
    if d.get("bar"):
        print("**bar**:", json.dumps(d["bar"]))


def report_gemv(rows: list[dict]) -> None:
    """The gemv table, and what the linear layers of one decode step cost at each row count."""
    counts = sorted({r["rows"] for r in rows})
    print("**gemv** (bf16; each cell: ours / cuBLAS, time per call · achieved bandwidth "
          "as a share of the copy bandwidth)\n")
    print("| model | layer | K × N | " + " | ".join(f"{m} row{'s' * (m > 1)}" for m in counts)
          + " |")
    print("|---|---|---|" + "---|" * len(counts))
    by = {(r["model"], r["layer"], r["rows"]): r for r in rows}
    layers = list(dict.fromkeys((r["model"], r["layer"], r["k"], r["n"]) for r in rows))
    for model, layer, k, n in layers:
        cells = []
        for m in counts:
            p = by.get((model, layer, m), {}).get("paths", {})
            ours, cublas = p.get("ours", {}), p.get("cublas", {})
            if "us" in ours and "us" in cublas:
                cells.append(f"{ours['us']:.1f} / {cublas['us']:.1f} µs · "
                             f"{100 * ours['frac_copy']:.0f} / {100 * cublas['frac_copy']:.0f} %")
            else:
                cells.append(f"{_cell(ours)} / {_cell(cublas)}")
        print(f"| {model} | {layer} | {k} × {n} | " + " | ".join(cells) + " |")
    print()
    # A decode step runs each layer's four products once per layer and the lm_head once.
    num_layers = {"Qwen3-0.6B": 28, "Qwen3-8B": 36}
    for model in dict.fromkeys(r["model"] for r in rows):
        for m in counts:
            step = {}
            for path in ("ours", "cublas"):
                total = 0.0
                for r in rows:
                    if r["model"] != model or r["rows"] != m:
                        continue
                    us = r["paths"].get(path, {}).get("us")
                    if us is None:
                        total = float("nan")
                        break
                    total += us * (1 if r["layer"] == "lm_head" else num_layers[model])
                step[path] = total
            print(f"{model}, {m} row{'s' * (m > 1)}: the linear layers of a decode step take "
                  f"{step['ours'] / 1e3:.3f} ms with ours, {step['cublas'] / 1e3:.3f} ms with "
                  "cuBLAS")
    print()


def dry_run() -> None:
    """Every decode path once at tiny shapes against the reference (CPU or GPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = ["gather_sdpa", "sdpa_contig"] + (["ours", "ours_v7"] if ops.is_available() else [])
    for shape in [(2, 40, 16, 16, 8), (3, 100, 32, 32, 8)]:
        case = DecodeCase(*shape, device=device, contiguous=True, gather_index=True)
        for path in paths:
            err = check_path(case, path, **({"version": 7} if path == "ours_v7" else {}))
            print(f"  {shape} {path}: rel err {err:.2e}")
            if err > 1e-2:
                raise SystemExit(f"{path} disagrees with the reference")
    if ops.is_available():
        for k, n in ((64, 100), (1024, 1000)):
            for m in (1, 8, 13):
                x = torch.randn(m, k, device=device, dtype=DTYPE)
                w = torch.randn(n, k, device=device, dtype=DTYPE)
                ref = x.double() @ w.double().T
                err = ((ops.gemv(x, w).double() - ref).norm() / ref.norm()).item()
                print(f"  gemv {m} x {k} x {n}: rel err {err:.2e}")
                if err > 1e-2:
                    raise SystemExit("gemv disagrees with the reference")
    print("dry run ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", nargs="+",
                        default=["main", "heads32", "block_sizes", "versions", "prefill",
                                 "gemv"],
                        help="which tables to run")
    parser.add_argument("--version", type=int, default=ops.DEFAULT_DECODE_VERSION,
                        choices=ops.DECODE_VERSIONS,
                        help="the kernel version timed as `ours` (default: the engine's)")
    parser.add_argument("--out", type=Path, default=RUNS_DIR / "kernels.json",
                        help="where to write the JSON results (default: benchmarks/runs/, "
                             "which git ignores)")
    parser.add_argument("--flex-budget", type=float, default=90.0,
                        help="seconds of FlexAttention compiling and timing before it is skipped")
    parser.add_argument("--profile", metavar="BATCH,CONTEXT,BLOCK",
                        help="only run our kernel 5 times at one shape (for ncu)")
    parser.add_argument("--profile-path", default="ours", choices=["ours", "sdpa_contig"],
                        help="what --profile runs: our kernel or SDPA on contiguous K/V")
    parser.add_argument("--profile-heads", default="16,8", metavar="Q,KV",
                        help="query and KV heads of --profile (16,8: Qwen3-0.6B; 32,8: 8B)")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="print the tables of a results file as markdown and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every path once at tiny shapes and check it (no timing)")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if args.dry_run:
        dry_run()
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if not ops.is_available():
        raise SystemExit(f"mini_vllm.ops: {ops.unavailable_reason()}")
    if args.profile:
        batch, ctx, block_size = (int(x) for x in args.profile.split(","))
        num_q_heads, num_kv_heads = (int(x) for x in args.profile_heads.split(","))
        case = DecodeCase(batch, ctx, block_size, num_q_heads, num_kv_heads, torch.device("cuda"),
                          contiguous=args.profile_path == "sdpa_contig", gather_index=False)
        kw = {"version": args.version} if args.profile_path == "ours" else {}
        call = path_calls(case, args.profile_path, **kw)[0]
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        return
    result = run(args)
    print(f"wrote {args.out}")
    if "bar" in result:
        print("bar:", json.dumps(result["bar"], indent=1))
    if "v7_bar" in result:
        print("v7 bar:", json.dumps(result["v7_bar"], indent=1))


if __name__ == "__main__":
    main()
