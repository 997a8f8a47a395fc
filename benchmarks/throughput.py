"""Offline throughput: output tokens per second on the standard 256-request workload.

What it measures: the wall time of one `generate` call over all requests (after one
untimed warm-up request) for each backend, the output tokens per second that gives, the
ratio between the backends, and how close each comes to the workload's floor. The floor
is counted step by step (`common.step_floors`): each prompt step and each decode step
takes at least its bytes (KV reads and writes, its read of the weights) over a copy
bandwidth, and at least its FLOPs over a matmul rate, both measured at the start of the
same run; the floor is the sum of the longer of the two. The bytes alone give
`byte_floor_s` (and `fraction_of_byte_floor`).

The workload (see `common.make_workload`): 256 requests drawn after `random.seed(0)`,
prompts of randint(100, 1024) random token ids, max_tokens randint(100, 1024),
temperature 0.6, EOS ignored; 142,827 prompt and 133,966 output tokens, checked.

On a GPU (random Qwen3-0.6B weights, bf16; every backend in its own process):

    python benchmarks/throughput.py                      # mini-vllm, transformers, vllm, nano-vllm
    python benchmarks/throughput.py --backends mini-vllm --output benchmarks/results/mine.json
    python benchmarks/throughput.py --model ./qwen3      # a real checkpoint directory
    python benchmarks/throughput.py --breakdown          # + GPU time by step kind and kernel
    python benchmarks/throughput.py --preset llama3-8b --backends mini-vllm   # another family

Backends that are not installed (vllm, nano-vllm) are skipped with the reason; a backend
that fails records its error in the JSON and the others still run.

Structured outputs (chapter 18): `--json-schema records` (a builtin schema) or
`--json-schema FILE` runs mini-vllm a second time in the same job with every request
of the workload under that JSON schema (`mini-vllm-json`), and reports the mask's
cost: the throughput ratio, the time added per step, and the host's time building
the masks. The builtin `records` schema is an array of at least 1,000 records, so
that no request's grammar can end before its max_tokens: every output token of the
run is drawn under a mask (`constrained_fraction` checks it).

    python benchmarks/throughput.py --backends mini-vllm --json-schema records \
        --output benchmarks/results/structured_output_throughput.json

On a CPU (a smoke run of the tiny model, seconds):

    python benchmarks/throughput.py --preset tiny --num-requests 8 --max-tokens-range 8 16 \\
        --input-len-range 16 64 --backends mini-vllm --device cpu

Results: a table on stdout (last) and JSON in `--output`
(default `benchmarks/runs/throughput.json`, which git ignores; the committed runs in
`benchmarks/results/` were each written with an explicit `--output`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DEFAULT_INPUT_LEN,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_SEED,
    RUNS_DIR,
    TEMPERATURE,
    ModelShape,
    Workload,
    check_default_workload,
    dtype_bytes,
    environment,
    error_text,
    format_table,
    has_weights,
    is_default_workload,
    load_hf_model,
    make_workload,
    measure_copy_bandwidth,
    measure_matmul_flops,
    module_version,
    prepare_model_dir,
    resolve_device,
    resolve_dtype_name,
    run_worker,
    tensor_parallel_floor,
    throughput_floor,
    write_json,
)

BACKENDS = ("mini-vllm", "transformers", "vllm", "nano-vllm", "mini-vllm-json")

# --8<-- [start:json_schemas]
# `--json-schema` builtins. `records` cannot end before 1,000 records (thousands of
# tokens): under ignore_eos, a grammar that ends lets the request go on unconstrained.
JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "records": {"type": "array", "minItems": 1000, "items": {
        "type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999999},
            "name": {"type": "string", "maxLength": 16},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                     "maxItems": 3},
            "ok": {"type": "boolean"}},
        "required": ["id", "name", "score", "tags", "ok"]}},
}
# --8<-- [end:json_schemas]
_WARMUP_PROMPT_LEN = 64
_WARMUP_MAX_TOKENS = 16


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="a Hugging Face checkpoint directory (default: --preset)")
    model.add_argument("--preset", default="qwen3-0.6b",
                       help="random-weight preset when --model is not given: qwen3-0.6b, "
                            "qwen3-8b, tiny, or another family's shape: llama3-8b, "
                            "qwen2.5-7b, mistral-7b, gpt2-xl, qwen3-30b-a3b (tiny-llama3 ...)")
    model.add_argument("--write-weights", action="store_true",
                       help="write the preset's random weights to disk instead of having "
                            "the engines make them up (load_format dummy)")
    model.add_argument("--load-format", default=None, choices=("auto", "dummy"),
                       help="override: dummy = random weights, auto = read the checkpoint")
    work = p.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS)
    work.add_argument("--input-len-range", type=int, nargs=2, default=list(DEFAULT_INPUT_LEN),
                      metavar=("LO", "HI"), help="prompt lengths, randint(LO, HI)")
    work.add_argument("--max-tokens-range", type=int, nargs=2,
                      default=list(DEFAULT_OUTPUT_LEN), metavar=("LO", "HI"),
                      help="output lengths, randint(LO, HI)")
    work.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the draw")
    run = p.add_argument_group("run")
    run.add_argument("--backends", nargs="+", default=list(BACKENDS[:4]), choices=BACKENDS)
    run.add_argument("--json-schema", default=None, metavar="NAME_OR_FILE",
                     help="also run mini-vllm with every request under this JSON schema "
                          f"(mini-vllm-json): a builtin ({', '.join(JSON_SCHEMAS)}) or a "
                          "file holding a schema")
    run.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    run.add_argument("--dtype", default="auto",
                     choices=("auto", "bfloat16", "float16", "float32"))
    run.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                     help="run each backend in its own process (default: on a GPU)")
    run.add_argument("--timeout", type=float, default=1800.0,
                     help="seconds one backend may take, setup included (isolated runs)")
    run.add_argument("--copy-bytes", type=int, default=None,
                     help="buffer size of the copy-bandwidth measurement (default: 1 GiB on "
                          "a GPU, 256 MiB on the CPU)")
    run.add_argument("--breakdown", action="store_true",
                     help="mini-vllm: run the workload once more under torch.profiler and "
                          "record GPU time by kernel category and by kind of step")
    run.add_argument("--output", default=str(RUNS_DIR / "throughput.json"),
                     help="where to write the JSON results (default: benchmarks/runs/, "
                          "which git ignores; name a file in benchmarks/results/ to commit "
                          "a run)")
    eng = p.add_argument_group("engine (mini-vllm, vllm, nano-vllm)")
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--max-model-len", type=int, default=4096)
    eng.add_argument("--block-size", type=int, default=None,
                     help="tokens per KV-cache block (default: the engine's)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    eng.add_argument("--max-piecewise-graph-tokens", type=int, default=None,
                     help="mini-vllm: steps with prompts of up to this many tokens replay "
                          "piecewise CUDA graphs (default: the engine's)")
    eng.add_argument("--num-gpu-blocks-override", type=int, default=None)
    eng.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="GPUs to split the model over (mini-vllm only); above 1 the NCCL "
                          "all-reduce bandwidth is measured first and the floor spread")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=None, help="default: the engine's")
    hf = p.add_argument_group("transformers")
    hf.add_argument("--hf-attn-implementation", default="paged|sdpa",
                    help="attention of transformers' continuous batching")
    # Internal: run one backend and write its result here (used by --isolate).
    p.add_argument("--worker", default=None, choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    return p


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """mini-vllm's engine arguments from the flags (None = the engine's default)."""
    kwargs = {"device": ns.device, "dtype": ns.dtype, "max_num_seqs": ns.max_num_seqs,
              "max_num_batched_tokens": ns.max_num_batched_tokens,
              "max_model_len": ns.max_model_len, "block_size": ns.block_size,
              "gpu_memory_utilization": ns.gpu_memory_utilization,
              "enforce_eager": ns.enforce_eager,
              "max_piecewise_graph_tokens": ns.max_piecewise_graph_tokens,
              "num_gpu_blocks_override": ns.num_gpu_blocks_override,
              "enable_prefix_caching": ns.enable_prefix_caching,
              "load_format": ns.load_format, "seed": ns.seed,
              "tensor_parallel_size": ns.tensor_parallel_size}
    return {k: v for k, v in kwargs.items() if v is not None}


def _warmup_prompt(vocab_size: int) -> list[int]:
    return [(7 * i + 3) % min(vocab_size, 10000) for i in range(_WARMUP_PROMPT_LEN)]


def load_json_schema(name_or_file: str) -> dict[str, Any]:
    """A builtin schema by name, or the schema in a file."""
    if name_or_file in JSON_SCHEMAS:
        return JSON_SCHEMAS[name_or_file]
    path = Path(name_or_file)
    if not path.is_file():
        raise SystemExit(f"--json-schema: {name_or_file!r} is neither a builtin "
                         f"({', '.join(JSON_SCHEMAS)}) nor a file")
    return json.loads(path.read_text())


# --8<-- [start:run_mini_vllm]
def run_mini_vllm(model_dir: str, workload: Workload, ns: argparse.Namespace,
                  json_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time `LLM.generate` over the whole workload (after one warm-up request),
    every request under `json_schema` when one is given."""
    from mini_vllm import LLM, SamplingParams

    llm = LLM(model_dir, **_engine_kwargs(ns))
    vocab = llm.engine.config.model_config.vocab_size
    structured = None if json_schema is None else {"json": json_schema}

    def params(max_tokens: int) -> SamplingParams:
        # top-k / top-p explicitly off: the model's generation_config would turn them on.
        return SamplingParams(temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=0.0,
                              ignore_eos=True, max_tokens=max_tokens,
                              structured_outputs=structured)

    llm.generate([{"prompt_token_ids": _warmup_prompt(vocab)}], params(_WARMUP_MAX_TOKENS),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    sampling = [params(m) for m in workload.max_tokens]
    before = llm.engine.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.get_stats()
    timed = {k: v - before[k] for k, v in stats.items()  # the timed run's counters alone
             if isinstance(v, (int, float)) and k.endswith(("_total", "_s", "num_steps"))}
    result = {"wall_s": elapsed,
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
              "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
              "engine_stats": stats,
              "timed_stats": timed,
              "dtype": str(llm.engine.config.dtype).removeprefix("torch."),
              "block_size": llm.engine.config.cache_config.block_size,
              "max_piecewise_graph_tokens": llm.engine.config.max_piecewise_graph_tokens,
              "kv_cache_blocks": llm.engine.model_runner.num_blocks,
              "graph_memory_bytes": getattr(llm.engine.model_runner, "graph_memory_bytes", 0),
              "device": str(llm.engine.config.device)}
    if structured is not None:
        steps = timed["num_steps"]
        result["structured_output"] = {
            "constrained_tokens": timed["structured_output_tokens_total"],
            "constrained_fraction": timed["structured_output_tokens_total"]
            / max(1, result["output_tokens"]),
            "metadata_s": timed["structured_output_metadata_s"],
            "metadata_ms_per_step": 1e3 * timed["structured_output_metadata_s"] / max(1, steps)}
    if ns.breakdown and llm.engine.config.device.type == "cuda":
        result["breakdown"] = breakdown(llm, lambda: llm.generate(prompts, sampling,
                                                                  use_tqdm=False))
    return result
# --8<-- [end:run_mini_vllm]


def run_mini_vllm_json(model_dir: str, workload: Workload, ns: argparse.Namespace
                       ) -> dict[str, Any]:
    """`run_mini_vllm` with every request under `--json-schema`."""
    if ns.json_schema is None:
        raise ValueError("mini-vllm-json needs --json-schema")
    result = run_mini_vllm(model_dir, workload, ns, load_json_schema(ns.json_schema))
    result["json_schema"] = ns.json_schema
    return result


# --8<-- [start:mask_cost]
def mask_cost(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What putting every request under a JSON schema cost, from the plain and the
    constrained runs of one job: the throughput ratio (the bar: at least 0.9), and
    the time each step took longer, on average, with the host's share of it."""
    plain, constrained = results.get("mini-vllm", {}), results.get("mini-vllm-json", {})
    if plain.get("status") != "ok" or constrained.get("status") != "ok":
        return None
    steps = constrained["timed_stats"]["num_steps"]
    so = constrained["structured_output"]
    ratio = constrained["output_tok_s"] / plain["output_tok_s"]
    return {
        "json_schema": constrained["json_schema"],
        "output_tok_s_ratio": ratio,
        "slowdown_fraction": 1 - ratio,
        "meets_bar": ratio >= 0.9,
        "steps": {"plain": plain["timed_stats"]["num_steps"], "constrained": steps},
        "added_ms_per_step": 1e3 * (constrained["wall_s"] - plain["wall_s"]) / steps,
        "metadata_ms_per_step": so["metadata_ms_per_step"],
        "constrained_fraction": so["constrained_fraction"],
    }
# --8<-- [end:mask_cost]


# Decode steps are grouped by how many sequences they carry.
_BATCH_BUCKETS = (8, 32, 64, 128, 192, 256)


def breakdown(llm: Any, run: Any) -> dict[str, Any]:
    """Where the GPU time of one more run of the workload goes.

    By kind of step: each step's GPU time comes from the two CUDA events the
    engine records around it (`gpu_busy_s`); decode steps are bucketed by
    batch size. Each kind also counts the context tokens its decode rows
    attend to (`kv_read_tokens`), from which `add_step_floors` gives each
    kind its floor and its time per step above it. By kernel: torch.profiler
    over the same run, with the kernel categories of `step_profile.py`. The
    profiler slows the host, not the kernels, so its wall time is not a
    throughput figure. A kernel launched with programmatic dependent launch
    may start before the one it follows ends; its time then includes that
    wait.
    """
    from benchmarks.step_profile import by_category, profile_kernels

    engine = llm.engine
    steps: list[tuple[bool, int, float, int]] = []
    launch, process = engine._launch, engine._process
    kv_tokens: dict[int, int] = {}  # id of a launched step -> context tokens its decodes read

    def record_launch(sched: Any, prev: Any = None) -> Any:
        step = launch(sched, prev)
        kv_tokens[id(step)] = sum(s.start_pos + s.num_new_tokens
                                  for s in sched.scheduled if not s.is_prefill)
        return step

    def record(step: Any) -> Any:
        out = process(step)
        seconds = step.host.gpu_seconds()  # after `process` waited for it
        if seconds is not None:
            steps.append((step.decode_only, len(step.rows), seconds, kv_tokens.pop(id(step), 0)))
        return out

    engine.scheduler.reset_prefix_cache()  # else the prompts of the timed run are cached
    # instance attributes: they shadow the methods for this run only
    engine._launch, engine._process = record_launch, record
    try:
        kernels = profile_kernels(run)
    finally:
        del engine._launch, engine._process
    kinds: dict[str, dict[str, float]] = {}
    for decode_only, rows, seconds, kv_read_tokens in steps:
        if decode_only:
            top = next(b for b in _BATCH_BUCKETS + (rows,) if rows <= b)
            kind = f"decode, batch <= {top}"
        else:
            kind = "prefill or mixed"
        entry = kinds.setdefault(kind, {"steps": 0, "gpu_s": 0.0, "kv_read_tokens": 0})
        entry["steps"] += 1
        entry["gpu_s"] += seconds
        entry["kv_read_tokens"] += kv_read_tokens
    for entry in kinds.values():
        entry["gpu_ms_per_step"] = 1e3 * entry["gpu_s"] / entry["steps"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    return {"gpu_s_by_step_kind": dict(sorted(kinds.items())),
            "kernel_s_by_category": by_category(kernels),
            "kernel_s_total": sum(kernels.values()),
            "top_kernels": [{"kernel": n[:90], "s": s} for n, s in top]}


# --8<-- [start:run_transformers]
def run_transformers(model_dir: str, workload: Workload, ns: argparse.Namespace
                     ) -> dict[str, Any]:
    """Time transformers' continuous batching: add every request, collect every result."""
    import inspect

    from transformers import GenerationConfig

    model = load_hf_model(model_dir, ns.dtype, ns.device, ns.hf_attn_implementation,
                          ns.load_format)
    gen_config = GenerationConfig(
        do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
        eos_token_id=-1,  # no EOS: every request runs to its max_new_tokens
        max_new_tokens=max(workload.max_tokens))
    manager = model.init_continuous_batching(generation_config=gen_config)
    deadline = time.monotonic() + ns.timeout

    # Keyword arguments differ between transformers versions: pass the ones this one takes.
    accepted = inspect.signature(manager.add_request).parameters
    extra = {"eos_token_id": -1} if "eos_token_id" in accepted else {}

    def run(prompts: Sequence[list[int]], max_tokens: Sequence[int], tag: str) -> list[Any]:
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            ids = {"request_id": f"{tag}{i}"} if "request_id" in accepted else {}
            manager.add_request(input_ids=list(p), max_new_tokens=m, **ids, **extra)
        done: dict[str, Any] = {}
        while len(done) < len(prompts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(done)}/{len(prompts)} requests after {ns.timeout} s")
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped with "
                                       f"{len(prompts) - len(done)} requests unfinished")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                done[result.request_id] = result
        return list(done.values())

    if hasattr(manager, "warmup"):
        manager.warmup()  # CUDA-graph capture, where this version does it
    manager.start()
    try:
        run([_warmup_prompt(model.config.vocab_size)], [_WARMUP_MAX_TOKENS], "warmup")
        start = time.perf_counter()
        results = run(workload.prompts, workload.max_tokens, "r")
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=60)
    return {"wall_s": elapsed,
            "output_tokens": sum(len(r.generated_tokens) for r in results),
            "prompt_tokens": workload.num_prompt_tokens,
            "attn_implementation": model.config._attn_implementation,
            "transformers": module_version("transformers"),
            "weights": "checkpoint" if has_weights(Path(model_dir)) and ns.load_format != "dummy"
                       else "random init"}
# --8<-- [end:run_transformers]


def run_vllm(model_dir: str, workload: Workload, ns: argparse.Namespace) -> dict[str, Any]:
    """Time vLLM's offline `LLM.generate` (random weights with load_format dummy)."""
    import vllm

    kwargs: dict[str, Any] = {
        "model": model_dir, "dtype": ns.dtype, "max_num_seqs": ns.max_num_seqs,
        "max_model_len": ns.max_model_len, "gpu_memory_utilization": ns.gpu_memory_utilization,
        "enforce_eager": ns.enforce_eager, "seed": ns.seed, "load_format": ns.load_format,
        # Prompts are token ids; the random ids may exceed a small test tokenizer.
        "skip_tokenizer_init": True,
    }
    if ns.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = ns.max_num_batched_tokens
    if ns.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = ns.enable_prefix_caching
    if ns.block_size:
        kwargs["block_size"] = ns.block_size
    llm = vllm.LLM(**kwargs)

    def params(m: int) -> Any:
        return vllm.SamplingParams(temperature=TEMPERATURE, top_p=1.0, ignore_eos=True,
                                   max_tokens=m, detokenize=False)

    llm.generate([{"prompt_token_ids": _warmup_prompt(10000)}], params(_WARMUP_MAX_TOKENS),
                 use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts],
                           [params(m) for m in workload.max_tokens], use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"wall_s": elapsed,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}


