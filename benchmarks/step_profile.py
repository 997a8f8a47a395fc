"""Where one decode step's time goes, against the step's floor.

Two views of a decode step of `--batch` sequences with `--context` tokens each:

1. The model runner alone (random Qwen3-0.6B weights, a KV cache of random
   values): the CUDA-graph replay on the GPU, the eager forward, the host
   work of building the batch, the sampler, and the GPU kernels by category
   (torch.profiler over eager forwards, whose kernels are the graph's).
   The floor is the bytes a step must move (every context token's K and V
   once, the new tokens' K/V written once, the weights once) over a copy
   bandwidth measured in the same run.
2. The whole engine (`LLMEngine.step`) on the same batch shape: the step's
   wall time as configured (async scheduling overlaps host and GPU), then,
   with a sync after the sampler, split into schedule, building entries, the
   runner's host work, sampling metadata, the sampler, waiting for the GPU,
   and the host work after it (token bookkeeping, detokenisation, outputs).

    python benchmarks/step_profile.py                          # batch 256, context 1024
    python benchmarks/step_profile.py --batch 1 --no-engine    # latency view

With `--postprocess`, only that host work after the sampler (`LLMEngine._process`),
for final-only requests (what `LLM.generate` sends) detokenized token by token and
at the end, side by side (`profile_postprocess`); it needs no GPU:

    python benchmarks/step_profile.py --postprocess --preset tiny --context 16 --steps 100

With `--host-layout`, only the runner's host arithmetic of a decode step
(`GPUModelRunner._host_layout`), its block tables as the KV manager hands them out
(int32 arrays) and as Python lists, side by side (`profile_host_layout`); on the CPU:

    python benchmarks/step_profile.py --host-layout --preset tiny --batch 256 --context 1024

The KV cache has `--block-size` tokens per block (default: the engine's, 16).

Results: a table on stdout and JSON in `--output` (default: in `benchmarks/runs/`,
which git ignores).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import (
    RUNS_DIR,
    environment,
    format_table,
    measure_copy_bandwidth,
    prepare_model_dir,
    time_calls,
    write_json,
)
from mini_vllm import ops
from mini_vllm.config import EngineArgs
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.gpu.model_runner import GPUModelRunner
from mini_vllm.gpu.sampler import FusedSampler
from mini_vllm.kv_cache import KVCacheManager
from mini_vllm.layers import linear as linear_layers
from mini_vllm.model_runner import BatchEntry
from mini_vllm.ops._extension import extension
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from mini_vllm.sequence import Request

_KERNEL_CATEGORIES = (  # first match wins, on the lower-cased kernel name
    ("decode attention", ("paged_attention", "decode", "combine_splits")),
    ("prefill attention", ("flash_fwd", "flash_prefill", "gather_kv_cache")),  # before "cutlass" below
    ("KV write", ("reshape_and_cache", "cache_kernel")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("copies (e.g. logits to float32)", ("copy",)),
    ("norms / rope / activations", ("rms_norm", "qk_norm_rope", "silu", "elementwise",
                                    "reduce", "vectorized", "cat", "index", "pow", "mean",
                                    "rsqrt")),
    ("sampling", ("sample_", "gumbel", "softmax", "exponential", "argmax")),
)


def _ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def categorise(name: str) -> str:
    """The category of a kernel, from its name."""
    low = name.lower()
    for category, keys in _KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def profile_kernels(fn: Any) -> dict[str, float]:
    """GPU seconds of each kernel (by name) while `fn()` runs, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            seconds = event.time_range.elapsed_us() / 1e6
            kernels[event.name] = kernels.get(event.name, 0.0) + seconds
    return kernels


def by_category(kernels: dict[str, float]) -> dict[str, float]:
    """`profile_kernels`' times summed by `categorise`."""
    categories: dict[str, float] = {}
    for name, seconds in kernels.items():
        cat = categorise(name)
        categories[cat] = categories.get(cat, 0.0) + seconds
    return categories


