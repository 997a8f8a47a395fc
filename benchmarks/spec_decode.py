"""Speculative decoding: decode speed against acceptance, n-gram on a copying workload.

Three measurements, each preset's in a process of its own, in one job:

1. **speedup against acceptance**: greedy decoding at batch 1, 8 and 32 with k = 1 .. 6
   proposals per step, from a proposer whose acceptance is set: at each position it
   proposes the target's own greedy token with probability `a`, else a wrong one.
   The target's greedy tokens come from a plain run of the same prompts, which is also
   the baseline. A random-weight model's greedy choices hang on margins a bf16 rounding
   can flip between two kernels, so the presets' dummy weights are rewired into a model
   whose greedy choice is certain (`rewire_to_permutation`): every layer's output
   projection is zero and the LM head maps each token to a fixed other one. Shapes,
   bytes and kernels stay the preset's (the LM head is untied, which changes no byte a
   decode step reads). The same runs check that speculation changed no token.
   At batch 32 a proposer that always misses also runs with the adaptive policy on:
   the bar is that it never falls below 0.95x of plain decoding.
2. **n-gram on a copying workload**: prompts that hold a document, then its first two
   tokens again; the rewired model continues the document from there (the benchmark
   generates it from the model's own map), so the n-gram proposer finds it in the
   prompt. Full copies, and copies of half the output (then the proposer misses and the
   policy stops it).
3. **a draft model** on the same rewired shapes (the largest preset as the target, a
   smaller preset as the draft, both mapping tokens alike: every proposal accepted):
   what the draft's forwards cost. With `--target-model` and `--draft-model` (trained
   checkpoints of one tokenizer) also the acceptance of a real pair on text; skipped
   without them.

On a GPU (random weights, bf16, about 5 minutes on an H100):

    python benchmarks/spec_decode.py --output benchmarks/results/spec_decode.json
    python benchmarks/spec_decode.py --plot-from benchmarks/results/spec_decode.json

On a CPU (a smoke run of the tiny model):

    python benchmarks/spec_decode.py --presets tiny --draft-preset tiny --device cpu \\
        --batches 1 2 --ks 1 2 --acceptance 0 1 --prompt-len 16 --output-len 8

Results: a table on stdout (last) and JSON in `--output` (default
`benchmarks/runs/spec_decode.json`, which git ignores).
"""

from __future__ import annotations

import argparse
import random
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
    REPO_ROOT,
    RUNS_DIR,
    cover_vocabulary,
    environment,
    error_text,
    format_table,
    resolve_device,
    run_worker,
    write_json,
)

IMG = REPO_ROOT / "chapters" / "img" / "spec_decode.png"
# The bar (see the chapter): at acceptance >= 0.7 with k = 4, batch-1 decode at least
# 2x plain decoding on the 8B shape; at batch 32 with a proposer that misses, at
# least 0.95x.
BAR_SPEEDUP, BAR_ACCEPTANCE, BAR_K, BAR_PRESET = 2.0, 0.7, 4, "qwen3-8b"
BAR_MISS = 0.95


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", default=["qwen3-0.6b", "qwen3-8b"],
                   help="random-weight presets to measure (each in its own process); "
                        "none: only the real pair")
    p.add_argument("--draft-preset", default="qwen3-0.6b",
                   help="the draft of section 3, for the last preset ('none': skip)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6],
                   help="proposals per step")
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.9, 1.0],
                   help="probabilities with which the proposer proposes the target's token")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--target-model", default=None,
                   help="a trained checkpoint: the target of a real pair (section 3)")
    p.add_argument("--draft-model", default=None,
                   help="a trained checkpoint of the same tokenizer: its draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker")
    p.add_argument("--output", default=str(RUNS_DIR / "spec_decode.json"))
    p.add_argument("--plot-from", default=None,
                   help="draw the chapter's figure from this JSON (no measurement)")
    p.add_argument("--plot-out", default=str(IMG), help="where --plot-from writes the PNG")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------------- the model


