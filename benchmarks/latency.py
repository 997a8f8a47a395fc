"""Single-request latency: time to first token and decode time per token, at batch 1.

What it measures, for each prompt length (default 128, 512, 2048, 8192 tokens) and each
backend: the median over `--num-iters` runs (after one untimed warm-up run per length) of

- TTFT, the time from handing the request to the engine to its first output token
  (the prefill), and
- decode ms per output token (TPOT): the time from the first to the last output token
  over the tokens in between; also the median and p99 of the gaps between tokens,

each against its floor, from a copy bandwidth and a matmul rate measured in the same run:

- decode: the bytes one step must move (all weights once, the context's KV once, one
  token's KV written) over the copy bandwidth; the weights alone (the usual quote,
  about 0.28 ms for Qwen3-0.6B in bf16 on an H200) are reported beside it;
- TTFT: the larger of the prefill's FLOPs over the matmul rate ("compute") and its bytes
  (weights once, the prompt's KV written) over the copy bandwidth ("memory"); the JSON
  says which bound applies.

Each run uses a fresh random prompt and prefix caching is off, so no run reuses another's
KV cache.

On a GPU (random Qwen3-0.6B weights, bf16; each backend in its own process):

    python benchmarks/latency.py                          # mini-vllm and transformers
    python benchmarks/latency.py --backends mini-vllm --prompt-lens 128 2048 --output-len 256
    python benchmarks/latency.py --backends mini-vllm --max-piecewise-graph-tokens 0 \
        --output benchmarks/results/latency_eager_prefill.json   # prefills without graphs

On a CPU (a smoke run of the tiny model):

    python benchmarks/latency.py --preset tiny --prompt-lens 16 64 --output-len 8 \\
        --num-iters 2 --backends mini-vllm --device cpu

Results: a table on stdout (last) and JSON in `--output`
(default `benchmarks/runs/latency.json`, which git ignores; the committed runs in
`benchmarks/results/` were each written with an explicit `--output`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DEFAULT_TOKEN_ID_MAX,
    RUNS_DIR,
    TEMPERATURE,
    ModelShape,
    allreduce_bytes,
    dtype_bytes,
    environment,
    error_text,
    format_table,
    load_hf_model,
    measure_copy_bandwidth,
    measure_matmul_flops,
    prepare_model_dir,
    resolve_device,
    resolve_dtype_name,
    run_worker,
    write_json,
)

BACKENDS = ("mini-vllm", "transformers")
_WARMUP_OUTPUT_LEN = 8

# One timed request: the time it was handed over and the arrival time of each token.
Timing = tuple[float, list[float]]
# Runs one request (prompt ids, output length) and returns its timing.
RequestFn = Callable[[list[int], int], Timing]


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a Hugging Face Qwen3 checkpoint directory (default: --preset)")
    p.add_argument("--preset", default="qwen3-0.6b", help="random-weight preset")
    p.add_argument("--write-weights", action="store_true",
                   help="write the preset's random weights instead of load_format dummy")
    p.add_argument("--load-format", default=None, choices=("auto", "dummy"))
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per run")
    p.add_argument("--num-iters", type=int, default=3, help="timed runs per prompt length")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each backend in its own process (default: on a GPU)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds one backend may take (isolated runs)")
    p.add_argument("--copy-bytes", type=int, default=None,
                   help="buffer size of the copy-bandwidth measurement (default: 1 GiB on a "
                        "GPU, 256 MiB on the CPU)")
    p.add_argument("--output", default=str(RUNS_DIR / "latency.json"),
                   help="where to write the JSON results (default: benchmarks/runs/, which "
                        "git ignores)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt plus --output-len")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs to split the model over (mini-vllm only); above 1 the NCCL "
                        "all-reduce is measured first and the floors spread")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-piecewise-graph-tokens", type=int, default=None,
                   help="mini-vllm: prefills of up to this many tokens replay piecewise "
                        "CUDA graphs (0: eager prefills; default: the engine's)")
    p.add_argument("--hf-attn-implementation", default="sdpa",
                   help="transformers' attention implementation")
    p.add_argument("--worker", default=None, choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    return p


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """A prompt of random token ids, different for every (length, seed)."""
    rng = random.Random(seed)
    top = min(vocab_size - 1, DEFAULT_TOKEN_ID_MAX)
    return [rng.randint(0, top) for _ in range(length)]


# --8<-- [start:mini_vllm_request]
def mini_vllm_request_fn(model_dir: str, ns: argparse.Namespace) -> tuple[RequestFn, int]:
    """Build the engine; return a function that runs one request through its step loop,
    noting when each token comes out, and the model's vocabulary size."""
    from mini_vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "device": ns.device, "dtype": ns.dtype, "max_model_len": ns.max_model_len,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "enforce_eager": ns.enforce_eager, "load_format": ns.load_format,
        "enable_prefix_caching": False,  # each run must compute its prompt
        "tensor_parallel_size": ns.tensor_parallel_size,
    }
    if ns.max_piecewise_graph_tokens is not None:
        kwargs["max_piecewise_graph_tokens"] = ns.max_piecewise_graph_tokens
    engine = LLM(model_dir, **kwargs).engine
    counter = itertools.count()

    def run(prompt: list[int], output_len: int) -> Timing:
        params = SamplingParams(temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=0.0,
                                ignore_eos=True, max_tokens=output_len)
        arrivals: list[float] = []
        start = time.perf_counter()
        engine.add_request(f"latency-{next(counter)}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(out.error)
                now = time.perf_counter()
                arrivals.extend([now] * sum(len(c.token_ids) for c in out.outputs))
        return start, arrivals

    return run, engine.config.model_config.vocab_size
# --8<-- [end:mini_vllm_request]


def transformers_request_fn(model_dir: str, ns: argparse.Namespace) -> tuple[RequestFn, int]:
    """Load the model into transformers (its own random init when the directory has no
    weights); return a function that runs `generate` with a streamer noting each token."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    device = torch.device(ns.device)
    model = load_hf_model(model_dir, ns.dtype, ns.device, ns.hf_attn_implementation,
                          ns.load_format)

    class _Clock(BaseStreamer):
        """`generate` calls `put` with the prompt first, then with each new token."""

        def __init__(self) -> None:
            self.calls: list[float] = []

        def put(self, value: Any) -> None:
            self.calls.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(prompt: list[int], output_len: int) -> Timing:
        config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                  max_new_tokens=output_len, min_new_tokens=output_len,
                                  pad_token_id=0)
        ids = torch.tensor([prompt], device=device)
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                           streamer=clock)
        return start, clock.calls[1:]

    return run, model.config.vocab_size


def summarize_timings(timings: Sequence[Timing]) -> dict[str, Any]:
    """Medians over runs of TTFT and TPOT, and the gaps between tokens of all runs."""
    ttfts, tpots, gaps = [], [], []
    for start, arrivals in timings:
        if not arrivals:
            raise RuntimeError("a run produced no tokens")
        ttfts.append(arrivals[0] - start)
        if len(arrivals) > 1:
            tpots.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
            gaps.extend(b - a for a, b in itertools.pairwise(arrivals))
    out: dict[str, Any] = {"ttft_ms": 1e3 * statistics.median(ttfts),
                           "ttft_ms_runs": [1e3 * t for t in ttfts],
                           "output_tokens": [len(a) for _, a in timings]}
    if tpots:
        gaps.sort()
        out.update(tpot_ms=1e3 * statistics.median(tpots),
                   tpot_ms_runs=[1e3 * t for t in tpots],
                   itl_median_ms=1e3 * statistics.median(gaps),
                   itl_p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))])
    return out


def run_backend(backend: str, model_dir: str, ns: argparse.Namespace) -> dict[str, Any]:
    """Every prompt length on one backend, in this process; failures become results."""
    import importlib.util

    module = {"mini-vllm": "mini_vllm", "transformers": "transformers"}[backend]
    if importlib.util.find_spec(module) is None:
        return {"status": "skipped", "reason": f"{module} is not installed"}
    try:
        make = mini_vllm_request_fn if backend == "mini-vllm" else transformers_request_fn
        run, vocab = make(model_dir, ns)
        by_len: dict[str, Any] = {}
        for length in ns.prompt_lens:
            run(random_prompt(length, ns.seed + 7919 * length, vocab),
                min(_WARMUP_OUTPUT_LEN, ns.output_len))
            timings = [run(random_prompt(length, ns.seed + 7919 * length + i + 1, vocab),
                           ns.output_len) for i in range(ns.num_iters)]
            by_len[str(length)] = summarize_timings(timings)
            print(f"{backend}: prompt {length}: TTFT {by_len[str(length)]['ttft_ms']:.2f} ms, "
                  f"TPOT {by_len[str(length)].get('tpot_ms', float('nan')):.3f} ms", flush=True)
        return {"status": "ok", "by_prompt_len": by_len}
    except Exception as e:  # noqa: BLE001 - a failing backend is a result, not the end of the run
        traceback.print_exc()
        return {"status": "error", "error": error_text(e)}
    finally:
        gc.collect()


# --8<-- [start:latency_floor]
def latency_floors(shape: ModelShape, nbytes: int, prompt_len: int, output_len: int,
                   bandwidth: float, flops_per_s: float) -> dict[str, Any]:
    """The floors of one prompt length at batch 1.

    Decode: a step reads every weight once, reads the context's KV (on average
    `prompt_len + output_len / 2` tokens) and writes one token's KV. TTFT: the prefill
    must both do its FLOPs and move its bytes (weights once, the prompt's KV written);
    the slower of the two is the floor.
    """
    kv = shape.kv_bytes_per_token(nbytes)
    weights = shape.weight_bytes(nbytes)
    mean_context = prompt_len + output_len / 2
    decode_bytes = weights + mean_context * kv + kv
    prefill_compute_s = shape.prefill_flops(prompt_len) / flops_per_s
    prefill_memory_s = (weights + prompt_len * kv) / bandwidth
    return {
        "decode_floor_ms": 1e3 * decode_bytes / bandwidth,
        "decode_weights_floor_ms": 1e3 * weights / bandwidth,
        "ttft_floor_ms": 1e3 * max(prefill_compute_s, prefill_memory_s),
        "ttft_floor_bound": "compute" if prefill_compute_s >= prefill_memory_s else "memory",
        "ttft_compute_floor_ms": 1e3 * prefill_compute_s,
        "ttft_memory_floor_ms": 1e3 * prefill_memory_s,
        "prefill_flops": shape.prefill_flops(prompt_len),
    }
# --8<-- [end:latency_floor]


def spread_latency_floor(floor: dict[str, Any], shape: ModelShape, tp: int, nbytes: int,
                         allreduce: dict[str, Any]) -> None:
    """A batch-1 decode floor over `tp` GPUs, in place: the bytes divide by `tp`, and
    the step's all-reduces (`2 * layers + 1` of one token's `[1, hidden]`) and the
    logits' all-gather add their measured time (one token's all-reduce is a few KiB:
    its latency, not the bus bandwidth, is what it costs). The one-GPU value is
    kept as `decode_floor_ms_one_gpu`; `decode_floor_bandwidth_ms` counts the
    communication at the bus bandwidth instead (the throughput floor's rule)."""
    from benchmarks.allreduce import allreduce_time_s

    one_gpu = floor["decode_floor_ms"]
    reduce_bytes = allreduce_bytes(shape, 1, nbytes)
    gather_bytes = shape.vocab_size * nbytes
    count = 2 * shape.num_layers + 1
    measured_ms = 1e3 * (count * allreduce_time_s(allreduce, shape.hidden_size * nbytes)
                         + allreduce_time_s(allreduce, gather_bytes))
    busbw = allreduce["busbw_bytes_per_s"]
    bandwidth_ms = 1e3 * (reduce_bytes * 2 * (tp - 1) / tp + gather_bytes * (tp - 1) / tp) / busbw
    floor.update(tensor_parallel_size=tp, decode_floor_ms_one_gpu=one_gpu,
                 decode_communication_ms=measured_ms,
                 decode_floor_bandwidth_ms=one_gpu / tp + bandwidth_ms,
                 decode_floor_ms=one_gpu / tp + measured_ms)


def print_report(report: dict[str, Any]) -> None:
    """Print the measurements and floors, the table last."""
    print(f"\ncopy bandwidth {report['copy_bandwidth']['bandwidth_bytes_per_s'] / 1e12:.3f} "
          f"TB/s, matmul {report['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s "
          f"({report['matmul']['dtype']}); batch 1, {report['args']['output_len']} output tokens")
    rows = []
    for backend, r in report["results"].items():
        if r.get("status") != "ok":
            rows.append({"backend": backend, "note": r.get("error") or r.get("reason")})
            continue
        for length, m in r["by_prompt_len"].items():
            f = report["floors"][length]
            rows.append({
                "backend": backend, "prompt": int(length), "TTFT ms": m["ttft_ms"],
                "TTFT floor ms": f["ttft_floor_ms"], "bound": f["ttft_floor_bound"],
                "TTFT % floor": 100 * m["ttft_fraction_of_floor"],
                "TPOT ms": m.get("tpot_ms"), "TPOT floor ms": f["decode_floor_ms"],
                "weights-only ms": f["decode_weights_floor_ms"],
                "TPOT % floor": 100 * m.get("decode_fraction_of_floor", 0.0),
                "ITL p99 ms": m.get("itl_p99_ms")})
    columns = ["backend", "prompt", "TTFT ms", "TTFT floor ms", "bound", "TTFT % floor",
               "TPOT ms", "TPOT floor ms", "weights-only ms", "TPOT % floor", "ITL p99 ms"]
    if any("note" in r for r in rows):
        columns.append("note")
    print(format_table(rows, columns))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the report that is also written to `--output`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    ns.device = resolve_device(ns.device)
    ns.dtype = resolve_dtype_name(ns.dtype, ns.device)
    if ns.output_len < 2 or ns.num_iters < 1:
        raise SystemExit("--output-len must be at least 2 and --num-iters at least 1")

    with tempfile.TemporaryDirectory(prefix="mini-vllm-bench-") as tmp:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp),
                                                   write_weights=ns.write_weights)
        ns.load_format = ns.load_format or load_format
        config_max = json_max_positions(model_dir)
        too_long = [n for n in ns.prompt_lens if n + ns.output_len > config_max]
        if too_long:
            print(f"skipping prompt lengths {too_long}: with {ns.output_len} output tokens "
                  f"they exceed the model's {config_max} positions", flush=True)
        ns.prompt_lens = [n for n in ns.prompt_lens if n not in too_long]
        if not ns.prompt_lens:
            raise SystemExit("no prompt length fits the model")
        ns.max_model_len = ns.max_model_len or max(ns.prompt_lens) + ns.output_len

        if ns.worker:
            result = run_backend(ns.worker, str(model_dir), ns)
            write_json(ns.worker_output, result)
            return result

        print(f"measuring copy bandwidth and matmul rate on {ns.device} ...", flush=True)
        copy = measure_copy_bandwidth(ns.device, ns.copy_bytes)
        matmul = measure_matmul_flops(ns.device, ns.dtype)
        allreduce = None
        if ns.tensor_parallel_size > 1 and ns.device.startswith("cuda"):
            from benchmarks.allreduce import measure_allreduce

            allreduce = measure_allreduce(ns.tensor_parallel_size)
        isolate = ns.isolate if ns.isolate is not None else ns.device.startswith("cuda")
        results: dict[str, Any] = {}
        for backend in ns.backends:
            print(f"{backend}: prompt lengths {ns.prompt_lens} ...", flush=True)
            if isolate:
                worker_argv = [*argv, "--model", str(model_dir), "--load-format",
                               ns.load_format, "--device", ns.device, "--dtype", ns.dtype,
                               "--worker", backend]
                results[backend] = run_worker(Path(__file__).resolve(), worker_argv, ns.timeout)
            else:
                results[backend] = run_backend(backend, str(model_dir), ns)
        shape = ModelShape.from_model_dir(model_dir)

    floors = {str(n): latency_floors(shape, dtype_bytes(ns.dtype), n, ns.output_len,
                                     copy["bandwidth_bytes_per_s"], matmul["flops_per_s"])
              for n in ns.prompt_lens}
    if allreduce is not None:
        for f in floors.values():
            spread_latency_floor(f, shape, ns.tensor_parallel_size, dtype_bytes(ns.dtype),
                                 allreduce)
    for r in results.values():
        for length, m in r.get("by_prompt_len", {}).items():
            m["ttft_fraction_of_floor"] = floors[length]["ttft_floor_ms"] / m["ttft_ms"]
            if "tpot_ms" in m:
                m["decode_fraction_of_floor"] = floors[length]["decode_floor_ms"] / m["tpot_ms"]
    ratios = {}
    ok = {b: r for b, r in results.items() if r.get("status") == "ok"}
    for a in ok:
        for b in ok:
            if a != b:
                ratios[f"{a} / {b}"] = {
                    length: {key: ma[key] / mb[key] for key in ("ttft_ms", "tpot_ms")
                             if key in ma and key in mb}
                    for length, ma in ok[a]["by_prompt_len"].items()
                    if (mb := ok[b]["by_prompt_len"].get(length))}
    report = {
        "benchmark": "latency",
        "environment": environment(ns.device),
        "args": {k: v for k, v in vars(ns).items() if not k.startswith("worker")},
        "model": {"dir": str(ns.model) if ns.model else f"preset {ns.preset}",
                  "load_format": ns.load_format, "shape": shape.__dict__,
                  "weight_bytes": shape.weight_bytes(dtype_bytes(ns.dtype))},
        "copy_bandwidth": copy,
        "matmul": matmul,
        "allreduce": allreduce,
        "floors": floors,
        "results": results,
        "ratios": ratios,
    }
    write_json(ns.output, report)
    print(f"wrote {ns.output}")
    print_report(report)
    return report


def json_max_positions(model_dir: Path) -> int:
    """The model's `max_position_embeddings`."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())
               .get("max_position_embeddings", 40960))


if __name__ == "__main__":
    main()