def run_nano_vllm(model_dir: str, workload: Workload, ns: argparse.Namespace
                  ) -> dict[str, Any]:
    """Time nano-vllm's `LLM.generate` (it reads safetensors; without them its weights
    stay uninitialised, which does not change its speed)."""
    import nanovllm

    kwargs: dict[str, Any] = {"enforce_eager": ns.enforce_eager,
                              "max_model_len": ns.max_model_len,
                              "max_num_seqs": ns.max_num_seqs,
                              "gpu_memory_utilization": ns.gpu_memory_utilization}
    if ns.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = ns.max_num_batched_tokens
    llm = nanovllm.LLM(model_dir, **kwargs)

    def params(m: int) -> Any:
        return nanovllm.SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m)

    llm.generate([_warmup_prompt(10000)], [params(_WARMUP_MAX_TOKENS)], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, [params(m) for m in workload.max_tokens],
                           use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"wall_s": elapsed,
            "output_tokens": sum(len(o["token_ids"]) for o in outputs),
            "prompt_tokens": workload.num_prompt_tokens,
            "weights": "checkpoint" if has_weights(Path(model_dir)) else "uninitialised"}


_RUNNERS = {"mini-vllm": run_mini_vllm, "transformers": run_transformers,
            "vllm": run_vllm, "nano-vllm": run_nano_vllm, "mini-vllm-json": run_mini_vllm_json}
