"""What a structured output costs: compiling its grammar, filling and applying its mask.

Three measurements:

1. compile: cold compile time of each kind of spec (JSON schemas of growing
   size, a regex, a choice, a forced tool call), each on a fresh manager.
2. fill: host time per constrained row per step to fill its bitmask row
   (`StructuredOutputGrammar.fill_bitmask`), along paths the grammar allows,
   drawn with random logits; and the whole batch's bitmask filled at once
   (`fill_bitmasks`, the engine's step: xgrammar's threads for a large batch)
   with every row somewhere along such a path.
3. apply: the sampler's mask stage on `[batch, vocab]` float32 logits with
   `rows` constrained rows: our torch `apply_token_bitmask` (what the
   reference sampler runs) and xgrammar's `apply_token_bitmask_inplace`
   kernel (on a copy); on a GPU, each call is queued behind a spin kernel and
   timed with CUDA events, so the figure is GPU time, as in an engine step.

    python benchmarks/structured_output.py                       # CPU, or the GPU if any
    python benchmarks/structured_output.py --vocab-size 151936   # apply at Qwen3's width

The fill cost grows with the tokenizer's vocabulary: the tokenizer the project
ships has 2,331 tokens, Qwen3's 151,643, so `fill` on it is a lower bound
for Qwen3 (`--model DIR` measures a real checkpoint's tokenizer). Both fill
and apply write rows as wide as the logits (`--vocab-size`: the bitmask of a
Qwen3-shaped model with this tokenizer).

Results: tables on stdout, JSON in `--output`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    RESULTS_DIR,
    environment,
    format_table,
    resolve_device,
    time_calls,
    write_json,
)
from mini_vllm.checkpoint import make_model
from mini_vllm.structured_output import (
    StructuredOutputManager,
    StructuredOutputsParams,
    allocate_token_bitmask,
    apply_token_bitmask,
    bitmask_width,
    fill_bitmasks,
)
from mini_vllm.tokenizer import Tokenizer
from mini_vllm.tool_parsers import tool_choice_structured_outputs


def object_schema(num_properties: int) -> dict:
    """An object with `num_properties` required fields of mixed, bounded types."""
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0,
                                                   "maximum": 1000},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]},
             {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)}


def specs() -> dict[str, StructuredOutputsParams]:
    rng = random.Random(0)
    tools = [{"type": "function", "function": {"name": f"tool_{i}",
                                               "parameters": object_schema(4)}}
             for i in range(8)]
    return {
        "json 4 fields": StructuredOutputsParams(json=object_schema(4)),
        "json 32 fields": StructuredOutputsParams(json=object_schema(32)),
        "json 256 fields": StructuredOutputsParams(json=object_schema(256)),
        "json_object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} \d{1,4}(, [a-z]+)*"),
        "choice of 1,000": StructuredOutputsParams(choice=[
            "".join(rng.choice("abcdefghij") for _ in range(8)) for _ in range(1000)]),
        "tool_choice required, 8 tools": tool_choice_structured_outputs(tools, "required"),
    }


def measure_compile(tokenizer: Tokenizer, vocab_size: int) -> list[dict]:
    rows = []
    for name, params in specs().items():
        manager = StructuredOutputManager(tokenizer, vocab_size, compile_timeout_s=600)
        t0 = time.perf_counter()
        manager.compile(params)
        rows.append({"spec": name, "compile_ms": (time.perf_counter() - t0) * 1e3})
        manager.shutdown()
    return rows


def measure_fill(tokenizer: Tokenizer, vocab_size: int, paths: int, max_steps: int) -> list[dict]:
    manager = StructuredOutputManager(tokenizer, vocab_size, compile_timeout_s=600)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, params in specs().items():
        compiled = manager.compile(params)
        times, tokens = [], 0
        bitmask = allocate_token_bitmask(1, vocab_size)
        for _ in range(paths):
            grammar = manager.new_grammar(compiled)
            for _ in range(max_steps):
                if grammar.is_terminated():
                    break
                t0 = time.perf_counter()
                grammar.fill_bitmask(bitmask, 0)
                times.append(time.perf_counter() - t0)
                logits = apply_token_bitmask(torch.randn(1, vocab_size, generator=gen),
                                             torch.zeros(1, dtype=torch.int64), bitmask)
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
                if not grammar.accept_token(token):
                    raise RuntimeError(f"{name}: the grammar refused the token it allowed")
                tokens += 1
        rows.append({"spec": name, "steps": tokens, "fill_us_mean": statistics.mean(times) * 1e6,
                     "fill_us_p99": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6})
    manager.shutdown()
    return rows


def measure_fill_batch(tokenizer: Tokenizer, vocab_size: int, batch: int,
                       iters: int) -> list[dict]:
    """One step's bitmask for `batch` constrained rows, each at its own point of a
    path the grammar allows (as in a running batch): `fill_bitmasks`' time."""
    manager = StructuredOutputManager(tokenizer, vocab_size, compile_timeout_s=600)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name, params in specs().items():
        compiled = manager.compile(params)
        grammars = []
        for i in range(batch):
            grammar = manager.new_grammar(compiled)
            scratch = allocate_token_bitmask(1, vocab_size)
            for _ in range(i % 40):  # rows spread over the first 40 tokens of their paths
                if grammar.is_terminated():
                    break
                grammar.fill_bitmask(scratch, 0)
                logits = apply_token_bitmask(torch.randn(1, vocab_size, generator=gen),
                                             torch.zeros(1, dtype=torch.int64), scratch)
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
                if not grammar.accept_token(token):
                    raise RuntimeError(f"{name}: the grammar refused the token it allowed")
            if not grammar.is_terminated():
                grammars.append(grammar)
        bitmask = torch.empty((len(grammars), bitmask_width(vocab_size)), dtype=torch.int32)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fill_bitmasks(grammars, bitmask)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        rows.append({"spec": name, "rows": len(grammars), "fill_ms_per_step": median * 1e3,
                     "fill_us_per_row": median * 1e6 / max(1, len(grammars))})
    manager.shutdown()
    return rows