def kernel_breakdown(fn: Any, steps: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """GPU time per step by category and the top kernels (ms), from torch.profiler."""
    def run() -> None:
        for _ in range(steps):
            fn()

    kernels = profile_kernels(run)
    categories = {cat: 1e3 * s / steps for cat, s in by_category(kernels).items()}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return categories, [{"kernel": n[:90], "ms_per_step": 1e3 * s / steps} for n, s in top]


def profile_runner(model_dir: Path, load_format: str, ns: argparse.Namespace,
                   bandwidth: float) -> dict[str, Any]:
    """The runner-level view (see the module docstring)."""
    steps, batch, context, bs = ns.steps, ns.batch, ns.context, ns.block_size
    blocks_per_seq = -(-(context + steps + 1) // bs)
    runner = GPUModelRunner(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format=load_format,
        block_size=bs, max_num_seqs=batch, max_model_len=ns.max_model_len,
        num_gpu_blocks_override=batch * blocks_per_seq + 1,
    ).create_engine_config())
    runner.kv_cache.normal_()  # never time on zeros
    rng = random.Random(0)
    ids = list(range(1, runner.num_blocks))
    rng.shuffle(ids)
    tables = [ids[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]

    def entries(step: int) -> list[BatchEntry]:
        return [BatchEntry([rng.randrange(10000)], context - 1 + step % steps, t) for t in tables]

    params = SamplingParams(temperature=0.6, top_p=1.0, top_k=0, ignore_eos=True)
    rows = [(params, None, [], [])] * batch
    sampler = FusedSampler()
    result: dict[str, Any] = {"batch": batch, "context": context, "block_size": bs,
                              "attention": runner.attn_backend.describe()}
    for _ in range(3):  # warm-up
        sampler(runner.execute(entries(0), float_logits=False), sampler.build_metadata(
            rows, runner.device, runner.vocab_size)).sampled_token_ids.tolist()

    # The whole step, phase by phase, host clock (the GPU wait is the .tolist()).
    phases: dict[str, list[float]] = {k: [] for k in
                                      ("execute_host", "sampling_metadata", "sampler_host",
                                       "wait_gpu", "step_wall")}
    for step in range(steps):
        batch_entries = entries(step)
        t0 = time.perf_counter()
        logits = runner.execute(batch_entries, float_logits=False)  # as the engine asks
        t1 = time.perf_counter()
        meta = sampler.build_metadata(rows, runner.device, runner.vocab_size)
        t2 = time.perf_counter()
        out = sampler(logits, meta)
        t3 = time.perf_counter()
        out.sampled_token_ids.tolist()
        t4 = time.perf_counter()
        for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            phases[key].append(value)
    result.update({f"{k}_ms": _ms(v) for k, v in phases.items()})

    # GPU time of the graph replay alone, and of the eager forward.
    graph_bs = runner.graph_runner.padded_size(batch) if runner.graph_runner else None
    if graph_bs is not None:
        bounds = runner.graph_runner.bounds[graph_bs]  # the graph the steps above replayed
        bound = bounds[bisect.bisect_left(bounds, context + steps)]
        def replay_ms() -> float:
            return _event_ms(lambda: runner.graph_runner.graphs[graph_bs, bound].replay(), steps)

        def recaptured_replay_ms(setting: contextlib.AbstractContextManager) -> float:
            """The same graph captured under `setting`; the graphs as they were after."""
            try:
                with setting:
                    runner.graph_runner.capture()
                    return replay_ms()
            finally:
                runner.graph_runner.capture()

        result["graph_replay_gpu_ms"] = replay_ms()
        if ops.is_available() and ops.programmatic_launch():
            # The same graph captured with every kernel launched plainly.
            result["graph_replay_gpu_ms_without_pdl"] = recaptured_replay_ms(
                without_programmatic_launch())
        if ops.is_available() and extension().wgmma_gemm_supported():
            # The same graph with every product of 17 to 256 rows cuBLAS's:
            # what gemm_wgmma buys at this batch (nothing above 64 rows).
            result["graph_replay_gpu_ms_without_wgmma_gemm"] = recaptured_replay_ms(
                without_wgmma_gemm())
    result["eager_forward_ms"] = _event_ms(
        lambda: runner.execute_fast(entries(0), use_graph=False), steps)
    logits = runner.execute(entries(0), float_logits=False)
    meta = sampler.build_metadata(rows, runner.device, runner.vocab_size)
    result["sampler_gpu_ms"] = _event_ms(lambda: sampler(logits, meta), steps, queued=True)
    # Its floor: one read of the logits. Its peer: the torch pipeline on the
    # same rows (what runs when the kernels are not built), float32 logits.
    result["sampler_floor_ms"] = 1e3 * logits.numel() * logits.element_size() / bandwidth
    float_logits = logits.float()
    torch_meta = dataclasses.replace(meta, noise_seeds=None)  # no seeds: the torch pipeline
    result["sampler_torch_gpu_ms"] = _event_ms(
        lambda: sampler(float_logits, torch_meta), steps, queued=True)
    try:
        categories, top = kernel_breakdown(
            lambda: runner.execute_fast(entries(0), use_graph=False), 5)
    except Exception as e:  # noqa: BLE001 - the profiler is a nicety: keep the timings
        categories, top = {}, [{"kernel": f"profiler failed: {e!r}"[:90]}]
    result["gpu_ms_by_category"] = categories
    result["top_kernels"] = top

    # The floor of a decode step.
    cfg = runner.model_config
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_read = batch * context * kv_per_token
    floor_bytes = kv_read + batch * kv_per_token + weight_bytes
    result.update({"kv_read_bytes": kv_read, "weight_bytes": weight_bytes,
                   "floor_ms": 1e3 * floor_bytes / bandwidth,
                   "kv_floor_ms": 1e3 * kv_read / bandwidth})
    if "graph_replay_gpu_ms" in result:
        result["graph_fraction_of_floor"] = result["floor_ms"] / result["graph_replay_gpu_ms"]
    attn = categories.get("decode attention")
    if attn:
        result["decode_attention_fraction_of_kv_floor"] = result["kv_floor_ms"] / attn
    return result


def _event_ms(fn: Any, iters: int, queued: bool = False) -> float:
    """Median GPU milliseconds of one call of `fn` (CUDA events, one warm-up call).

    `queued`: behind a busy GPU, as the engine launches the sampler (behind the
    step's graph), so that the Python launching it is not counted.
    """
    return 1e3 * statistics.median(
        time_calls(fn, torch.device("cuda"), iters, warmup=1, queued=queued))


def rms_norm_variants(batch: int, hidden: int, heads: int, head_dim: int) -> dict[str, float]:
    """GPU microseconds of one RMSNorm call, as the model writes it and fused by torch.

    Each variant runs 100 times inside a CUDA graph, so launch gaps do not
    count: this is the kernels' own time, what a decode graph pays per norm
    (a step of Qwen3-0.6B has 4 x 28 + 1 of them).
    """
    from mini_vllm.layers import RMSNorm

    results = {}
    for name, shape, dim in (("hidden", (batch, hidden), hidden),
                             ("per_head", (batch, heads, head_dim), head_dim)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        norm = RMSNorm(dim, 1e-6, device="cuda", dtype=torch.bfloat16)
        w = norm.weight
        variants = {
            "model": lambda x=x, norm=norm: norm(x),
            "fused_fp32_then_weight": lambda x=x, w=w, dim=dim: w * F.rms_norm(
                x.float(), (dim,), eps=1e-6).to(x.dtype),
            "fused_bf16_with_weight": lambda x=x, w=w, dim=dim: F.rms_norm(
                x, (dim,), w, eps=1e-6),
        }
        for vname, fn in variants.items():
            with torch.inference_mode():
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(100):
                        fn()
                results[f"{name}_{vname}_us"] = 1e3 * _event_ms(graph.replay, 10) / 100
    return results


def profile_engine(model_dir: Path, load_format: str, ns: argparse.Namespace) -> dict[str, Any]:
    """The engine-level view: `LLMEngine.step()` split by timestamps around its parts."""
    engine = LLMEngine(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format=load_format,
        max_num_seqs=ns.batch, max_model_len=ns.max_model_len,
    ).create_engine_config())
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, top_p=1.0, top_k=0, ignore_eos=True,
                            max_tokens=ns.steps * 4 + 16)
    for i in range(ns.batch):
        engine.add_request(str(i), [rng.randrange(10000) for _ in range(ns.context)], params)
    while engine.scheduler.get_stats().num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill everything
    for _ in range(3):
        engine.step()
    # As it runs (with async scheduling the host plans step N+1 while the GPU runs N).
    walls = []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)

    # Then split: a sync after the sampler separates host work from GPU time
    # (and so turns the overlap off while it measures).
    marks: dict[str, float] = {}

    def timed(name: str, fn: Any, sync: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            marks[f"{name}_start"] = time.perf_counter()
            out = fn(*args, **kwargs)
            marks[f"{name}_end"] = time.perf_counter()
            if sync:
                torch.cuda.synchronize()
                marks[f"{name}_synced"] = time.perf_counter()
            return out
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.model_runner.execute = timed("execute", engine.model_runner.execute)
    engine.sampler = timed("sampler", engine.sampler, sync=True)
    parts: dict[str, list[float]] = {k: [] for k in (
        "schedule", "build_entries", "execute_host", "sampling_metadata", "sampler_host",
        "wait_gpu", "postprocess", "step_wall")}
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        m = marks
        for key, value in (
            ("schedule", m["schedule_end"] - m["schedule_start"]),
            ("build_entries", m["execute_start"] - m["schedule_end"]),
            ("execute_host", m["execute_end"] - m["execute_start"]),
            ("sampling_metadata", m["sampler_start"] - m["execute_end"]),
            ("sampler_host", m["sampler_end"] - m["sampler_start"]),
            ("wait_gpu", m["sampler_synced"] - m["sampler_end"]),
            ("postprocess", t1 - m["sampler_synced"]),
            ("step_wall", t1 - t0),
        ):
            parts[key].append(value)
    running, engine_async = len(engine.scheduler.running), engine.config.async_scheduling
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"batch": running, "context": ns.context, "async": engine_async,
            "step_wall_as_configured_ms": _ms(walls),
            **{f"{k}_ms": _ms(v) for k, v in parts.items()}}