_IMPORTS = {"mini-vllm": "mini_vllm", "transformers": "transformers", "vllm": "vllm",
            "nano-vllm": "nanovllm", "mini-vllm-json": "xgrammar"}


def missing_backend(backend: str) -> str | None:
    """Why a backend cannot run here (its package is not installed), or None."""
    import importlib.util

    if importlib.util.find_spec(_IMPORTS[backend]) is None:
        return f"{_IMPORTS[backend]} is not installed"
    return None


def run_backend(backend: str, model_dir: str, workload: Workload,
                ns: argparse.Namespace) -> dict[str, Any]:
    """Run one backend in this process; any failure becomes `{"status": "error"}`."""
    reason = missing_backend(backend)
    if reason:
        return {"status": "skipped", "reason": reason}
    try:
        result = _RUNNERS[backend](model_dir, workload, ns)
    except Exception as e:  # noqa: BLE001 - a failing backend is a result, not the end of the run
        traceback.print_exc()
        return {"status": "error", "error": error_text(e)}
    finally:
        gc.collect()
        _empty_cuda_cache()
    result["status"] = "ok"
    result["output_tok_s"] = result["output_tokens"] / result["wall_s"]
    result["total_tok_s"] = (result["output_tokens"] + result["prompt_tokens"]) / result["wall_s"]
    result["output_tokens_expected"] = workload.num_output_tokens
    if result["output_tokens"] != workload.num_output_tokens:
        print(f"warning: {backend} generated {result['output_tokens']:,} tokens, the workload "
              f"asks for {workload.num_output_tokens:,}", file=sys.stderr)
    return result


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _worker_argv(ns: argparse.Namespace, argv: Sequence[str], model_dir: Path,
                 backend: str) -> list[str]:
    """The command line of a worker: the user's flags, with everything resolved."""
    return [*argv, "--model", str(model_dir), "--load-format", ns.load_format,
            "--device", ns.device, "--dtype", ns.dtype, "--worker", backend]