def measure_apply(device: str, vocab_size: int, batch: int, iters: int) -> list[dict]:
    import xgrammar as xgr

    rows = []
    dev = torch.device(device)
    logits = torch.randn(batch, vocab_size, device=dev)
    for constrained in sorted({1, 8, 64, batch}):
        if constrained > batch:
            continue
        index = torch.arange(0, batch, batch // constrained, device=dev)[:constrained]
        indices = index.tolist()
        bitmask = torch.randint(-(2**31), 2**31 - 1, (constrained, (vocab_size + 31) // 32),
                                dtype=torch.int64).to(torch.int32).to(dev)
        full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32, device=dev)
        full[index] = bitmask
        work = logits.clone()
        queued = dev.type == "cuda"
        def ours_call(index=index, bitmask=bitmask) -> None:
            apply_token_bitmask(logits, index, bitmask)

        def theirs_call(work=work, full=full, indices=indices) -> None:
            xgr.apply_token_bitmask_inplace(work, full, vocab_size=vocab_size, indices=indices)

        ours = time_calls(ours_call, dev, iters=iters, warmup=5, queued=queued)
        theirs = time_calls(theirs_call, dev, iters=iters, warmup=5, queued=queued)
        rows.append({"batch": batch, "constrained_rows": constrained, "vocab_size": vocab_size,
                     "torch_us": statistics.median(ours) * 1e6,
                     "xgrammar_us": statistics.median(theirs) * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory whose tokenizer to use (default: the "
                             "tiny preset's, written to a temporary directory)")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="logits width, of the bitmask rows filled and applied (default: "
                             "the model's)")
    parser.add_argument("--batch", type=int, default=256,
                        help="rows of a step (fill_batch) and of logits (apply)")
    parser.add_argument("--paths", type=int, default=8, help="generated paths per spec for fill")
    parser.add_argument("--max-steps", type=int, default=200, help="most tokens per path")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per apply figure")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON file (default: benchmarks/results/structured_output/"
                             "<device>.json)")
    args = parser.parse_args()

    device = resolve_device(args.device)
    model_dir = Path(args.model) if args.model else make_model(
        Path(tempfile.mkdtemp()), preset="tiny", seed=0)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    model_vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    vocab = args.vocab_size or model_vocab
    compile_rows = measure_compile(tokenizer, vocab)
    print(format_table(compile_rows, ["spec", "compile_ms"]), end="\n\n")
    fill_rows = measure_fill(tokenizer, vocab, args.paths, args.max_steps)
    print(format_table(fill_rows, ["spec", "steps", "fill_us_mean", "fill_us_p99"]), end="\n\n")
    batch_rows = measure_fill_batch(tokenizer, vocab, args.batch, args.iters)
    print(format_table(batch_rows, ["spec", "rows", "fill_ms_per_step", "fill_us_per_row"]),
          end="\n\n")
    apply_rows = measure_apply(device, vocab, args.batch, args.iters)
    print(format_table(apply_rows, ["batch", "constrained_rows", "vocab_size", "torch_us",
                                    "xgrammar_us"]))

    out = args.output or RESULTS_DIR / "structured_output" / f"{device.split(':')[0]}.json"
    env = environment(device)
    where = env.get("gpu") or f"a CPU of {env['cpu_count']} cores ({env['cpu']})"
    write_json(out, {"environment": env, "device": where,
                     "tokenizer_vocab_size": tokenizer.vocab_size, "vocab_size": vocab,
                     "compile": compile_rows, "fill": fill_rows, "fill_batch": batch_rows,
                     "apply": apply_rows})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