class _PerTokenEngine(LLMEngine):
    """The engine with every completion detokenized token by token, as a stream is."""

    def _detokenizes_at_end(self, params: SamplingParams) -> bool:
        return False


def profile_postprocess(model_dir: Path, load_format: str, ns: argparse.Namespace,
                        device: str) -> dict[str, Any]:
    """The engine's host work after the sampler (`LLMEngine._process`), with and without
    deferred detokenization, measured side by side.

    Two engines run the same `--batch` final-only requests (what `LLM.generate`
    sends: seeded sampling, EOS ignored, `--steps` output tokens each), one step
    of each in turn: the engine as it is, which decodes such a completion's text
    once, when it finishes, and one that detokenizes every token as a stream
    does. Every `_process` call is timed (after a device sync, so that none of
    it is waiting for the device), the last ones, where every request finishes
    and has its text decoded, included. Both engines must return the same texts.
    """
    engines = {}
    blocks_per_seq = -(-(ns.context + ns.steps + 1) // ns.block_size)
    for name, cls in (("per_token", _PerTokenEngine), ("at_end", LLMEngine)):
        engine = cls(EngineArgs(
            model=str(model_dir), device=device, load_format=load_format,
            block_size=ns.block_size, max_num_seqs=ns.batch, max_model_len=ns.max_model_len,
            async_scheduling=False,
            num_gpu_blocks_override=ns.batch * blocks_per_seq + 1,  # room for both engines
        ).create_engine_config())
        rng = random.Random(0)
        vocab = engine.vocab_size
        for i in range(ns.batch):
            params = SamplingParams(temperature=0.6, top_p=1.0, top_k=0, seed=i,
                                    ignore_eos=True, max_tokens=ns.steps,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            engine.add_request(str(i), [rng.randrange(vocab) for _ in range(ns.context)],
                               params)
        engines[name] = engine

    timings: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    texts: dict[str, dict[str, str]] = {name: {} for name in engines}

    def timed(name: str, process: Any) -> Any:
        def wrapper(step: Any) -> Any:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = process(step)
            timings[name].append((time.perf_counter() - t0, len(step.rows)))
            return out
        return wrapper

    for name, engine in engines.items():
        engine._process = timed(name, engine._process)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            for out in engine.step():
                if out.finished:
                    texts[name][out.request_id] = out.outputs[0].text
    if texts["per_token"] != texts["at_end"]:
        raise RuntimeError("the two engines returned different texts")

    result: dict[str, Any] = {"batch": ns.batch, "output_tokens": ns.steps}
    for name, rows in timings.items():
        seconds = sum(t for t, _ in rows)
        num_rows = sum(n for _, n in rows)
        full = [t for t, n in rows if n == ns.batch]
        # All its time spread over its rows, then counted for a step of `batch` rows.
        result[f"{name}_ms_per_step"] = 1e3 * seconds / num_rows * ns.batch
        result[f"{name}_median_ms"] = _ms(full)
        result[f"{name}_last_step_ms"] = 1e3 * rows[-1][0]
    result["speedup"] = result["per_token_ms_per_step"] / result["at_end_ms_per_step"]
    return result


def profile_host_layout(model_dir: Path, load_format: str, ns: argparse.Namespace,
                        ) -> dict[str, Any]:
    """The runner's host layout of a decode step, block tables as arrays and as lists.

    `--batch` sequences of `--context` tokens get their blocks from a
    `KVCacheManager`, and `GPUModelRunner._host_layout` builds the step's ids,
    positions, slots and block tables from them `--steps` times each way: with
    the int32 arrays `allocate_slots` returns, which it joins whole, and with
    the same tables as Python lists, which it reads an int at a time. Both
    layouts must be equal. Host arithmetic only: it runs on the CPU.
    """
    blocks_per_seq = -(-(ns.context + 1) // ns.block_size)
    runner = GPUModelRunner(EngineArgs(
        model=str(model_dir), device="cpu", load_format=load_format, block_size=ns.block_size,
        max_num_seqs=ns.batch, max_model_len=ns.max_model_len,
        num_gpu_blocks_override=ns.batch * blocks_per_seq + 1,
    ).create_engine_config())
    kv = KVCacheManager(runner.num_blocks, ns.block_size, enable_caching=False,
                        max_model_len=ns.max_model_len)
    params = SamplingParams(max_tokens=1)
    arrays = [kv.allocate_slots(Request(str(i), [1] * ns.context, params, arrival_time=0.0),
                                ns.context) for i in range(ns.batch)]
    query_lens = torch.ones(ns.batch, dtype=torch.int64).numpy()
    starts = query_lens * (ns.context - 1)
    result: dict[str, Any] = {"batch": ns.batch, "context": ns.context,
                              "block_size": ns.block_size}
    layouts = {}
    for name, tables in (("arrays", arrays), ("lists", [t.tolist() for t in arrays])):
        entries = [BatchEntry([7], ns.context - 1, t) for t in tables]
        times = []
        for _ in range(ns.steps + 3):
            t0 = time.perf_counter()
            layouts[name] = runner._host_layout(entries, query_lens, starts, ns.batch)
            times.append(time.perf_counter() - t0)
        result[f"{name}_ms"] = _ms(times[3:])
    for key, value in layouts["lists"].items():
        if not (layouts["arrays"][key] == value).all():
            raise RuntimeError(f"the two layouts differ in {key}")
    result["speedup"] = result["lists_ms"] / result["arrays_ms"]
    return result


@contextlib.contextmanager
def without_programmatic_launch() -> Iterator[None]:
    """Launch every kernel plainly inside the block (on again after it)."""
    ops.set_programmatic_launch(False)
    try:
        yield
    finally:
        ops.set_programmatic_launch(True)


@contextlib.contextmanager
def without_wgmma_gemm() -> Iterator[None]:
    """Let the model send no product to `gemm_wgmma` (cuBLAS takes them) inside the block."""
    saved = linear_layers.gemm_wgmma_pays
    linear_layers.gemm_wgmma_pays = lambda x, weight: False
    try:
        yield
    finally:
        linear_layers.gemm_wgmma_pays = saved


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: --preset)")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size,
                   help="tokens per KV-cache block (default: the engine's)")
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                   help="also profile LLMEngine.step()")
    p.add_argument("--postprocess", action="store_true",
                   help="only time the engine's host work after the sampler, final-only "
                        "completions detokenized at the end and per token (on the CPU "
                        "when there is no GPU)")
    p.add_argument("--host-layout", action="store_true",
                   help="only time the runner's host layout of a decode step, block tables as "
                        "int32 arrays and as lists (on the CPU)")
    p.add_argument("--output", default=None,
                   help="the JSON file (default: benchmarks/runs/step_profile.json, "
                        "step_profile_postprocess.json with --postprocess, "
                        "step_profile_host_layout.json with --host-layout; git ignores "
                        "benchmarks/runs/)")
    ns = p.parse_args(argv)
    if ns.postprocess:
        main_postprocess(ns)
        return
    if ns.host_layout:
        main_host_layout(ns)
        return
    if not torch.cuda.is_available():
        raise SystemExit("step_profile needs a CUDA GPU")
    copy = measure_copy_bandwidth("cuda")
    bandwidth = copy["bandwidth_bytes_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp))
        runner = profile_runner(model_dir, load_format, ns, bandwidth)
        gc.collect()  # free the first runner's KV cache and graphs before the engine's
        torch.cuda.empty_cache()
        try:
            runner["rms_norm_us"] = rms_norm_variants(ns.batch, 1024, 16, 128)
        except Exception as e:  # noqa: BLE001 - a side measurement
            runner["rms_norm_us"] = {"error": repr(e)}
        engine = None
        if ns.engine:
            try:
                engine = profile_engine(model_dir, load_format, ns)
            except Exception as e:  # noqa: BLE001 - report the runner's numbers even so
                engine = {"error": repr(e)}
    result = {"environment": environment("cuda"), "copy_bandwidth_bytes_per_s": bandwidth,
              "runner": runner, "engine": engine}
    path = write_json(ns.output or RUNS_DIR / "step_profile.json", result)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; results in {path}")
    print(f"GPU ms per step by category: {runner['gpu_ms_by_category']}")
    print(format_table(runner["top_kernels"], ["kernel", "ms_per_step"]))
    print(f"RMSNorm variants (us per call): {runner['rms_norm_us']}")
    cols = ["batch", "context", "floor_ms", "graph_replay_gpu_ms",
            "graph_replay_gpu_ms_without_pdl", "graph_replay_gpu_ms_without_wgmma_gemm",
            "eager_forward_ms",
            "execute_host_ms", "sampling_metadata_ms", "sampler_host_ms", "sampler_gpu_ms",
            "sampler_torch_gpu_ms", "sampler_floor_ms", "wait_gpu_ms", "step_wall_ms"]
    print(format_table([runner], cols))
    if engine is not None and "error" in engine:
        print(f"engine profile failed: {engine['error']}")
    elif engine is not None:
        print(format_table([engine], ["batch", "context", "async", "step_wall_as_configured_ms",
                                      "schedule_ms", "build_entries_ms", "execute_host_ms",
                                      "sampling_metadata_ms", "sampler_host_ms", "wait_gpu_ms",
                                      "postprocess_ms", "step_wall_ms"]))


def main_postprocess(ns: argparse.Namespace) -> None:
    """`--postprocess`: `profile_postprocess` on the GPU if there is one, else on the CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp))
        result = profile_postprocess(model_dir, load_format, ns, device)
    path = write_json(ns.output or RUNS_DIR / "step_profile_postprocess.json",
                      {"environment": environment(device), "postprocess": result})
    print(f"results in {path}")
    print(format_table([result], ["batch", "output_tokens", "per_token_ms_per_step",
                                  "at_end_ms_per_step", "speedup", "per_token_median_ms",
                                  "at_end_median_ms", "per_token_last_step_ms",
                                  "at_end_last_step_ms"]))


def main_host_layout(ns: argparse.Namespace) -> None:
    """`--host-layout`: `profile_host_layout`, on the CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp))
        result = profile_host_layout(model_dir, load_format, ns)
    path = write_json(ns.output or RUNS_DIR / "step_profile_host_layout.json",
                      {"environment": environment("cpu"), "host_layout": result})
    print(f"results in {path}")
    print(format_table([result], ["batch", "context", "block_size", "arrays_ms", "lists_ms",
                                  "speedup"]))


if __name__ == "__main__":
    main()