def summarize(results: dict[str, dict[str, Any]], floor: dict[str, Any]) -> dict[str, float]:
    """Fill each ok result's fraction of the floor; return every pair's throughput ratio."""
    ok = {b: r for b, r in results.items() if r.get("status") == "ok"}
    for r in ok.values():
        r["fraction_of_floor"] = floor["floor_s"] / r["wall_s"]
        r["fraction_of_byte_floor"] = floor["byte_floor_s"] / r["wall_s"]
    return {f"{a} / {b}": ok[a]["output_tok_s"] / ok[b]["output_tok_s"]
            for a in ok for b in ok if a != b}


def print_report(report: dict[str, Any]) -> None:
    """Print the measurements and floors, the table last."""
    floor = report["floor"]
    bw = report["copy_bandwidth"]["bandwidth_bytes_per_s"]
    wl = report["workload"]
    print(f"\nworkload: {wl['num_requests']} requests, {wl['prompt_tokens']:,} prompt / "
          f"{wl['output_tokens']:,} output tokens"
          + (" (the standard workload, counts checked)" if wl["standard"] else ""))
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; byte floor {floor['byte_floor_s']:.3f} s "
          f"(KV reads {floor['kv_read_bytes'] / 1e12:.2f} TB, KV writes "
          f"{floor['kv_write_bytes'] / 1e9:.1f} GB, weights {floor['decode_steps']} decode "
          f"steps, {floor['weight_read_bytes'] / 1e12:.2f} TB)")
    for kind, k in floor.get("step_kinds", {}).items():
        print(f"  {kind} steps: {k['steps']:,}, bytes {k['bytes_s']:.3f} s, FLOPs "
              f"{k['flops_s']:.3f} s at {floor['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, "
              f"floor {k['floor_s']:.3f} s")
    print(f"floor {floor['floor_s']:.3f} s = {floor['floor_output_tok_s']:,.0f} output tok/s")
    first_ok = next((b for b, r in report["results"].items() if r.get("status") == "ok"), None)
    rows = []
    for backend, r in report["results"].items():
        row = {"backend": backend, "status": r.get("status")}
        if r.get("status") == "ok":
            row.update({"output tok/s": r["output_tok_s"], "wall s": r["wall_s"],
                        "output tokens": r["output_tokens"],
                        "% of floor": 100 * r["fraction_of_floor"]})
            if first_ok and backend != first_ok:
                row[f"vs {first_ok}"] = report["ratios"][f"{backend} / {first_ok}"]
        else:
            row["note"] = r.get("error") or r.get("reason")
        rows.append(row)
    rows.append({"backend": "floor", "status": "-", "output tok/s": floor["floor_output_tok_s"],
                 "wall s": floor["floor_s"], "output tokens": wl["output_tokens"],
                 "% of floor": 100.0})
    columns = ["backend", "status", "output tok/s", "wall s", "output tokens", "% of floor"]
    if len([r for r in report["results"].values() if r.get("status") == "ok"]) > 1:
        columns.append(f"vs {first_ok}")
    if any("note" in r for r in rows):
        columns.append("note")
    print(format_table(rows, columns))
    for backend, r in report["results"].items():
        if "breakdown" in r:
            print_breakdown(backend, r["breakdown"])
    cost = report.get("structured_output")
    if cost is not None:
        print(f"\nevery request under the JSON schema {cost['json_schema']!r}: "
              f"{100 * cost['output_tok_s_ratio']:.1f} % of the plain run's output tok/s "
              f"({'meets' if cost['meets_bar'] else 'misses'} the 90 % bar); "
              f"{cost['added_ms_per_step']:.3f} ms more per step, of which the host spent "
              f"{cost['metadata_ms_per_step']:.3f} ms building masks; "
              f"{100 * cost['constrained_fraction']:.1f} % of the output tokens constrained")