# --8<-- [start:rewire]
def rewire_to_permutation(model: Any, perm: Any) -> None:
    """Make `model`'s greedy next token `perm[last token]`, by a wide margin.

    Every layer's `o_proj` and `down_proj` become zero, so the residual stream
    stays the embedding of the last token; the (untied) LM head's row `i` becomes
    the embedding of `perm^-1[i]`, so the logit of `perm[x]` is the embedding of `x`
    against itself (about `hidden_size` times larger than any other product). The
    weights keep their shapes and places: every kernel reads and multiplies the same
    bytes as before (zeros are not skipped).
    """
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        if model.lm_head.weight.data_ptr() == embed.data_ptr():
            raise ValueError("rewire_to_permutation needs an untied LM head")
        model.lm_head.weight.copy_(embed[torch.argsort(perm.to(embed.device))])
# --8<-- [end:rewire]


def orbit(perm: list[int], start: int, n: int) -> list[int]:
    """`start, perm[start], perm[perm[start]], ...`: `n` tokens the rewired model writes."""
    out = [start]
    while len(out) < n:
        out.append(perm[out[-1]])
    return out


# --8<-- [start:oracle]
class OracleProposer:
    """Proposes the target's own greedy token with probability `acceptance`, else a wrong one.

    `reference` maps each prompt to the target's greedy output, from a plain run.
    Proposal `j` of a sequence with `m` outputs is the reference's output `m + j`
    (or that token + 1, a token the target never picks). Greedy verification accepts
    exactly the right ones, up to the first wrong one: each position is accepted
    with probability `acceptance`, independently, as the analysis assumes.
    """

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab_size: int,
                 acceptance: float, seed: int = 0) -> None:
        self.reference, self.vocab_size = reference, vocab_size
        self.acceptance = acceptance
        self.rng = random.Random(seed)

    def propose(self, batch: list[Any]) -> Any:
        from mini_vllm.spec_decode.proposer import Proposals

        out = []
        for b in batch:
            ref = self.reference[tuple(b.request.prompt_token_ids)]
            m = b.request.num_output_tokens
            tokens = ref[m : m + b.num_tokens]
            out.append([t if self.rng.random() < self.acceptance else (t + 1) % self.vocab_size
                        for t in tokens])
        return Proposals(out)
# --8<-- [end:oracle]


# ----------------------------------------------------------------------------- timing