# --8<-- [start:step_floors]
def add_step_floors(results: dict[str, dict[str, Any]], floor: dict[str, Any]) -> None:
    """Give each kind of step of a breakdown its floor: the KV its decode rows read
    plus one read of the weights per step, at the run's copy bandwidth; and the GPU
    time per step above that floor. (A prefill's compute is not in it.)"""
    bw = floor["bandwidth_bytes_per_s"]
    for r in results.values():
        for kind in r.get("breakdown", {}).get("gpu_s_by_step_kind", {}).values():
            if "kv_read_tokens" not in kind:
                continue
            kind["floor_s"] = (kind["kv_read_tokens"] * floor["kv_bytes_per_token"]
                               + kind["steps"] * floor["weight_bytes"]) / bw
            kind["ms_per_step_above_floor"] = (
                1e3 * (kind["gpu_s"] - kind["floor_s"]) / kind["steps"])
# --8<-- [end:step_floors]


def print_breakdown(backend: str, b: dict[str, Any]) -> None:
    """GPU seconds of the profiled run, by kind of step and by kernel category."""
    print(f"\n{backend}, a second run of the workload, GPU time by kind of step:")
    print(format_table([{"step": k, **v} for k, v in b["gpu_s_by_step_kind"].items()],
                       ["step", "steps", "gpu_s", "gpu_ms_per_step", "floor_s",
                        "ms_per_step_above_floor"]))
    print(f"kernel time by category (s, {b['kernel_s_total']:.3f} in all):")
    print(format_table([{"category": k, "s": v} for k, v in
                        sorted(b["kernel_s_by_category"].items(), key=lambda kv: -kv[1])],
                       ["category", "s"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the report that is also written to `--output`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    if ns.json_schema is not None:
        load_json_schema(ns.json_schema)  # a bad name or file stops the run here
        if "mini-vllm-json" not in ns.backends:  # right after the plain run it is compared to
            at = ns.backends.index("mini-vllm") + 1 if "mini-vllm" in ns.backends else 0
            ns.backends.insert(at, "mini-vllm-json")
    ns.device = resolve_device(ns.device)
    ns.dtype = resolve_dtype_name(ns.dtype, ns.device)
    standard = is_default_workload(ns.num_requests, ns.input_len_range,
                                   ns.max_tokens_range, ns.seed)

    with tempfile.TemporaryDirectory(prefix="mini-vllm-bench-") as tmp:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp),
                                                   write_weights=ns.write_weights)
        ns.load_format = ns.load_format or load_format
        shape = ModelShape.from_model_dir(model_dir)
        workload = make_workload(ns.num_requests, tuple(ns.input_len_range),
                                 tuple(ns.max_tokens_range), ns.seed, shape.vocab_size)
        if standard:
            check_default_workload(workload)

        if ns.worker:  # one backend, in this (child) process
            result = run_backend(ns.worker, str(model_dir), workload, ns)
            write_json(ns.worker_output, result)
            return result

        print(f"measuring copy bandwidth and matmul rate on {ns.device} ...", flush=True)
        copy = measure_copy_bandwidth(ns.device, ns.copy_bytes)
        matmul = measure_matmul_flops(ns.device, ns.dtype)
        allreduce = None
        if ns.tensor_parallel_size > 1 and ns.device.startswith("cuda"):
            from benchmarks.allreduce import measure_allreduce

            print(f"measuring NCCL all-reduce over {ns.tensor_parallel_size} GPUs ...",
                  flush=True)
            allreduce = measure_allreduce(ns.tensor_parallel_size)
        isolate = ns.isolate if ns.isolate is not None else ns.device.startswith("cuda")
        results: dict[str, dict[str, Any]] = {}
        for backend in ns.backends:
            reason = missing_backend(backend)
            if reason:
                print(f"{backend}: skipped ({reason})", flush=True)
                results[backend] = {"status": "skipped", "reason": reason}
                continue
            print(f"{backend}: running {workload.num_requests} requests ...", flush=True)
            if isolate:
                results[backend] = run_worker(Path(__file__).resolve(),
                                              _worker_argv(ns, argv, model_dir, backend),
                                              ns.timeout)
            else:
                results[backend] = run_backend(backend, str(model_dir), workload, ns)
            r = results[backend]
            print(f"{backend}: {r['status']}"
                  + (f", {r['output_tok_s']:,.1f} output tok/s" if r["status"] == "ok"
                     else f" ({r.get('error')})"), flush=True)

    floor = throughput_floor_for(workload, shape, ns, copy, matmul)
    if allreduce is not None:
        floor = tensor_parallel_floor(
            floor, shape, ns.tensor_parallel_size,
            workload.num_prompt_tokens + workload.num_output_tokens,
            workload.num_output_tokens, dtype_bytes(ns.dtype), allreduce["busbw_bytes_per_s"])
    report = {
        "benchmark": "throughput",
        "environment": environment(ns.device),
        "args": {k: v for k, v in vars(ns).items() if not k.startswith("worker")},
        "model": {"dir": str(ns.model) if ns.model else f"preset {ns.preset}",
                  "load_format": ns.load_format, "shape": shape.__dict__,
                  "num_params": shape.num_params},
        "workload": {**workload.summary(), "seed": ns.seed, "standard": standard,
                     "temperature": TEMPERATURE, "ignore_eos": True},
        "copy_bandwidth": copy,
        "matmul": matmul,
        "allreduce": allreduce,
        "floor": floor,
        "results": results,
    }
    report["ratios"] = summarize(results, floor)
    report["structured_output"] = mask_cost(results)
    add_step_floors(results, floor)
    write_json(ns.output, report)
    print(f"wrote {ns.output}")
    print_report(report)
    return report


def throughput_floor_for(workload: Workload, shape: ModelShape, ns: argparse.Namespace,
                         copy: dict[str, Any], matmul: dict[str, Any]) -> dict[str, Any]:
    """The floor of this run (KV cache and weights in the run's dtype)."""
    return throughput_floor(workload, shape, dtype_bytes(ns.dtype),
                            copy["bandwidth_bytes_per_s"], max_num_seqs=ns.max_num_seqs,
                            matmul_flops_per_s=matmul["flops_per_s"],
                            max_num_batched_tokens=ns.max_num_batched_tokens or 8192)


if __name__ == "__main__":
    main()