def timed_run(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Greedy decoding of `prompts` to `output_len` tokens each, through the step loop.

    Decode tokens per second count only the tokens after the last sequence's first
    one (all prompts are prefilled together, so that is the end of the prefill).
    """
    from mini_vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    before = dict(engine.get_stats())
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    t_first, count_at_first = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(out.error)
            tokens[out.request_id].extend(out.outputs[0].token_ids)
        if t_first is None and all(tokens.values()):
            t_first, count_at_first = time.perf_counter(), sum(map(len, tokens.values()))
    t_end = time.perf_counter()
    after = engine.get_stats()
    total = sum(map(len, tokens.values()))
    result = {"decode_tokens": total - count_at_first, "decode_s": t_end - t_first,
              "decode_tok_s": (total - count_at_first) / (t_end - t_first),
              "outputs": [tokens[rid] for rid in ids]}
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens", "spec_decode_draft_time_s",
                "spec_decode_step_time_s"):
        if key in after:
            result[key.removeprefix("spec_decode_")] = after[key] - before.get(key, 0)
    if result.get("num_draft_tokens"):
        result["acceptance_rate"] = result["num_accepted_tokens"] / result["num_draft_tokens"]
        result["mean_acceptance_length"] = 1 + result["num_accepted_tokens"] / result["num_drafts"]
    if result.get("step_time_s"):
        result["draft_time_fraction"] = result["draft_time_s"] / result["step_time_s"]
    return result


def _drop_outputs(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "outputs"}


# ----------------------------------------------------------------------------- one preset


def make_engine(model_dir: Path, ns: argparse.Namespace, spec: dict[str, Any],
                max_len: int) -> Any:
    from mini_vllm import LLM

    return LLM(str(model_dir), device=ns.device, load_format=ns.load_format,
               max_model_len=max_len, max_num_seqs=max(ns.batches),
               max_num_batched_tokens=max(2048, max(ns.batches) * (ns.prompt_len + 16)),
               enable_prefix_caching=False, seed=ns.seed, speculative_config=spec).engine


def run_preset(preset: str, ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Sections 1 and 2 for one preset (and 3 when it is the last one)."""
    import torch

    from mini_vllm.checkpoint import make_model
    from mini_vllm.spec_decode.ngram_proposer import NgramProposer
    from mini_vllm.spec_decode.policy import SpeculationPolicy

    def checkpoint(name: str) -> Path:
        d = make_model(work / name, preset=name, seed=ns.seed, weights=name.startswith("tiny"),
                       overrides={"tie_word_embeddings": False})
        cover_vocabulary(d)
        return d

    model_dir = checkpoint(preset)
    ns.load_format = "auto" if preset.startswith("tiny") else "dummy"
    draft = ns.draft_preset if preset == ns.presets[-1] and ns.draft_preset != "none" else None
    spec: dict[str, Any] = {"num_speculative_tokens": max(max(ns.ks), 4), "adaptive": False}
    spec.update({"model": str(checkpoint(draft))} if draft else {"method": "ngram"})
    max_len = ns.prompt_len + 2 * ns.output_len + 16
    t0 = time.perf_counter()
    engine = make_engine(model_dir, ns, spec, max_len)
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(ns.seed)
    perm = torch.randperm(vocab, generator=gen)
    rewire_to_permutation(engine.model_runner.model, perm)
    draft_runner = getattr(engine.proposer, "runner", None)
    if draft_runner is not None:
        rewire_to_permutation(draft_runner.model, perm)  # the same map: every proposal right
    real_proposer, perm_list = engine.proposer, perm.tolist()
    result: dict[str, Any] = {"status": "ok", "preset": preset, "vocab_size": vocab,
                              "engine_build_s": time.perf_counter() - t0,
                              "sweep": {}, "miss_policy": {}, "ngram": {}, "draft": {}}
    print(f"{preset}: engine built in {result['engine_build_s']:.1f} s", flush=True)
    rng = random.Random(ns.seed)

    def plain(prompts: list[list[int]]) -> dict[str, Any]:
        engine.spec_policy = None  # no sequence speculates: the plain engine's steps
        return timed_run(engine, prompts, ns.output_len)

    def speculative(prompts: list[list[int]], proposer: Any, k: int,
                    adaptive: bool) -> dict[str, Any]:
        engine.proposer = proposer
        engine.spec_policy = SpeculationPolicy(k, adaptive)
        return timed_run(engine, prompts, ns.output_len)

    for batch in ns.batches:
        prompts = [[rng.randrange(vocab) for _ in range(ns.prompt_len)] for _ in range(batch)]
        plain(prompts)  # warm-up
        base = plain(prompts)
        reference = {tuple(p): o for p, o in zip(prompts, base["outputs"])}
        rows: dict[str, Any] = {"plain": _drop_outputs(base), "runs": []}
        identical = True
        for k in ns.ks:
            for a in ns.acceptance:
                r = speculative(prompts, OracleProposer(reference, vocab, a, ns.seed), k, False)
                identical &= r["outputs"] == base["outputs"]
                rows["runs"].append({"k": k, "acceptance": a,
                                     "speedup": r["decode_tok_s"] / base["decode_tok_s"],
                                     **_drop_outputs(r)})
            print(f"{preset} batch {batch} k {k}: " + ", ".join(
                f"a={x['acceptance']:g} {x['speedup']:.2f}x" for x in rows["runs"][-len(
                    ns.acceptance):]), flush=True)
        rows["identical_to_plain"] = identical
        result["sweep"][str(batch)] = rows
        # A proposer that always misses, with the adaptive policy: it must stop in time.
        miss = speculative(prompts, OracleProposer(reference, vocab, 0.0, ns.seed), BAR_K, True)
        result["miss_policy"][str(batch)] = {
            "k": BAR_K, "speedup": miss["decode_tok_s"] / base["decode_tok_s"],
            **_drop_outputs(miss)}

        # Section 2: a document in the prompt, continued by the model.
        for copy_frac in (1.0, 0.5):
            doc_len = int(copy_frac * ns.output_len) + 2
            docs = [orbit(perm_list, rng.randrange(vocab), doc_len) for _ in range(batch)]
            copy_prompts = [[rng.randrange(vocab) for _ in range(ns.prompt_len // 2)] + d
                            + [rng.randrange(vocab) for _ in range(16)] + d[:2] for d in docs]
            base_c = plain(copy_prompts)
            ngram = speculative(copy_prompts, NgramProposer(2, 4), BAR_K, True)
            result["ngram"][f"{batch}/{copy_frac:g}"] = {
                "batch": batch, "copied_fraction": copy_frac, "k": BAR_K,
                "speedup": ngram["decode_tok_s"] / base_c["decode_tok_s"],
                "identical_to_plain": ngram["outputs"] == base_c["outputs"],
                "plain": _drop_outputs(base_c), **_drop_outputs(ngram)}

        # Section 3: the draft model, every proposal accepted.
        if draft_runner is not None:
            for k in (2, 4):
                r = speculative(prompts, real_proposer, k, False)
                result["draft"][f"{batch}/{k}"] = {
                    "batch": batch, "k": k, "draft_preset": draft,
                    "speedup": r["decode_tok_s"] / base["decode_tok_s"],
                    "identical_to_plain": r["outputs"] == base["outputs"], **_drop_outputs(r)}
    return result


# Questions for a real pair: the embedded default model's world (its people, sums,
# stories, a greeting) and one question outside it, which it politely refuses.
REAL_PAIR_QUESTIONS = [
    "Tell me a story about Mia's cat.", "Where does Leo live?", "What is 7 plus 5?",
    "What is Ava's job?", "Hello!", "Tell me a story about a fox.", "What is 15 - 6?",
    "What is the capital of France?",
]


def run_real_pair(ns: argparse.Namespace) -> dict[str, Any]:
    """Section 3 on trained checkpoints: acceptance and speed on text, batch 1."""
    from mini_vllm import LLM, SamplingParams

    engine = LLM(ns.target_model, device=ns.device, speculative_config={
        "model": ns.draft_model, "num_speculative_tokens": 4, "adaptive": False}).engine
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True))
               for q in REAL_PAIR_QUESTIONS]
    proposer, policy = engine.proposer, engine.spec_policy

    def run(params: SamplingParams, k: int | None) -> tuple[list[list[int]], dict[str, Any]]:
        """The questions one at a time, plainly (k None) or with k proposals a step."""
        engine.spec_policy = None if k is None else policy
        if k is not None:
            policy.num_speculative_tokens = k
        before = engine.get_stats()
        t0 = time.perf_counter()
        texts: list[list[int]] = []
        for i, p in enumerate(prompts):
            engine.add_request(f"real-{params.temperature}-{k}-{i}", p, params)
            texts.append([])
            while engine.has_unfinished_requests():
                for o in engine.step():
                    texts[-1] += o.outputs[0].token_ids
        elapsed = time.perf_counter() - t0
        after = engine.get_stats()
        delta = {key: after[key] - before[key] for key in (
            "num_steps", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_draft_time_s", "spec_decode_step_time_s")}
        n = sum(map(len, texts))
        drafted = delta["spec_decode_num_draft_tokens"]
        return texts, {
            "temperature": params.temperature, "k": k, "speculative": k is not None,
            "tok_s": n / elapsed, "num_tokens": n,
            # one request at a time: an engine step is one target forward
            "num_target_forwards": delta["num_steps"], "num_draft_tokens": drafted,
            "acceptance_rate": (delta["spec_decode_num_accepted_tokens"] / drafted
                                if drafted else None),
            "draft_time_fraction": (delta["spec_decode_draft_time_s"]
                                    / delta["spec_decode_step_time_s"]
                                    if delta["spec_decode_step_time_s"] else None)}

    out: dict[str, Any] = {"status": "ok", "target": Path(ns.target_model).name,
                           "draft": Path(ns.draft_model).name,
                           "questions": REAL_PAIR_QUESTIONS, "runs": []}
    for temperature in (0.0, 0.7):
        params = SamplingParams(temperature=temperature, max_tokens=ns.output_len, seed=ns.seed)
        plain, row = run(params, None)
        out["runs"].append({**row, "identical_to_plain": None})
        for k in (2, 4):
            texts, row = run(params, k)
            out["runs"].append({**row, "identical_to_plain": texts == plain})
    engine.proposer, engine.spec_policy = proposer, policy
    return out


# ----------------------------------------------------------------------------- report


def bar_checks(results: dict[str, Any], ns: argparse.Namespace) -> list[dict[str, Any]]:
    """The bar's two checks, where the runs they need were made."""
    checks = []
    r = results.get(BAR_PRESET, {})
    if r.get("status") == "ok" and "1" in r["sweep"]:
        runs = [x for x in r["sweep"]["1"]["runs"]
                if x["k"] == BAR_K and abs(x["acceptance"] - BAR_ACCEPTANCE) < 1e-9]
        if runs:
            checks.append({"check": f"{BAR_PRESET} batch 1, k {BAR_K}, acceptance "
                                    f"{BAR_ACCEPTANCE}: speedup >= {BAR_SPEEDUP}",
                           "value": runs[0]["speedup"], "pass": runs[0]["speedup"] >= BAR_SPEEDUP})
    for preset, r in results.items():
        if r.get("status") == "ok" and str(max(ns.batches)) in r["miss_policy"]:
            v = r["miss_policy"][str(max(ns.batches))]["speedup"]
            checks.append({"check": f"{preset} batch {max(ns.batches)}, a proposer that "
                                    f"misses (adaptive): >= {BAR_MISS}x",
                           "value": v, "pass": v >= BAR_MISS})
    return checks


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for preset, r in results.items():
        if r.get("status") != "ok":
            rows.append({"preset": preset, "what": r.get("status"),
                         "note": r.get("error") or r.get("reason")})
            continue
        for batch, s in r["sweep"].items():
            rows.append({"preset": preset, "batch": int(batch), "what": "plain",
                         "tok/s": s["plain"]["decode_tok_s"]})
            for a in sorted({x["acceptance"] for x in s["runs"]}):
                top = max((x for x in s["runs"] if x["acceptance"] == a),
                          key=lambda x: x["speedup"])
                rows.append({"preset": preset, "batch": int(batch),
                             "what": f"a={a:g} best k={top['k']}", "tok/s": top["decode_tok_s"],
                             "speedup": top["speedup"],
                             "accept rate": top.get("acceptance_rate")})
            m = r["miss_policy"].get(batch)
            if m:
                rows.append({"preset": preset, "batch": int(batch), "what": "miss, adaptive",
                             "tok/s": m["decode_tok_s"], "speedup": m["speedup"]})
        for x in r["ngram"].values():
            rows.append({"preset": preset, "batch": x["batch"],
                         "what": f"n-gram, {x['copied_fraction']:.0%} copied",
                         "tok/s": x["decode_tok_s"], "speedup": x["speedup"],
                         "accept rate": x.get("acceptance_rate")})
        for x in r["draft"].values():
            rows.append({"preset": preset, "batch": x["batch"],
                         "what": f"draft {x['draft_preset']} k={x['k']}",
                         "tok/s": x["decode_tok_s"], "speedup": x["speedup"],
                         "accept rate": x.get("acceptance_rate"),
                         "draft share": x.get("draft_time_fraction")})
    return rows


# --8<-- [start:plot]
def plot(report: dict[str, Any], out: Path) -> None:
    """Speedup against acceptance, one line per k, one panel per (preset, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = [p for p, r in report["results"].items() if r.get("status") == "ok"]
    batches = sorted({int(b) for p in presets for b in report["results"][p]["sweep"]})
    fig, axes = plt.subplots(len(presets), len(batches), figsize=(3.2 * len(batches),
                             2.8 * len(presets)), squeeze=False, sharex=True)
    cmap = plt.get_cmap("viridis")
    for row, preset in enumerate(presets):
        for col, batch in enumerate(batches):
            ax = axes[row][col]
            s = report["results"][preset]["sweep"].get(str(batch))
            if s is None:
                ax.set_visible(False)
                continue
            ks = sorted({x["k"] for x in s["runs"]})
            for i, k in enumerate(ks):
                pts = sorted((x["acceptance"], x["speedup"]) for x in s["runs"] if x["k"] == k)
                ax.plot(*zip(*pts), marker="o", markersize=3, color=cmap(i / max(1, len(ks) - 1)),
                        label=f"k={k}")
            ax.axhline(1.0, color="#9e9e9e", linewidth=1, linestyle=":")
            if preset == BAR_PRESET and batch == 1:
                ax.plot([BAR_ACCEPTANCE], [BAR_SPEEDUP], marker="*", color="#2e7d32",
                        markersize=10, linestyle="none", label="bar")
            ax.set_title(f"{preset}, batch {batch}", fontsize=9)
            if col == 0:
                ax.set_ylabel("speedup over plain decode")
            if row == len(presets) - 1:
                ax.set_xlabel("acceptance per proposal")
            ax.tick_params(labelsize=8)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    gpu = report["environment"].get("gpu", report["environment"].get("device"))
    fig.suptitle(f"Greedy decoding with k proposals per step, {gpu}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
# --8<-- [end:plot]


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    if ns.plot_from:
        import json

        plot(json.loads(Path(ns.plot_from).read_text()), Path(ns.plot_out))
        print(f"wrote {ns.plot_out}")
        return None
    ns.device = resolve_device(ns.device)
    if min(ns.ks) < 1 or max(ns.ks) > 16 or min(ns.batches) < 1 or ns.output_len < 4:
        raise SystemExit("--ks must be in 1..16, --batches positive, --output-len at least 4")
    if ns.worker:
        try:
            with tempfile.TemporaryDirectory(prefix="mini-vllm-spec-") as tmp:
                result = (run_real_pair(ns) if ns.worker == "real-pair"
                          else run_preset(ns.worker, ns, Path(tmp)))
        except Exception as e:  # noqa: BLE001 - a failing preset is a result
            traceback.print_exc()
            result = {"status": "error", "error": error_text(e)}
        write_json(ns.worker_output, result)
        return result

    started = time.perf_counter()
    results: dict[str, Any] = {}
    for preset in ns.presets:
        print(f"{preset}: batches {ns.batches}, k {ns.ks}, acceptance {ns.acceptance} ...",
              flush=True)
        results[preset] = run_worker(Path(__file__).resolve(),
                                     [*argv, "--worker", preset], ns.timeout)
    if ns.target_model and ns.draft_model:
        real = run_worker(Path(__file__).resolve(), [*argv, "--worker", "real-pair"],
                          ns.timeout)
    else:
        real = {"status": "skipped",
                "reason": "no trained draft/target pair was given (--target-model, "
                          "--draft-model): random weights have no real acceptance to measure"}
    report = {
        "benchmark": "spec_decode",
        "environment": environment(ns.device),
        "args": {k: v for k, v in vars(ns).items() if not k.startswith(("worker", "plot"))},
        "acceptance_means": "the probability with which the proposer proposes the target's "
                            "own greedy token, at each position (independently)",
        "results": results,
        "real_pair": real,
        "wall_s": time.perf_counter() - started,
    }
    report["bar"] = bar_checks(results, ns)
    write_json(ns.output, report)
    print(f"wrote {ns.output} ({report['wall_s']:.0f} s)")
    if real.get("status") != "ok":
        print(f"real pair: {real.get('status')}: {real.get('reason') or real.get('error')}")
    for c in report["bar"]:
        print(f"bar: {c['check']}: {c['value']:.3f} {'PASS' if c['pass'] else 'FAIL'}")
    print(format_table(summary_rows(results), ["preset", "batch", "what", "tok/s", "speedup",
                                               "accept rate", "draft share", "note"]))
    return report


if __name__ == "__main__":
    main()
