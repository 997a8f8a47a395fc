"""Generate the book's measured figures from the committed benchmark JSON.

Every measured table in `README.md` and `chapters/*.md`, and the measured values the
prose quotes, sit between two markers and are written by this script from the JSON
files in `benchmarks/results/`, never by hand:

    <!-- figure:NAME -->            a block: a markdown table and the line that says
    ...                             which command measured it, on which GPU, into
    <!-- /figure -->                which file

    ... reads <!-- figure:NAME ARG ... -->36,920<!-- /figure --> tok/s ...   a value

NAME is one of the figures defined below; a value's ARGs pick what it quotes (a
backend, a prompt length, a shape). Rewrite every marked block from the JSON:

    python scripts/figures.py

Check that every block is what the JSON gives (exit status 1 and the stale blocks
listed otherwise; `tests/python/test_phase9.py` runs this):

    python scripts/figures.py --check

List the figures and the JSON each reads:

    python scripts/figures.py --list

A new measurement lands in the book by writing it to the file a figure reads
(`python benchmarks/throughput.py --breakdown --output benchmarks/results/throughput.json`)
and running this script. Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# The files whose markers this script fills, as globs relative to the repository root.
TARGETS = ("README.md", "chapters/*.md")

# <!-- figure:NAME ARG ARG --> body <!-- /figure -->; the body is everything between the
# two markers, so a block keeps its blank lines and a value stays inside its sentence.
MARKER = re.compile(
    r"<!-- figure:(?P<name>[A-Za-z0-9_.-]+)(?P<args>(?: [^\s>]+)*) -->"
    r"(?P<body>.*?)<!-- /figure -->",
    re.DOTALL,
)


class FigureError(ValueError):
    """A marker that names no figure, gives it bad arguments, or a JSON file it lacks."""


class NotMeasured(str):
    """What a block says while the JSON it reads is not in benchmarks/results yet
    (written without a caption: nothing was measured)."""


# ----------------------------------------------------------------------------- plumbing


class Results:
    """Reads the JSON files under one results folder and remembers which were read,
    so that a block can name its sources."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.read: list[str] = []

    def __call__(self, rel: str) -> Any:
        path = self.root / rel
        if not path.is_file():
            raise FigureError(f"benchmarks/results/{rel} does not exist")
        if rel not in self.read:
            self.read.append(rel)
        return json.loads(path.read_text())

    def devices(self) -> list[str]:
        """The GPUs the files read so far were measured on, in order."""
        seen: list[str] = []
        for rel in self.read:
            d = json.loads((self.root / rel).read_text())
            env = d.get("environment", {})
            gpu = env.get("gpu") or d.get("device")
            if not gpu and env.get("device") == "cpu":
                gpu = f"a CPU of {env['cpu_count']} cores" if env.get("cpu_count") else "a CPU"
            if gpu and gpu not in seen:
                seen.append(gpu)
        return seen


@dataclass(frozen=True)
class Figure:
    """One named figure: a markdown block (with a line naming its command and files)
    or an inline value."""

    name: str
    render: Callable[..., str]
    inline: bool
    command: str | None
    doc: str


FIGURES: dict[str, Figure] = {}


def block(name: str, command: str | None) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Register `render(results, *args) -> markdown` as the block figure `name`;
    `command` is how its JSON was measured, quoted under the block (None: the table
    names each row's command itself)."""
    def register(fn: Callable[..., str]) -> Callable[..., str]:
        if name in FIGURES:
            raise ValueError(f"figure {name!r} defined twice")
        FIGURES[name] = Figure(name, fn, False, command, (fn.__doc__ or "").strip())
        return fn
    return register


def value(name: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Register `render(results, *args) -> text` as the inline figure `name`."""
    def register(fn: Callable[..., str]) -> Callable[..., str]:
        if name in FIGURES:
            raise ValueError(f"figure {name!r} defined twice")
        FIGURES[name] = Figure(name, fn, True, None, (fn.__doc__ or "").strip())
        return fn
    return register


def render(name: str, args: Sequence[str] = (), results_dir: Path = RESULTS_DIR) -> str:
    """The text that belongs between the markers of figure `name` called with `args`."""
    fig = FIGURES.get(name)
    if fig is None:
        raise FigureError(f"no figure named {name!r} (python scripts/figures.py --list)")
    res = Results(results_dir)
    try:
        body = fig.render(res, *args)
    except (KeyError, IndexError, TypeError, StopIteration) as e:
        raise FigureError(f"figure {name} {' '.join(args)}: {type(e).__name__}: {e}") from e
    if fig.inline:
        return body
    if isinstance(body, NotMeasured):
        return f"\n\n{body.strip()}\n\n"
    files = ", ".join(f"`benchmarks/results/{rel}`" for rel in res.read)
    on = " and ".join(res.devices()) or "the machine named in the JSON"
    how = f" with `{fig.command}`" if fig.command else " with the command in each row"
    caption = f"*Measured on {on}{how}; generated from {files}.*"
    return f"\n\n{body.strip()}\n\n{caption}\n\n"


def fill(text: str, results_dir: Path = RESULTS_DIR, where: str = "") -> tuple[str, list[str]]:
    """`text` with every marker's body rendered again, and the names of the blocks
    whose body changed."""
    changed: list[str] = []

    def one(m: re.Match[str]) -> str:
        args = m.group("args").split()
        try:
            body = render(m.group("name"), args, results_dir)
        except FigureError as e:
            line = text.count("\n", 0, m.start()) + 1
            raise FigureError(f"{where}:{line}: {e}") from e
        if body != m.group("body"):
            changed.append(" ".join([m.group("name"), *args]))
        return m.group(0)[: m.start("body") - m.start()] + body + "<!-- /figure -->"

    return MARKER.sub(one, text), changed


def target_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files that may hold markers."""
    return sorted({p for pattern in TARGETS for p in root.glob(pattern)})


def update(root: Path = REPO_ROOT, results_dir: Path = RESULTS_DIR,
           write: bool = True) -> dict[str, list[str]]:
    """Render every marker of every target file; write the files back if `write`.
    Returns, per file, the blocks that were out of date."""
    stale: dict[str, list[str]] = {}
    for path in target_files(root):
        text = path.read_text()
        new, changed = fill(text, results_dir, str(path.relative_to(root)))
        if changed:
            stale[str(path.relative_to(root))] = changed
            if write:
                path.write_text(new)
    return stale


def used_figures(root: Path = REPO_ROOT) -> set[str]:
    """The names of the figures some target file marks."""
    return {m.group("name") for p in target_files(root) for m in MARKER.finditer(p.read_text())}


# ----------------------------------------------------------------------------- formatting


def n0(x: float) -> str:
    """28525.4 -> '28,525'."""
    return f"{x:,.0f}"


def f1(x: float) -> str:
    return f"{x:,.1f}"


def f2(x: float) -> str:
    return f"{x:,.2f}"


def f3(x: float) -> str:
    return f"{x:,.3f}"


def pct(frac: float, digits: int = 1) -> str:
    """0.7726 -> '77.3 %'."""
    return f"{100 * frac:.{digits}f} %"


def times(x: float, digits: int = 1) -> str:
    """45.75 -> '45.7×'."""
    return f"{x:.{digits}f}×"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bold(s: str) -> str:
    return f"**{s}**"


def gpu_name(d: dict[str, Any]) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    gpu = d.get("environment", {}).get("gpu") or d.get("device") or "?"
    return gpu.replace("NVIDIA ", "").split()[0]


# ----------------------------------------------------------------------------- figures
# Each figure reads its JSON through `res("path/under/benchmarks/results.json")`.

# --- decode attention (chapters 8 and 13)

KERNELS_CMD = "python benchmarks/kernels.py --out benchmarks/results/kernels_h200.json"


def shape_key(s: str) -> tuple[int, int, int]:
    """'64x1024' -> (16, 64, 1024); '32/8:64x1024' -> (32, 64, 1024): query heads,
    batch, context."""
    heads, _, bc = s.rpartition(":")
    b, c = bc.split("x")
    return (int(heads.split("/")[0]) if heads else 16, int(b), int(c))


def find_row(rows: list[dict], shape: str, **match: Any) -> dict:
    """The row of `rows` at `shape` ('64x1024' or '32/8:64x1024') whose other fields
    equal `match`."""
    q, b, c = shape_key(shape)
    for r in rows:
        if (r.get("num_q_heads", 16), r["batch"], r["context"]) == (q, b, c) and all(
                r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row at {shape} {match or ''}")


def us_cell(p: dict) -> str:
    """'64.4 µs · 97 %': time per call and bytes over the copy bandwidth."""
    return f"{p['us']:.1f} µs · {100 * p['frac_copy']:.0f} %"


def bar_rows(rows: list[dict], heads: int = 16) -> list[dict]:
    """The rows of the bar: batch >= 64, context >= 1,024, at `heads` query heads."""
    return [r for r in rows if r.get("num_q_heads", 16) == heads and r["batch"] >= 64
            and r["context"] >= 1024]


@value("copy-bw")
def copy_bw(res: Results, file: str) -> str:
    """The copy bandwidth a kernels run measured: '4.29 TB/s'."""
    return f"{res(file)['copy_bandwidth_gbps'] / 1e3:.2f} TB/s"


@block("decode-problem", KERNELS_CMD)
def decode_problem(res: Results) -> str:
    """The paged path in plain PyTorch against SDPA on contiguous K/V."""
    rows = res("kernels_h200.json")["main"]
    shapes = ("1x1024", "64x1024", "64x4096", "256x1024", "256x4096")
    return table(["batch × context", "gather + SDPA (paged)", "SDPA, contiguous (not paged)"],
                 [[s.replace("x", " × "), us_cell(find_row(rows, s)["paths"]["gather_sdpa"]),
                   us_cell(find_row(rows, s)["paths"]["sdpa_contig"])] for s in shapes])


LADDER_SHAPES = ("1x1024", "8x8192", "64x1024", "64x4096", "256x2048")


@block("decode-ladder", KERNELS_CMD + " --tables versions")
def decode_ladder(res: Results) -> str:
    """Versions 1 to 6 side by side at five shapes."""
    rows = res("kernels_h200.json")["versions"]
    versions = sorted({r["version"] for r in rows})
    return table(["version", *(s.replace("x", " × ") for s in LADDER_SHAPES)],
                 [[f"v{v}", *(us_cell(find_row(rows, s, version=v)["paths"]["ours"])
                              for s in LADDER_SHAPES)] for v in versions])


@value("ladder")
def ladder(res: Results, version: str, shape: str, field: str) -> str:
    """One cell of the ladder: `us` ('85.3 µs') or `frac` ('61 %')."""
    p = find_row(res("kernels_h200.json")["versions"], shape, version=int(version))["paths"]
    return f"{p['ours']['us']:.1f} µs" if field == "us" else f"{100 * p['ours']['frac_copy']:.0f} %"


@block("decode-ncu-v5-v6", KERNELS_CMD + " --profile 64,4096,16 --version 5 (and 6, and "
       "--profile-path sdpa_contig) under ncu")
def decode_ncu_v5_v6(res: Results) -> str:
    """Nsight Compute's view of v5, v6 and SDPA at 64 x 4096."""
    ncu = res("kernels_h200.json")["ncu_64x4096"]
    names = {"v5": "v5", "v6": "v6", "sdpa_contig": "SDPA (cuDNN flash, tensor cores)"}
    return table(["kernel", "time", "DRAM, % of peak", "instructions", "warps per SM",
                  "registers", "no warp ready"],
                 [[names[k], f"{v['us']:.1f} µs", f"{v['dram_pct_of_peak']:.1f} %",
                   f"{v['instructions'] / 1e6:.1f} M", f"{v['warps_per_sm']:.1f}",
                   str(v["registers"]), f"{v['no_eligible_pct']:.0f} %"]
                  for k, v in ncu.items() if k in names])


@block("decode-v7", "python benchmarks/kernels.py --tables v7 "
       "--out benchmarks/results/kernels_v7_h200.json")
def decode_v7(res: Results) -> str:
    """v7 as the wrapper picks it, against v5 and SDPA on contiguous K/V."""
    rows = res("kernels_v7_h200.json")["v7"]
    out = []
    for r in rows:
        us = {k: v["us"] for k, v in r["paths"].items()}
        out.append([f"{r['num_q_heads']}/{r['num_kv_heads']}",
                     f"{r['batch']} × {r['context']}", f1(us["ours_v5"]), f1(us["ours_v7"]),
                     f1(us["sdpa_contig"]), f3(us["ours_v7"] / us["ours_v5"]),
                     f3(us["ours_v7"] / us["sdpa_contig"])])
    return table(["heads", "batch × context", "v5 (µs)", "v7 (µs)", "SDPA, contiguous (µs)",
                  "v7 / v5", "v7 / SDPA"], out)


@value("v7-vs-sdpa")
def v7_vs_sdpa(res: Results, file: str = "kernels_v7_h200.json", table_: str = "v7",
               path: str = "ours_v7") -> str:
    """The range of v7's time over SDPA's at the bar's shapes: '0.975–1.022×'."""
    rows = bar_rows(res(file)[table_])
    ratios = [r["paths"][path]["us"] / r["paths"]["sdpa_contig"]["us"] for r in rows]
    return f"{min(ratios):.3f}–{max(ratios):.3f}×"


@value("v7-8b-frac")
def v7_8b_frac(res: Results) -> str:
    """v7's share of the copy bandwidth at 32/8 heads, batch >= 16: '92–102 %'."""
    rows = [r for r in res("kernels_v7_h200.json")["v7"]
            if r["num_q_heads"] == 32 and r["batch"] >= 16]
    fr = [100 * r["paths"]["ours_v7"]["frac_copy"] for r in rows]
    return f"{min(fr):.0f}–{max(fr):.0f} %"


@block("decode-partitions", KERNELS_CMD + " --tables tuning")
def decode_partitions(res: Results) -> str:
    """v5 at fixed partition lengths (the sweep behind the partition rule)."""
    rows = [r for r in res("kernels_h200.json")["tuning"]
            if "partition_size" in r and r.get("unroll") == 4]
    sizes = sorted({r["partition_size"] for r in rows})
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    out = []
    for b, c in shapes:
        us = {r["partition_size"]: r["paths"]["ours"]["us"] for r in rows
              if (r["batch"], r["context"]) == (b, c)}
        best = min(us, key=us.get)
        out.append([f"{b} × {c}", *((bold if p == best else str)(f1(us[p])) for p in sizes)])
    return table(["batch × context", *(f"{p:,}" for p in sizes)], out)


@block("decode-against-pytorch", KERNELS_CMD)
def decode_against_pytorch(res: Results) -> str:
    """v5 and v6 against PyTorch's paths at the shapes of the bar and a few small ones."""
    d = res("kernels_h200.json")
    names = {"ours": "ours (v5)", "ours_v6": "v6", "gather_sdpa": "gather + SDPA",
             "sdpa_contig": "SDPA, contiguous", "flex_contig": "Flex, contiguous"}
    keep = {(1, 128), (1, 1024), (1, 8192), (8, 1024), (8, 8192), (32, 1024), (64, 128)}
    out = []
    for r in d["main"]:
        if (r["batch"], r["context"]) in keep or (r["batch"] >= 64 and r["context"] >= 1024):
            out.append([f"{r['batch']} × {r['context']}",
                        *(us_cell(r["paths"][k]) if k in r["paths"] else "–" for k in names)])
    return table(["batch × context", *names.values()], out)


# --- the engine on the GPU (chapter 9, the README)

THROUGHPUT_CMD = ("python benchmarks/throughput.py --breakdown "
                  "--output benchmarks/results/throughput.json")
LATENCY_CMD = "python benchmarks/latency.py --output benchmarks/results/latency.json"
SERVING_CMD = ("python benchmarks/serving.py --launch --compare-offline --request-rates 16 inf "
               "--num-requests 256 --output benchmarks/results/serving.json")
STEP_CMD = ("python benchmarks/step_profile.py --output benchmarks/results/step_profile.json; "
            "python benchmarks/step_profile.py --batch 1 --context 128 "
            "--output benchmarks/results/step_profile_b1.json")


def ok(results: dict, backend: str) -> dict | None:
    r = results.get(backend)
    return r if r and r.get("status") == "ok" else None


def lat(res: Results, file: str = "latency.json") -> tuple[dict, dict, dict | None]:
    """(floors, mini-vllm's results by prompt length, transformers' or None)."""
    d = res(file)
    hf = ok(d["results"], "transformers")
    return (d["floors"], d["results"]["mini-vllm"]["by_prompt_len"],
            hf["by_prompt_len"] if hf else None)


def serving_run(d: dict, rate: str) -> dict:
    for r in d["runs"]:
        if str(r["request_rate"]).removesuffix(".0") == rate:
            return r
    raise KeyError(f"no run at rate {rate}")


@value("throughput")
def throughput_value(res: Results, field: str, backend: str = "mini-vllm",
                     file: str = "throughput.json") -> str:
    """A value of a throughput run: tok_s, wall_s, frac, floor_tok_s, floor_s, bw,
    vs_transformers, gpu_busy, gpu_wait, kv_blocks, preemptions."""
    d = res(file)
    r = d["results"][backend]
    floor = d["floor"]
    return {
        "tok_s": lambda: n0(r["output_tok_s"]),
        "wall_s": lambda: f"{r['wall_s']:.2f} s",
        "frac": lambda: pct(r["fraction_of_floor"]),
        "floor_tok_s": lambda: n0(floor["floor_output_tok_s"]),
        "floor_s": lambda: f"{floor['floor_s']:.2f} s",
        "bw": lambda: f"{floor['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s",
        "vs_transformers": lambda: times(d["ratios"]["mini-vllm / transformers"]),
        "gpu_busy": lambda: f"{r['engine_stats']['gpu_busy_s']:.2f} s",
        "gpu_wait": lambda: f"{r['engine_stats']['gpu_wait_s']:.2f} s",
        "kv_blocks": lambda: n0(r["kv_cache_blocks"]),
        "preemptions": lambda: n0(r["engine_stats"]["num_preemptions"]),
    }[field]()


@block("floor", THROUGHPUT_CMD)
def floor_table(res: Results) -> str:
    """The bytes of the standard workload and the floor they make."""
    d = res("throughput.json")
    f = d["floor"]
    tb = lambda b: f"{b / 1e12:.2f} TB"
    return table(["", "bytes", ""], [
        ["KV reads", tb(f["kv_read_bytes"]), "each context token's K and V once per output token"],
        ["KV writes", f"{f['kv_write_bytes'] / 1e9:.1f} GB", "every token's K and V once"],
        ["weights", tb(f["weight_read_bytes"]),
         f"{f['weight_bytes'] / 1e9:.2f} GB × {f['decode_steps']:,} decode steps"],
        [bold("total"), bold(tb(f["total_bytes"])), ""],
        ["copy bandwidth, same run", f"{f['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s",
         "a 1 GiB device-to-device copy, bytes read + written"],
        [bold("floor"), bold(f"{f['floor_s']:.2f} s"),
         bold(f"{n0(f['floor_output_tok_s'])} output tok/s")],
        ["compute floor", f"{f['compute_floor_s']:.2f} s",
         (f"{f['flops'] / 1e12:.0f} TFLOP at the measured "
          f"{f['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")],
    ])


@block("graphs", STEP_CMD)
def graphs(res: Results) -> str:
    """Eager forward against graph replay, at 256 x 1,024 and 1 x 128."""
    rows = []
    for f in ("step_profile.json", "step_profile_b1.json"):
        r = res(f)["runner"]
        rows.append([f"{r['batch']} × {r['context']:,}", f"{f2(r['eager_forward_ms'])} ms",
                     f"{f2(r['graph_replay_gpu_ms'])} ms",
                     times(r["eager_forward_ms"] / r["graph_replay_gpu_ms"])])
    return table(["decode step (sequences × context)", "eager forward", "graph replay",
                  "eager / graph"], rows)


@block("fused-kernels", "python benchmarks/kernels.py --tables fused "
       "--out benchmarks/results/fused_prefill/fused_after_1.json")
def fused_kernels(res: Results) -> str:
    """q/k-norm + RoPE (with the KV write) and SiLU · mul at 1 to 8,192 tokens."""
    rows = res("fused_prefill/fused_after_1.json")["fused"]
    names = {"qk_norm_rope": "q/k-norm + RoPE + KV write", "silu_and_mul": "SiLU · mul"}
    out = []
    for path, label in names.items():
        out.append([label, *(us_cell(r["paths"][path]) for r in rows)])
    return table(["tokens", *(f"{r['tokens']:,}" for r in rows)], out)


def pair_runs(res: Results, pattern: str, runs: Sequence[str]) -> list[dict]:
    return [res(pattern.format(run)) for run in runs]


@block("async-host", "python benchmarks/step_profile.py --output benchmarks/results/step_profile.json")
def async_host(res: Results) -> str:
    """The host's work in one engine step of 256 sequences, against the GPU's."""
    d = res("step_profile.json")
    e, r = d["engine"], d["runner"]
    parts = [("schedule (the scheduler)", "schedule_ms"), ("build the entries", "build_entries_ms"),
             ("the runner's host work (numpy layout, staging, replay call)", "execute_host_ms"),
             ("sampling metadata", "sampling_metadata_ms"), ("sampler launch", "sampler_host_ms"),
             ("post-processing (bookkeeping, detokenizing, stop checks, outputs)",
              "postprocess_ms")]
    host = sum(e[k] for _, k in parts)
    rows = [[label, f2(e[k])] for label, k in parts]
    rows += [[bold("host, total"), bold(f2(host))],
             ["GPU: the graph and the sampler", f2(r["graph_replay_gpu_ms"] + r["sampler_gpu_ms"])],
             ["one step in series (host, then wait for the GPU)", f2(e["step_wall_ms"])],
             [bold("one step with async scheduling"), bold(f2(e["step_wall_as_configured_ms"]))]]
    return table([f"one engine step, {e['batch']} sequences × {e['context']:,} tokens", "ms"], rows)


@value("async-step")
def async_step(res: Results) -> str:
    """'8.13 ms against 7.99 + 0.06 ms': the overlapped step against its GPU work."""
    d = res("step_profile.json")
    e, r = d["engine"], d["runner"]
    return (f"{f2(e['step_wall_as_configured_ms'])} ms against "
            f"{f2(r['graph_replay_gpu_ms'])} + {f2(r['sampler_gpu_ms'])} ms")


@block("sampler", "python benchmarks/step_profile.py --output "
       "benchmarks/results/two_level_sampler/after_b256.json (and --batch 1)")
def sampler(res: Results) -> str:
    """The torch pipeline and the fused sampler per step, against the floor."""
    rows = []
    for b in ("256", "1"):
        after = res(f"two_level_sampler/after_b{b}.json")["runner"]
        rows.append([f"batch {b} (× 151,936 logits)", f"{after['sampler_torch_gpu_ms']:.3f} ms",
                     bold(f"{after['sampler_gpu_ms']:.4f} ms"),
                     f"{after['sampler_floor_ms']:.4f} ms"])
    return table(["one step", "torch pipeline", "fused sampler", "floor"], rows)


@block("engine-process", "python benchmarks/serving.py --launch --no-engine-process "
       "--request-rates inf --num-requests 256 --output benchmarks/results/serving_thread.json; "
       + SERVING_CMD)
def engine_process(res: Results) -> str:
    """The server with its engine on a thread and in its own process, at saturation."""
    thread = res("serving_thread.json")
    proc = res("serving.json")
    hvo = proc["http_vs_offline"]
    return table(["256 requests at once", "GPU", "HTTP output tok/s",
                  "the offline engine in the same job"], [
        ["engine on a thread of the server", gpu_name(thread),
         n0(serving_run(thread, "inf")["output_throughput"]), "not run"],
        ["engine in its own process", gpu_name(proc), bold(n0(hvo["http_output_tok_s"])),
         f"{n0(hvo['offline_output_tok_s'])} tok/s: HTTP delivers {pct(hvo['fraction'])}"],
    ])


@block("results-throughput", THROUGHPUT_CMD)
def results_throughput(res: Results) -> str:
    """The standard workload, every backend that ran, and the floor."""
    d = res("throughput.json")
    mv = d["results"]["mini-vllm"]
    rows = []
    for name, r in d["results"].items():
        if not ok(d["results"], name):
            continue
        label = "mini-vllm" if name == "mini-vllm" else (
            f"transformers {d['environment'].get('transformers', '')}, continuous batching "
            f"(`{d['args'].get('hf_attn_implementation', '')}`)".replace("|", "\\|")
            if name == "transformers" else name)
        busy = r.get("engine_stats", {}).get("gpu_busy_s")
        rows.append([label, bold(n0(r["output_tok_s"])) if name == "mini-vllm" else n0(r["output_tok_s"]),
                     f"{r['wall_s']:.2f} s", pct(r["fraction_of_floor"]),
                     times(r["output_tok_s"] / d["results"]["transformers"]["output_tok_s"])
                     if ok(d["results"], "transformers") else "–",
                     f"{busy:.2f} s" if busy else ""])
    f = d["floor"]
    rows.append([f"floor ({f['total_bytes'] / 1e12:.2f} TB at {f['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)",
                 n0(f["floor_output_tok_s"]), f"{f['floor_s']:.2f} s", "100 %", "", ""])
    del mv
    return table(["", "output tok/s", "wall time", "fraction of the floor", "vs transformers",
                  "GPU busy"], rows)


@block("results-latency", LATENCY_CMD)
def results_latency(res: Results) -> str:
    """Batch-1 TTFT and TPOT by prompt length, against transformers and the floors."""
    floors, ours, theirs = lat(res)
    rows = []
    for p in ours:
        o, f = ours[p], floors[p]
        t = theirs.get(p) if theirs else None
        rows.append([f"{int(p):,}", bold(f"{f2(o['ttft_ms'])} ms"),
                     f"{f2(t['ttft_ms'])} ms" if t else "–", f"{f2(f['ttft_floor_ms'])} ms",
                     bold(f"{f2(o['tpot_ms'])} ms"), f"{f2(t['tpot_ms'])} ms" if t else "–",
                     f"{f2(f['decode_floor_ms'])} ms",
                     times(o["tpot_ms"] / f["decode_floor_ms"], 2),
                     times(o["tpot_ms"] / f["decode_weights_floor_ms"], 2)])
    return table(["prompt tokens", "TTFT mini-vllm", "TTFT transformers", "TTFT floor",
                  "TPOT mini-vllm", "TPOT transformers", "TPOT floor", "TPOT / floor",
                  "TPOT / weights alone"], rows)


@block("results-serving", SERVING_CMD)
def results_serving(res: Results) -> str:
    """Streaming through the server at 16 requests/s and all at once."""
    d = res("serving.json")
    rows = []
    for r in d["runs"]:
        rows.append([f"{r['request_rate']:g} req/s" if r["request_rate"] != "inf" else "inf",
                     f"{r['duration_s']:.2f} s", bold(n0(r["output_throughput"])),
                     " / ".join(f1(r["ttft_ms"][q]) for q in ("mean", "median", "p99")) + " ms",
                     " / ".join(f2(r["tpot_ms"][q]) for q in ("mean", "median", "p99")) + " ms",
                     " / ".join(f1(r["itl_ms"][q]) for q in ("median", "p99")) + " ms"])
    hvo = d["http_vs_offline"]
    table_ = table(["rate", "duration", "output tok/s", "TTFT mean / median / p99",
                    "TPOT mean / median / p99", "ITL median / p99"], rows)
    off = d["offline"]
    return (table_ + f"\n\nAt saturation HTTP streaming delivers **{pct(hvo['fraction'])} of the "
            f"offline engine** measured in the same job ({n0(hvo['offline_output_tok_s'])} tok/s "
            f"offline on this {gpu_name(d)}, {pct(off['fraction_of_floor'])} of its floor).")


@block("results-step", STEP_CMD)
def results_step(res: Results) -> str:
    """One decode step's GPU time by kernel group, at 256 x 1,024 and 1 x 128."""
    big, one = res("step_profile.json")["runner"], res("step_profile_b1.json")["runner"]
    col = lambda r, k: f"{f2(r['gpu_ms_by_category'][k])} ms"
    rows = [
        ["graph replay", bold(f"{f2(big['graph_replay_gpu_ms'])} ms"),
         bold(f"{f2(one['graph_replay_gpu_ms'])} ms")],
        ["floor (KV + weights over the copy bandwidth)", f"{f2(big['floor_ms'])} ms",
         f"{f2(one['floor_ms'])} ms"],
        ["decode attention (v7 and its combine)", col(big, "decode attention")
         + f" (KV floor {f2(big['kv_floor_ms'])} ms)", col(one, "decode attention")],
        ["matrix products", col(big, "matmul"), col(one, "matmul")],
        ["norms, RoPE + KV write, SiLU · mul", col(big, "norms / rope / activations"),
         col(one, "norms / rope / activations")],
        ["sampler, after the graph", f"{big['sampler_gpu_ms']:.3f} ms",
         f"{one['sampler_gpu_ms']:.3f} ms"],
    ]
    return table(["", f"{big['batch']} × {big['context']:,}", f"{one['batch']} × {one['context']}"],
                 rows)


def _kind_order(kind: str) -> tuple[int, int]:
    m = re.search(r"<= (\d+)", kind)
    return (0, 0) if not m else (1, -int(m.group(1)))


@block("falls-short-steps", THROUGHPUT_CMD)
def falls_short_steps(res: Results) -> str:
    """GPU time by kind of step, against each kind's own floor."""
    d = res("throughput.json")
    kinds = d["results"]["mini-vllm"]["breakdown"]["gpu_s_by_step_kind"]
    rows, lo = [], {}
    bounds = sorted(int(m.group(1)) for k in kinds if (m := re.search(r"<= (\d+)", k)))
    for i, b in enumerate(bounds):
        lo[b] = (bounds[i - 1] + 1) if i else 1
    total = [0, 0.0, 0.0]
    for kind in sorted(kinds, key=_kind_order):
        k = kinds[kind]
        m = re.search(r"<= (\d+)", kind)
        label = (f"decode, batch {lo[int(m.group(1))]}–{m.group(1)}" if m else
                 "prefill (with the decodes of the requests already in)")
        rows.append([label, n0(k["steps"]), f"{k['gpu_s']:.2f} s", f"{k['gpu_ms_per_step']:.2f} ms",
                     f"{k['floor_s']:.2f} s", f"{k['ms_per_step_above_floor']:.2f} ms"])
        total[0] += k["steps"]
        total[1] += k["gpu_s"]
        total[2] += k["floor_s"]
    rows.append([bold("all"), bold(n0(total[0])), bold(f"{total[1]:.2f} s"), "",
                 bold(f"{total[2]:.2f} s"), ""])
    return table(["steps", "count", "GPU time", "per step", "its floor", "per step above the floor"],
                 rows)


@block("falls-short-kernels", THROUGHPUT_CMD)
def falls_short_kernels(res: Results) -> str:
    """The run's kernel time by category."""
    d = res("throughput.json")
    cats = d["results"]["mini-vllm"]["breakdown"]["kernel_s_by_category"]
    f = d["floor"]
    bw = f["bandwidth_bytes_per_s"]
    notes = {
        "decode attention": f"{f['kv_read_bytes'] / bw:.2f} s to read {f['kv_read_bytes'] / 1e12:.2f}"
                            " TB of KV",
        "matmul": f"{f['weight_read_bytes'] / bw:.2f} s to read the weights once per step",
        "norms / rope / activations": "a few MB of activations per step",
        "sampling": "one read of the logits",
    }
    rows = [[k, f"{v:.2f} s", notes.get(k, "")]
            for k, v in sorted(cats.items(), key=lambda kv: -kv[1]) if v >= 0.005]
    return table(["kernels, whole run", "time", "its share of the floor"], rows)


# --- decode-time matrix products (chapter 10)

GEMV_CMD = "python benchmarks/kernels.py --tables gemv --out benchmarks/results/kernels_gemv_h200.json"
GEMM_CMD = ("python benchmarks/kernels.py --tables gemm gemm_plans "
            "--out benchmarks/results/kernels_gemm_h200.json")
LAYERS = {"Qwen3-0.6B": 28, "Qwen3-8B": 36}


@block("gemv", GEMV_CMD)
def gemv(res: Results) -> str:
    """The GEMV against cuBLAS at 1 and 16 rows."""
    rows = res("kernels_gemv_h200.json")["gemv"]
    keep = [(r) for r in rows if (r["model"] == "Qwen3-0.6B" and r["rows"] in (1, 16))
            or (r["model"] == "Qwen3-8B" and r["layer"] in ("down_proj", "lm_head")
                and r["rows"] in (1, 16))]
    out = []
    for r in keep:
        name = f"{r['model'].removeprefix('Qwen3-')} `{r['layer']}` {r['k']:,} × {r['n']:,}"
        out.append([name, str(r["rows"]), us_cell(r["paths"]["ours"]),
                    us_cell(r["paths"]["cublas"])])
    return table(["shape (K × N)", "rows", "ours", "cuBLAS"], out)


@block("gemv-step", GEMV_CMD)
def gemv_step(res: Results) -> str:
    """The sum of a decode step's products, ours against cuBLAS."""
    rows = res("kernels_gemv_h200.json")["gemv"]
    out = []
    for model, layers in LAYERS.items():
        for m in (1, 8, 16):
            tot = {"ours": 0.0, "cublas": 0.0}
            for r in rows:
                if r["model"] == model and r["rows"] == m:
                    for p in tot:
                        tot[p] += r["paths"][p]["us"] * (1 if r["layer"] == "lm_head" else layers)
            out.append([model, str(m), bold(f"{tot['ours'] / 1e3:.3f} ms")
                        if tot["ours"] < tot["cublas"] else f"{tot['ours'] / 1e3:.3f} ms",
                        f"{tot['cublas'] / 1e3:.3f} ms"])
    return table(["model", "rows", "all products, ours", "all products, cuBLAS"], out)


@block("gemm", GEMM_CMD)
def gemm(res: Results) -> str:
    """gemm_wgmma against cuBLAS at Qwen3-0.6B's shapes, 24 to 256 rows."""
    rows = [r for r in res("kernels_gemm_h200.json")["gemm"] if r["model"] == "Qwen3-0.6B"]
    layers = list(dict.fromkeys((r["layer"], r["k"], r["n"]) for r in rows))
    counts = [24, 48, 64, 96, 128, 192, 256]
    out = []
    for m in counts:
        cells = []
        for layer, _, _ in layers:
            r = next(r for r in rows if r["layer"] == layer and r["rows"] == m)
            o, c = r["paths"]["ours"]["us"], r["paths"]["cublas"]["us"]
            cells.append(f"{bold(f1(o)) if o < c else f1(o)} / {f1(c)}")
        out.append([str(m), *cells])
    return table(["rows", *(f"`{ly}` {k:,} → {n:,}" for ly, k, n in layers)], out)


@block("gemm-step", "python benchmarks/step_profile.py --batch B --context 1024 --no-engine "
       "--output benchmarks/results/idle_consumer/step_profile_bB_after.json (B = 32, 64, 128)")
def gemm_step(res: Results) -> str:
    """The decode graph with gemm_wgmma, and recaptured with every product on cuBLAS."""
    out = []
    for b in (32, 64, 128):
        r = res(f"idle_consumer/step_profile_b{b}_after.json")["runner"]
        g, c = r["graph_replay_gpu_ms"], r["graph_replay_gpu_ms_without_wgmma_gemm"]
        out.append([f"{b} × 1,024", f"{f2(r['floor_ms'])} ms", bold(f"{g:.3f} ms"),
                    f"{c:.3f} ms", pct(1 - g / c)])
    return table(["sequences × context", "floor", "graph replay", "every product on cuBLAS",
                  "saved"], out)


@block("silu-epilogue", "python benchmarks/kernels.py --tables silu_epilogue "
       "--out benchmarks/results/idle_consumer/kernels_silu_epilogue_after.json")
def silu_epilogue(res: Results) -> str:
    """gate_up_proj with SiLU · mul in its epilogue against two launches."""
    rows = res("idle_consumer/kernels_silu_epilogue_after.json")["silu_epilogue"]
    out = []
    for r in rows:
        us = {k: v["us"] for k, v in r["paths"].items()}
        best = min(us, key=us.get)
        out.append([str(r["rows"]), *((bold if k == best else str)(f2(us[k]))
                                      for k in ("fused", "separate", "cublas_separate"))])
    return table(["rows", "fused (ours)", "ours + `silu_and_mul`", "cuBLAS + `silu_and_mul`"], out)


def before_after_step(res: Results, folder: str, batches: Sequence[int],
                      context: str = "1024") -> list[list[str]]:
    out = []
    for b in batches:
        before = res(f"{folder}/step_profile_b{b}_before.json")["runner"]
        after = res(f"{folder}/step_profile_b{b}_after.json")["runner"]
        g0, g1 = before["graph_replay_gpu_ms"], after["graph_replay_gpu_ms"]
        out.append([f"{b} × {int(before['context']):,}", f"{f2(before['floor_ms'])} ms",
                    f"{g0:.3f} ms", bold(f"{g1:.3f} ms"), f"{100 * (g1 / g0 - 1):+.1f} %"])
    return out


@block("silu-step", "python benchmarks/step_profile.py --batch 1 --context 128 --no-engine "
       "--output benchmarks/results/silu_epilogue/step_profile_b1_after.json (and _before: "
       "the same on the code without the epilogue)")
def silu_step(res: Results) -> str:
    """The batch-1 decode graph before and after SiLU · mul moved into the epilogue."""
    return table(["sequences × context", "floor", "two launches", "in the epilogue", "change"],
                 before_after_step(res, "silu_epilogue", [1]))


@block("idle-consumer", "python benchmarks/kernels.py --tables silu_epilogue --out "
       "benchmarks/results/idle_consumer/kernels_silu_epilogue_after.json; python "
       "benchmarks/step_profile.py --batch B --context 1024 --no-engine --output "
       "benchmarks/results/idle_consumer/step_profile_bB_after.json (each also _before: the "
       "same on the code where both consumers multiply)")
def idle_consumer(res: Results) -> str:
    """The fused product per call and the decode graph, before and after the idle
    consumer sat out."""
    before = res("idle_consumer/kernels_silu_epilogue_before.json")["silu_epilogue"]
    after = res("idle_consumer/kernels_silu_epilogue_after.json")["silu_epilogue"]
    out = []
    for b, a in zip(before, after):
        if 16 < b["rows"] <= 64:
            out.append([f"`gate_up_proj` + SiLU · mul, {b['rows']} rows",
                        f"{b['paths']['fused']['us']:.2f} µs", bold(f"{a['paths']['fused']['us']:.2f} µs"),
                        f"{100 * (a['paths']['fused']['us'] / b['paths']['fused']['us'] - 1):+.1f} %"])
    for row in before_after_step(res, "idle_consumer", [32, 64, 128]):
        out.append([f"decode graph, {row[0]}", *row[2:]])
    return table(["", "both consumers multiply", "a consumer with no rows sits out", "change"], out)


# --- prefill attention (chapter 11)

PREFILL_CMD = ("python benchmarks/kernels.py --tables prefill "
               "--out benchmarks/results/flash_prefill/kernels_prefill_h100.json")


def prefill_case(res: Results, shape: str) -> dict:
    """The case of the prefill table whose name starts with '1 x 8192' for '1x8192'."""
    want = shape.replace("x", " x ")
    for r in res("flash_prefill/kernels_prefill_h100.json")["prefill"]:
        if r["case"].startswith(want):
            return r
    raise KeyError(f"no prefill case {shape}")


@value("prefill-ratio")
def prefill_ratio(res: Results, shape: str) -> str:
    """Our kernel's time over FlashAttention-2's on the engine's path: '0.55×'."""
    p = prefill_case(res, shape)["paths"]
    return f"{p['flash_wgmma']['us'] / p['flash_varlen']['us']:.2f}×"


@value("prefill-tflops")
def prefill_tflops(res: Results, shape: str, path: str) -> str:
    """The causal attention FLOPs of B fresh prompts of L tokens over a path's time
    (Qwen3-0.6B's 16 query heads, head_dim 128)."""
    b, n = (int(v) for v in shape.split("x"))
    flops = 2 * 2 * 16 * 128 * b * n * n / 2
    return f"{flops / (prefill_case(res, shape)['paths'][path]['us'] * 1e-6) / 1e12:.0f} TFLOP/s"


@block("prefill-kernels", PREFILL_CMD)
def prefill_kernels(res: Results) -> str:
    """Every prefill path per call, fresh prompts and cached prefixes."""
    rows = res("flash_prefill/kernels_prefill_h100.json")["prefill"]
    names = {"flash_wgmma": "ours, the path", "flash_wgmma_paged": "ours, always from the cache",
             "flash_varlen": "FlashAttention-2, the path",
             "flash_varlen_gather": "FlashAttention-2, always gathering",
             "sdpa_per_seq": "SDPA per sequence", "gather_only": "the gather alone"}
    out = []
    for r in rows:
        us = {k: r["paths"][k]["us"] for k in names}
        fastest = min(("flash_wgmma", "flash_wgmma_paged", "flash_varlen", "flash_varlen_gather"),
                      key=us.get)
        out.append([r["case"].replace(" x ", " × ").replace("8192 tokens", "8,192 tokens"),
                     *((bold if k == fastest else str)(f1(us[k])) for k in names)])
    return table(["batch", *names.values()], out)


@block("prefill-ttft", "python benchmarks/latency.py --backends mini-vllm --prompt-lens 2048 "
       "8192 --output-len 16 --num-iters 3 --output "
       "benchmarks/results/flash_prefill/h100_latency_after.json (and _before: the "
       "same on the code without the kernel)")
def prefill_ttft(res: Results) -> str:
    """Time to first token with FlashAttention-2 and with our kernel."""
    before = res("flash_prefill/h100_latency_before.json")
    after = res("flash_prefill/h100_latency_after.json")
    out = []
    for p, a in after["results"]["mini-vllm"]["by_prompt_len"].items():
        b = before["results"]["mini-vllm"]["by_prompt_len"][p]
        fb, fa = before["floors"][p]["ttft_floor_ms"], after["floors"][p]["ttft_floor_ms"]
        out.append([f"{int(p):,}", f"{f2(b['ttft_ms'])} ms (floor {f2(fb)} ms: {pct(fb / b['ttft_ms'], 0)})",
                    bold(f"{f2(a['ttft_ms'])} ms") + f" (floor {f2(fa)} ms: {pct(fa / a['ttft_ms'], 0)})",
                    f"{b['tpot_ms']:.3f} / {a['tpot_ms']:.3f} ms"])
    return table(["prompt tokens", "TTFT, FlashAttention-2 (floor / TTFT)",
                  "TTFT, ours (floor / TTFT)", "TPOT, before / after"], out)


@block("prefill-steps", "python benchmarks/throughput.py --backends mini-vllm --max-tokens-range "
       "1 1 --breakdown --output benchmarks/results/flash_prefill/h100_prefill_only_after.json "
       "(and _before: the same on the code without the kernel)")
def prefill_steps(res: Results) -> str:
    """The standard workload's prompts alone: GPU time of the prefill steps by kernel."""
    out = []
    for label, f in (("FlashAttention-2", "before"), ("ours", "after")):
        r = res(f"flash_prefill/h100_prefill_only_{f}.json")["results"]["mini-vllm"]
        k = r["breakdown"]["gpu_s_by_step_kind"]["prefill or mixed"]
        c = r["breakdown"]["kernel_s_by_category"]
        cell = (lambda s: bold(s)) if f == "after" else str
        out.append([label, cell(f"{k['gpu_s']:.3f} s ({k['gpu_ms_per_step']:.1f} ms a step)"),
                    f"{c['matmul']:.3f} s", cell(f"{c['prefill attention']:.3f} s"),
                    f"{c['norms / rope / activations']:.3f} s"])
    return table(["prefill attention", "prefill steps' GPU time", "matmul",
                  "prefill attention (with the gathers)", "norms / RoPE / SiLU"], out)


# --- host overhead (chapter 12)

def medians(res: Results, files: Sequence[str], key: str, fmt: Callable[[float], str]
            ) -> dict[str, str]:
    """Per prompt length, the medians of `key` of several latency runs, ' / '-joined."""
    runs = [res(f)["results"]["mini-vllm"]["by_prompt_len"] for f in files]
    return {p: " / ".join(fmt(r[p][key]) for r in runs) for p in runs[0]}


@block("pdl", STEP_CMD)
def pdl(res: Results) -> str:
    """The decode graph captured with and without programmatic dependent launch."""
    out = []
    for f in ("step_profile_b1.json", "step_profile.json"):
        r = res(f)["runner"]
        on, off = r["graph_replay_gpu_ms"], r["graph_replay_gpu_ms_without_pdl"]
        out.append([f"{r['batch']} × {r['context']:,}", f"{off:.3f} ms", bold(f"{on:.3f} ms"),
                    f"{100 * (on / off - 1):+.1f} %"])
    return table(["decode graph (sequences × context)", "launched plainly",
                  "programmatic launch", "change"], out)


@block("piecewise-ttft", "python benchmarks/latency.py --output "
       "benchmarks/results/piecewise/latency_piecewise_1.json; python benchmarks/latency.py "
       "--max-piecewise-graph-tokens 0 --output "
       "benchmarks/results/piecewise/latency_eager_prefill_1.json")
def piecewise_ttft(res: Results) -> str:
    """Batch-1 TTFT with the piecewise graphs and with eager prefills, one job."""
    graphs = res("piecewise/latency_piecewise_1.json")
    eager = res("piecewise/latency_eager_prefill_1.json")
    g = graphs["results"]["mini-vllm"]["by_prompt_len"]
    e = eager["results"]["mini-vllm"]["by_prompt_len"]
    out = []
    for p in g:
        note = "" if int(p) <= 512 else " (eager in both)"
        cell = bold if not note else str
        out.append([f"{int(p):,}{note}", cell(f"{f2(g[p]['ttft_ms'])} ms"), f"{f2(e[p]['ttft_ms'])} ms",
                    f"{f2(graphs['floors'][p]['ttft_floor_ms'])} ms",
                    f"{g[p]['tpot_ms']:.3f} / {e[p]['tpot_ms']:.3f} ms"])
    return table(["prompt tokens", "TTFT, piecewise graphs", "TTFT, eager prefill", "TTFT floor",
                  "TPOT, graphs / eager"], out)


@block("piecewise-all", "python benchmarks/throughput.py --backends mini-vllm "
       "--max-piecewise-graph-tokens 512 --output "
       "benchmarks/results/piecewise_all/throughput_512_1.json (then 8192; _1 to _3)")
def piecewise_all(res: Results) -> str:
    """The standard workload with the ladder up to 512 and up to 8,192 tokens."""
    out = []
    for ladder in ("512", "8192"):
        ds = [res(f"piecewise_all/throughput_{ladder}_{i}.json")["results"]["mini-vllm"]
              for i in (1, 2, 3)]
        es = [d["engine_stats"] for d in ds]
        out.append([f"{int(ladder):,} tokens", " / ".join(n0(d["output_tok_s"]) for d in ds),
                    " / ".join(f"{d['wall_s']:.2f}" for d in ds) + " s",
                    " / ".join(f"{e['gpu_busy_s']:.2f}" for e in es) + " s",
                    " / ".join(f"{e['gpu_busy_s'] - e['gpu_busy_decode_s']:.3f}" for e in es) + " s"])
    return table(["ladder up to", "output tok/s", "wall time", "GPU busy",
                  "prefill steps' GPU time"], out)


@block("prompt-graph", "python benchmarks/latency.py --backends mini-vllm --prompt-lens 128 512 "
       "1024 2048 --output-len 32 --num-iters 5 --output "
       "benchmarks/results/prompt_graph/h100_latency_after_1.json (and _2; _before_1, _2: "
       "the same on the code without the lone-prompt graph)")
def prompt_graph(res: Results) -> str:
    """Batch-1 TTFT and TPOT before and after a lone prompt became one graph."""
    b = ["prompt_graph/h100_latency_before_1.json", "prompt_graph/h100_latency_before_2.json"]
    a = ["prompt_graph/h100_latency_after_1.json", "prompt_graph/h100_latency_after_2.json"]
    ms = lambda x: f2(x)
    tb, ta = medians(res, b, "ttft_ms", ms), medians(res, a, "ttft_ms", ms)
    pb, pa = medians(res, b, "tpot_ms", f3), medians(res, a, "tpot_ms", f3)
    out = [[f"{int(p):,}" + (" (pieces in both)" if int(p) > 1024 else ""), f"{tb[p]} ms",
            bold(f"{ta[p]} ms"), f"{pb[p]} ms", f"{pa[p]} ms"] for p in tb]
    return table(["prompt tokens", "TTFT, pieces", "TTFT, one graph", "TPOT before", "TPOT after"],
                 out)


@block("step-inputs", "python benchmarks/latency.py --backends mini-vllm --prompt-lens 128 2048 "
       "--num-iters 5 --output benchmarks/results/step_inputs/latency_after_1.json (and _2; "
       "_before_1, _2: the same on the code with the staging buffer); python benchmarks/step_profile.py --batch 1 "
       "--context 128 --steps 200 --output benchmarks/results/step_inputs/step_profile_b1_after.json "
       "(and _before)")
def step_inputs(res: Results) -> str:
    """Batch-1 latency and the step's host time, before and after the pinned mirror."""
    b = ["step_inputs/latency_before_1.json", "step_inputs/latency_before_2.json"]
    a = ["step_inputs/latency_after_1.json", "step_inputs/latency_after_2.json"]
    tb, ta = medians(res, b, "tpot_ms", f3), medians(res, a, "tpot_ms", f3)
    fb, fa = medians(res, b, "ttft_ms", f2), medians(res, a, "ttft_ms", f2)
    out = []
    for p in tb:
        out.append([f"TPOT, {int(p):,}-token prompt", f"{tb[p]} ms", bold(f"{ta[p]} ms")])
    for p in fb:
        out.append([f"TTFT, {int(p):,}-token prompt", f"{fb[p]} ms", bold(f"{fa[p]} ms")])
    sb = res("step_inputs/step_profile_b1_before.json")
    sa = res("step_inputs/step_profile_b1_after.json")
    out.append(["the decode graph's GPU time", f"{sb['runner']['graph_replay_gpu_ms']:.3f} ms",
                f"{sa['runner']['graph_replay_gpu_ms']:.3f} ms"])
    out.append(["the runner's host work a step (engine view)",
                f"{sb['engine']['execute_host_ms']:.3f} ms",
                bold(f"{sa['engine']['execute_host_ms']:.3f} ms")])
    return table(["batch 1", "staging buffer", "pinned mirror, one call"], out)


@block("block-ids", "python benchmarks/step_profile.py --host-layout --preset tiny --batch 256 "
       "--context 1024 --steps 200 --output "
       "benchmarks/results/block_ids/step_profile_host_layout_b256.json (and --batch 64)")
def block_ids(res: Results) -> str:
    """The runner's host layout of a decode step, block tables as lists and as arrays."""
    out = []
    for b in (64, 256):
        h = res(f"block_ids/step_profile_host_layout_b{b}.json")["host_layout"]
        out.append([f"{h['batch']} × {h['context']:,}", f"{h['lists_ms']:.3f} ms",
                    bold(f"{h['arrays_ms']:.3f} ms")])
    return table(["sequences × context", "tables as lists", "as int32 arrays"], out)


@block("postprocess", "python benchmarks/step_profile.py --postprocess --preset tiny --context 16 "
       "--steps 100 --output benchmarks/results/step_profile_postprocess.json")
def postprocess(res: Results) -> str:
    """The engine's host work after the sampler, text token by token and at the end."""
    p = res("step_profile_postprocess.json")["postprocess"]
    rows = [
        ["ms per step, mean over the run", "per_token_ms_per_step", "at_end_ms_per_step"],
        ["ms, median step", "per_token_median_ms", "at_end_median_ms"],
        [f"ms, the last step (all {p['batch']} finish)", "per_token_last_step_ms",
         "at_end_last_step_ms"],
    ]
    return table([f"`_process`, {p['batch']} rows", "token by token", "text at the end"],
                 [[label, f2(p[a]), f2(p[b])] for label, a, b in rows])


@block("gc-freeze", "python benchmarks/serving.py --launch --request-rates inf --num-requests 256 "
       "--output benchmarks/results/gc_freeze/h100_serving_after_1.json (before_1, after_1, "
       "before_2 alternated; before: the code without the freeze, with the same serving.py)")
def gc_freeze(res: Results) -> str:
    """Saturation runs before and after the heap was frozen, alternated in one job."""
    names = [("before", "before_1"), ("after", "after_1"), ("before", "before_2")]
    runs = [serving_run(res(f"gc_freeze/h100_serving_{f}.json"), "inf") for _, f in names]
    row = lambda label, fn: [label, *(fn(r) for r in runs)]
    return table(["", *(n for n, _ in names)], [
        row("output tok/s", lambda r: n0(r["output_throughput"])),
        row("TTFT mean / p99", lambda r: f"{r['ttft_ms']['mean']:.0f} / {r['ttft_ms']['p99']:.0f} ms"),
        row("ITL median / p99", lambda r: f"{r['itl_ms']['median']:.1f} / {r['itl_ms']['p99']:.1f} ms"),
    ])


# --- decode attention in a real batch (chapter 13)

@block("decode-mixed", "python benchmarks/kernels.py --tables mixed "
       "--out benchmarks/results/kernels_mixed_h200.json")
def decode_mixed(res: Results) -> str:
    """v7 on mixed contexts: drawn order, longest first, sorted rows, splits, v8."""
    rows = res("kernels_mixed_h200.json")["mixed"]
    names = {"v7": "drawn order", "v7_longest_first": "longest first",
             "v7_rows_sorted": "rows sorted", "v7_longest_first_p1024": "longest first, splits of 1,024",
             "v7_longest_first_p512": "splits of 512", "v8": "v8"}
    out = []
    for r in rows:
        best = min(names, key=lambda k: r["paths"][k]["us"])
        out.append([str(r["batch"]), f"{r['context_min']:,}–{r['context_max']:,}",
                    *((bold if k == best else str)(us_cell(r["paths"][k])) for k in names)])
    return table(["batch", "contexts", *names.values()], out)


@block("wide-ring", "python benchmarks/kernels.py --tables mixed "
       "--out benchmarks/results/wide_ring/kernels_mixed_h200.json")
def wide_ring(res: Results) -> str:
    """The default ring against the wide one on mixed contexts, both longest first."""
    rows = res("wide_ring/kernels_mixed_h200.json")["mixed"]
    out = []
    for r in rows:
        d, w = r["paths"]["v7_longest_first"]["us"], r["paths"]["v7_longest_first_w4s2"]["us"]
        out.append([str(r["batch"]), f"{r['context_min']:,}–{r['context_max']:,}", f1(d),
                    (bold if w < d else str)(f1(w)), f"{100 * (w / d - 1):+.1f} %"])
    return table(["batch", "contexts", "default ring (2 warps × 3 stages)", "wide ring (4 × 2)",
                  "change"], out)


def versus(rows: list[dict], new: str, old: str) -> str:
    out = []
    for r in rows:
        us = {k: v["us"] for k, v in r["paths"].items()}
        out.append([f"{r['num_q_heads']}/{r['num_kv_heads']}", f"{r['batch']} × {r['context']}",
                    f1(us[old]), f1(us[new]), f1(us["sdpa_contig"]), f3(us[new] / us[old]),
                    f3(us[new] / us["sdpa_contig"])])
    a, b = new.removeprefix("ours_"), old.removeprefix("ours_")
    return table(["heads", "batch × context", b, a, "SDPA, contiguous", f"{a} / {b}",
                  f"{a} / SDPA"], out)


@block("decode-v8", "python benchmarks/kernels.py --tables v8 "
       "--out benchmarks/results/kernels_v8_h200.json")
def decode_v8(res: Results) -> str:
    """v8 against v7 and SDPA on contiguous K/V."""
    return versus(res("kernels_v8_h200.json")["v8"], "ours_v8", "ours_v7")


@block("decode-v9", "python benchmarks/kernels.py --tables v9 "
       "--out benchmarks/results/kernels_v9_h200.json")
def decode_v9(res: Results) -> str:
    """v9 against v7 and SDPA on contiguous K/V."""
    return versus(res("kernels_v9_h200.json")["v9"], "ours_v9", "ours_v7")


@block("decode-ncu-v7", "ncu --clock-control none --metrics ... python benchmarks/kernels.py "
       "--profile B,4096,16 --profile-path {ours,sdpa_contig}, summarized into "
       "benchmarks/results/ncu_v7_sdpa_h200.json")
def decode_ncu_v7(res: Results) -> str:
    """v7 and SDPA under Nsight Compute at 64, 128 and 256 x 4,096."""
    shapes = res("ncu_v7_sdpa_h200.json")["shapes"]
    out = []
    for shape in sorted(shapes, key=lambda s: int(s.split("x")[0])):
        o, s = shapes[shape]["ours"], shapes[shape]["sdpa_contig"]

        def pair(k: str, fmt: Callable[[float], str], o: dict = o, s: dict = s) -> str:
            return f"{fmt(o[k])} / {fmt(s[k])}"  # v7 / SDPA
        out.append([f"{shape.split('x')[0]}, v7 / SDPA",
                    pair("gpu__time_duration.sum", lambda v: f"{v / 1e3:.1f}") + " µs",
                    pair("dram__throughput.avg.pct_of_peak_sustained_elapsed", lambda v: f"{v:.1f}")
                    + " %",
                    pair("dram__bytes_read.sum", lambda v: f"{v / 1e6:,.0f}") + " MB",
                    pair("sm__warps_active.avg.pct_of_peak_sustained_active", lambda v: f"{v:.1f}")
                    + " %",
                    pair("smsp__inst_executed.sum", lambda v: f"{v / 1e6:.1f}") + " M"])
    return table(["batch × 4,096", "time", "DRAM, % of peak", "DRAM read", "warps active",
                  "instructions"], out)


@value("step-value")
def step_value(res: Results, what: str) -> str:
    """A sentence's worth of step_profile.json: `attention` ('6.75 ms against the
    7.40 ms its KV takes at the copy bandwidth')."""
    r = res("step_profile.json")["runner"]
    if what == "attention":
        return (f"{f2(r['gpu_ms_by_category']['decode attention'])} ms against the "
                f"{f2(r['kv_floor_ms'])} ms its KV takes at the copy bandwidth")
    raise KeyError(what)


# --- the README's headline

@value("latency-value")
def latency_value(res: Results, field: str, prompt: str) -> str:
    """A batch-1 figure of latency.json: `tpot` or `ttft` at a prompt length."""
    _, ours, _ = lat(res)
    return f"{f2(ours[prompt][field + '_ms'])} ms"


@value("serving-value")
def serving_value(res: Results, field: str) -> str:
    """`fraction`: the HTTP stream's share of the offline engine at saturation."""
    hvo = res("serving.json")["http_vs_offline"]
    return {"fraction": pct(hvo["fraction"])}[field]


@block("readme-headline", None)
def readme_headline(res: Results) -> str:
    """The README's table: one row per figure a user looks at, each with its command."""
    t = res("throughput.json")
    mv, hf, fl = t["results"]["mini-vllm"], ok(t["results"], "transformers"), t["floor"]
    floors, ours, theirs = lat(res)
    s = res("serving.json")
    hvo = s["http_vs_offline"]
    sp = res("step_profile.json")["runner"]
    gemv_rows = res("kernels_gemv_h200.json")["gemv"]
    step1 = {p: sum(r["paths"][p]["us"] * (1 if r["layer"] == "lm_head" else 28)
                    for r in gemv_rows if r["model"] == "Qwen3-0.6B" and r["rows"] == 1)
             for p in ("ours", "cublas")}
    g32 = res("idle_consumer/step_profile_b32_after.json")["runner"]
    v7 = res("kernels_v7_h200.json")
    bar = bar_rows(v7["v7"])
    fr = [100 * r["paths"]["ours_v7"]["frac_copy"] for r in bar]
    ratio = [r["paths"]["ours_v7"]["us"] / r["paths"]["sdpa_contig"]["us"] for r in bar]
    pre = prefill_case(res, "1x8192")["paths"]
    ttft_b = res("flash_prefill/h100_latency_before.json")["results"]["mini-vllm"]["by_prompt_len"]
    ttft_a = res("flash_prefill/h100_latency_after.json")["results"]["mini-vllm"]["by_prompt_len"]
    p = "128"
    rows = [
        [f"standard offline workload, 256 requests, on an {gpu_name(t)}", f"`{THROUGHPUT_CMD}`",
         bold(f"{n0(mv['output_tok_s'])} output tok/s"),
         f"{pct(mv['fraction_of_floor'])} of the floor ({n0(fl['floor_output_tok_s'])} tok/s)"
         + (f"; transformers' continuous batching {n0(hf['output_tok_s'])} tok/s "
            f"({times(mv['output_tok_s'] / hf['output_tok_s'])} slower)" if hf else "")],
        [f"batch-1 decode, {p}-token prompt, on an {gpu_name(res('latency.json'))}", f"`{LATENCY_CMD}`",
         bold(f"{f2(ours[p]['tpot_ms'])} ms per token"),
         f"{times(ours[p]['tpot_ms'] / floors[p]['decode_floor_ms'], 2)} the floor "
         f"({f2(floors[p]['decode_floor_ms'])} ms)"
         + (f"; transformers {f1(theirs[p]['tpot_ms'])} ms" if theirs else "")],
        [f"batch-1 time to first token, {p}-token prompt", f"`{LATENCY_CMD}`",
         bold(f"{f2(ours[p]['ttft_ms'])} ms"),
         f"floor {f2(floors[p]['ttft_floor_ms'])} ms"
         + (f"; transformers {f1(theirs[p]['ttft_ms'])} ms" if theirs else "")],
        [f"HTTP streaming at saturation, on an {gpu_name(s)}", f"`{SERVING_CMD}`",
         bold(f"{n0(hvo['http_output_tok_s'])} output tok/s"),
         (f"{pct(hvo['fraction'])} of the offline engine in the same job "
         f"({n0(hvo['offline_output_tok_s'])})")],
        ["sampling 256 rows of 151,936 logits (two-level Gumbel-max)",
         "`python benchmarks/step_profile.py --output benchmarks/results/step_profile.json`",
         bold(f"{sp['sampler_gpu_ms']:.3f} ms"),
         (f"torch pipeline {sp['sampler_torch_gpu_ms']:.3f} ms; floor (one read of the logits) "
         f"{sp['sampler_floor_ms']:.3f} ms")],
        ["the linear layers of a batch-1 decode step (our GEMV)", f"`{GEMV_CMD}`",
         bold(f"{step1['ours'] / 1e3:.3f} ms"), f"cuBLAS {step1['cublas'] / 1e3:.3f} ms"],
        ["decode step of 32 sequences × 1,024 tokens, products on our wgmma GEMM",
         ("`python benchmarks/step_profile.py --batch 32 --context 1024 --no-engine --output "
         "benchmarks/results/idle_consumer/step_profile_b32_after.json`"),
         bold(f"{g32['graph_replay_gpu_ms']:.3f} ms"),
         f"{g32['graph_replay_gpu_ms_without_wgmma_gemm']:.3f} ms with every product on cuBLAS"],
        ["paged decode attention v7, batch ≥ 64, context ≥ 1k",
         "`python benchmarks/kernels.py --tables v7 --out benchmarks/results/kernels_v7_h200.json`",
         bold(f"{min(fr):.0f}–{max(fr):.0f} % of the copy bandwidth"),
         f"{min(ratio):.3f}–{max(ratio):.3f}× the time of SDPA over contiguous K/V"],
        [f"prefill attention, one 8,192-token prompt, on an {gpu_name(res('flash_prefill/kernels_prefill_h100.json'))}",
         f"`{PREFILL_CMD}`", bold(f"{pre['flash_wgmma']['us']:.0f} µs a layer"),
         (f"PyTorch's FlashAttention-2 {pre['flash_varlen']['us']:.0f} µs; time to first token "
         f"at 8,192 tokens {f1(ttft_a['8192']['ttft_ms'])} ms against {f1(ttft_b['8192']['ttft_ms'])} ms")],
    ]
    return table(["what", "command", "mini-vllm", "against"], rows)


# --- ranges and single measurements quoted in the prose

SCOPES: dict[str, Callable[[dict], bool]] = {
    # the shapes of the bar: Qwen3-0.6B's heads, batch >= 64, context >= 1k
    "bar": lambda r: r.get("num_q_heads", 16) == 16 and r["batch"] >= 64 and r["context"] >= 1024,
    # Qwen3-8B's heads from batch 16 up
    "8b16": lambda r: r.get("num_q_heads", 16) == 32 and r["batch"] >= 16,
    # a shape's block sizes: '64x2048'
}


@value("range")
def range_value(res: Results, file: str, table_: str, expr: str, scope: str) -> str:
    """The range of a quantity over the rows of a kernels table: `us:PATH` (its time per
    call), `frac:PATH` (its share of the copy bandwidth, '93–103 %') or `ratio:A/B`
    (A's time over B's, '2.7–3.3×'),
    over the rows of `scope` (bar, 8b16, b128 for one batch size, or a shape such as
    64x2048)."""
    rows = res(file)[table_]
    if scope in SCOPES:
        rows = [r for r in rows if SCOPES[scope](r)]
    elif re.fullmatch(r"b\d+", scope):  # every context of one batch size, 16 heads
        rows = [r for r in rows if r["batch"] == int(scope[1:]) and r.get("num_q_heads", 16) == 16]
    else:
        q, b, c = shape_key(scope)
        rows = [r for r in rows if (r.get("num_q_heads", 16), r["batch"], r["context"]) == (q, b, c)]
    if not rows:
        raise KeyError(f"no rows in {scope}")
    kind, _, what = expr.partition(":")
    if kind == "us":
        v = [r["paths"][what]["us"] for r in rows]
        return f"{min(v):.1f}–{max(v):.1f} µs"
    if kind == "frac":
        v = [100 * r["paths"][what]["frac_copy"] for r in rows]
        return f"{min(v):.0f}–{max(v):.0f} %"
    a, _, b = what.partition("/")
    v = [r["paths"][a]["us"] / r["paths"][b]["us"] for r in rows]
    digits = 1 if max(v) >= 1.5 else 3
    return f"{min(v):.{digits}f}–{max(v):.{digits}f}×"


@value("ncu")
def ncu_value(res: Results, kernel: str, field: str) -> str:
    """One of Nsight Compute's figures for v5, v6 or SDPA at 64 x 4,096: '89 %'."""
    v = res("kernels_h200.json")["ncu_64x4096"][kernel][field]
    return f"{v:.0f} %"


@value("fold-gain")
def fold_gain(res: Results) -> str:
    """The mean throughput of the folded runs over the unfolded ones: '+1.9 %'."""
    mean = lambda side: sum(res(f"fold_norms/{side}_{i}.json")["results"]["mini-vllm"]["output_tok_s"]
                            for i in (1, 2)) / 2
    return f"{100 * (mean('after') / mean('before') - 1):+.1f} %"


# ----------------------------------------------------------------------------- structured outputs

SO_MICRO = {"cpu": "structured_output/cpu.json", "cuda": "structured_output/cuda.json"}
SO_THROUGHPUT = "structured_output_throughput.json"
SO_THROUGHPUT_CMD = ("python benchmarks/throughput.py --backends mini-vllm --json-schema records "
                     "--output benchmarks/results/structured_output_throughput.json")


def so_micro_cmd(device: str) -> str:
    return (f"python benchmarks/structured_output.py --device {device} --vocab-size 151936 "
            f"--output benchmarks/results/{SO_MICRO[device]}")


def so_micro(res: Results, device: str) -> dict[str, Any] | NotMeasured:
    """The structured-output micro benchmark on `device` (cpu, cuda), or what to run."""
    rel = SO_MICRO[device]
    if not (res.root / rel).is_file():
        return NotMeasured(f"*Not measured yet on {device}: `bash scripts/gpu_structured_output.sh` "
                           f"measures it (`{so_micro_cmd(device)}`); then `python "
                           "scripts/figures.py`.*")
    return res(rel)


def so_compile(res: Results, device: str) -> str:
    """Cold compile time of each kind of spec."""
    d = so_micro(res, device)
    if isinstance(d, NotMeasured):
        return d
    return table(["spec", "compile (ms)"], [[r["spec"], f2(r["compile_ms"])] for r in d["compile"]])


def so_fill(res: Results, device: str) -> str:
    """The host's bitmask fill: one row, and a whole step of rows (fill_bitmasks)."""
    d = so_micro(res, device)
    if isinstance(d, NotMeasured):
        return d
    batch = {r["spec"]: r for r in d["fill_batch"]}
    rows = [[r["spec"], f1(r["fill_us_mean"]), f1(r["fill_us_p99"]),
             f"{batch[r['spec']]['rows']}", f2(batch[r["spec"]]["fill_ms_per_step"]),
             f1(batch[r["spec"]]["fill_us_per_row"])] for r in d["fill"]]
    return table(["spec", "one row, mean (µs)", "one row, p99 (µs)", "rows of a step",
                  "the step's rows (ms)", "per row (µs)"], rows)


def so_apply(res: Results, device: str) -> str:
    """The sampler's mask stage on [batch, V] logits: ours against xgrammar's kernel."""
    d = so_micro(res, device)
    if isinstance(d, NotMeasured):
        return d
    return table(["batch × vocabulary", "constrained rows", "apply_token_bitmask (µs)",
                  "xgrammar's kernel (µs)"],
                 [[f"{r['batch']} × {r['vocab_size']:,}", r["constrained_rows"], f1(r["torch_us"]),
                   f1(r["xgrammar_us"])] for r in d["apply"]])


# so-compile-cpu, so-fill-cpu, so-fill-cuda, ...: one block per device (compiling runs
# on the host either way: the CPU's table is the one the book shows).
for _name, _fn, _devices in (("compile", so_compile, ("cpu",)), ("fill", so_fill, SO_MICRO),
                             ("apply", so_apply, SO_MICRO)):
    for _device in _devices:
        block(f"so-{_name}-{_device}", so_micro_cmd(_device))(
            lambda res, _fn=_fn, _device=_device: _fn(res, _device))


@block("so-throughput", SO_THROUGHPUT_CMD)
def so_throughput(res: Results) -> str:
    """The standard workload, plain and with every request under a JSON schema."""
    if not (res.root / SO_THROUGHPUT).is_file():
        return NotMeasured(f"*Not measured yet: on a GPU, `bash scripts/gpu_structured_output.sh` "
                           f"(which runs `{SO_THROUGHPUT_CMD}`), then `python scripts/figures.py`.*")
    d = res(SO_THROUGHPUT)
    cost, r = d["structured_output"], d["results"]
    plain, constrained = r["mini-vllm"], r["mini-vllm-json"]
    rows = [["plain", n0(plain["output_tok_s"]), f2(plain["wall_s"]), n0(cost["steps"]["plain"]),
             "-", "-"],
            [f"JSON schema `{cost['json_schema']}`", n0(constrained["output_tok_s"]),
             f2(constrained["wall_s"]), n0(cost["steps"]["constrained"]),
             f3(cost["added_ms_per_step"]), f3(cost["metadata_ms_per_step"])]]
    return (table(["requests", "output tok/s", "wall (s)", "steps", "ms added per step",
                   "host ms per step on masks"], rows)
            + f"\n\nConstrained run: {pct(cost['output_tok_s_ratio'])} of the plain run's "
              f"throughput ({'meets' if cost['meets_bar'] else 'misses'} the 90 % bar); "
              f"{pct(cost['constrained_fraction'])} of its output tokens drawn under a mask.")


# ----------------------------------------------------------------------------- speculative decoding

SPEC_FILE = "spec_decode.json"
SPEC_CMD = ("python benchmarks/spec_decode.py --batches 1 8 32 --ks 1 2 4 6 "
            "--acceptance 0.0 0.5 0.7 0.9 --output-len 96 "
            "--output benchmarks/results/spec_decode.json")
SPEC_IMG = REPO_ROOT / "chapters" / "img" / "spec_decode.png"


def spec_report(res: Results) -> dict[str, Any] | NotMeasured:
    """The speculative decoding run, or what to run while there is none."""
    if not (res.root / SPEC_FILE).is_file():
        return NotMeasured(f"*Not measured yet: on a GPU, `{SPEC_CMD}`, then `python "
                           f"benchmarks/spec_decode.py --plot-from benchmarks/results/{SPEC_FILE}` "
                           "and `python scripts/figures.py`.*")
    return res(SPEC_FILE)


def spec_presets(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p, r) for p, r in d["results"].items() if r.get("status") == "ok"]


@block("spec-sweep", SPEC_CMD)
def spec_sweep(res: Results) -> str:
    """Speedup over plain greedy decoding at k = 4 for each acceptance, and the best k."""
    d = spec_report(res)
    if isinstance(d, NotMeasured):
        return d
    accs = sorted({x["acceptance"] for _, r in spec_presets(d) for s in r["sweep"].values()
                   for x in s["runs"]})
    rows = []
    for preset, r in spec_presets(d):
        for batch, s in sorted(r["sweep"].items(), key=lambda kv: int(kv[0])):
            cells = []
            for a in accs:
                runs = [x for x in s["runs"] if x["acceptance"] == a]
                at4 = next((x for x in runs if x["k"] == 4), None)
                best = max(runs, key=lambda x: x["speedup"])
                cells.append(f"{times(at4['speedup'], 2) if at4 else '-'} "
                             f"({times(best['speedup'], 2)}, k = {best['k']})")
            rows.append([preset, batch, n0(s["plain"]["decode_tok_s"]), *cells,
                         "yes" if s["identical_to_plain"] else "**no**"])
    header = ["shape", "batch", "plain tok/s", *(f"a = {a:g}" for a in accs),
              "same tokens"]
    image = "![Speedup against acceptance](img/spec_decode.png)\n\n" if SPEC_IMG.is_file() else ""
    return image + table(header, rows)


MODELS_CMD = ('STAGES="moe bench summary" SHAPES="qwen3-8b llama3-8b qwen2.5-7b mistral-7b '
              'qwen3-30b-a3b" bash scripts/gpu_models.sh; python benchmarks/throughput.py --preset '
              'gpt2-xl --backends mini-vllm --max-model-len 1024 --input-len-range 100 500 '
              '--max-tokens-range 100 500 (one job)')
MODEL_SHAPES = ("qwen3-8b", "llama3-8b", "mistral-7b", "qwen2.5-7b", "gpt2-xl", "qwen3-30b-a3b")


@block("models-throughput", MODELS_CMD)
def models_throughput(res: Results) -> str:
    """Each family's real shape on the standard workload (random weights), against its
    floor in bytes and FLOPs, and the distance to Qwen3-8B's fraction of its floor."""
    base = res("models/throughput_qwen3-8b.json")["results"]["mini-vllm"]["fraction_of_floor"]
    rows = []
    for shape in MODEL_SHAPES:
        d = res(f"models/throughput_{shape}.json")
        r, f = d["results"]["mini-vllm"], d["floor"]
        rows.append([f"`{shape}`", n0(r["output_tok_s"]), n0(f["floor_output_tok_s"]),
                     pct(r["fraction_of_floor"]),
                     "–" if shape == "qwen3-8b" else f"{100 * (base - r['fraction_of_floor']):.1f}"])
    return table(["shape", "output tok/s", "floor tok/s", "fraction of the floor",
                  "points below Qwen3-8B"], rows)


@block("models-moe", "python benchmarks/moe.py --output benchmarks/results/models/moe.json")
def models_moe(res: Results) -> str:
    """One Qwen3-30B-A3B MoE layer's experts (128 of 768, top 8, hidden 2,048), three ways,
    each against the bytes of the experts its tokens touch."""
    d = res("models/moe.json")
    rows = [[n0(r["tokens"]), f"{r['experts_read']:.0f}", f"{r['floor_ms']:.3f} ms",
             f"{r['reference_ms']:.2f} ms", f"{r['sorted_loop_ms']:.2f} ms",
             f"{r['grouped_ms']:.3f} ms", pct(r["grouped_fraction_of_floor"])]
            for r in d["results"]]
    return table(["tokens", "experts read", "floor", "reference loop", "sorted loop",
                  "grouped GEMM", "grouped: fraction of the floor"], rows)


@block("tp-latency", "python benchmarks/latency.py --preset qwen3-8b --backends mini-vllm "
                    "--prompt-lens 128 --output-len 32 --num-iters 2 --tensor-parallel-size N "
                    "--output benchmarks/results/tp/latency_tpN.json (N = 2, then 1, one job)")
def tp_latency(res: Results) -> str:
    """Batch-1 decode of the Qwen3-8B shape at TP = 1 and 2 on one host."""
    rows, base = [], None
    for tp in (1, 2):
        r = res(f"tp/latency_tp{tp}.json")["results"]["mini-vllm"]["by_prompt_len"]["128"]
        base = base or r["tpot_ms"]
        rows.append([str(tp), f"{r['tpot_ms']:.3f} ms", f"{r['ttft_ms']:.2f} ms",
                     "–" if tp == 1 else times(r["tpot_ms"] / base, 2)])
    return table(["TP", "decode, ms a token", "time to first token", "vs TP = 1"], rows)


@block("spec-bar", SPEC_CMD)
def spec_bar(res: Results) -> str:
    """The bar's checks: batch-1 speedup on the 8B shape, batch 32 with a missing proposer."""
    d = spec_report(res)
    if isinstance(d, NotMeasured):
        return d
    return table(["check", "measured", "met"],
                 [[c["check"], times(c["value"], 2), "yes" if c["pass"] else "**no**"]
                  for c in d["bar"]])


@block("spec-ngram", SPEC_CMD)
def spec_ngram(res: Results) -> str:
    """The n-gram proposer on prompts the output copies, in full or for half the output."""
    d = spec_report(res)
    if isinstance(d, NotMeasured):
        return d
    rows = [[preset, x["batch"], pct(x["copied_fraction"], 0),
             pct(x.get("acceptance_rate", 0.0), 0), f2(x.get("mean_acceptance_length", 1.0)),
             times(x["speedup"], 2)]
            for preset, r in spec_presets(d) for x in r["ngram"].values()]
    return table(["shape", "batch", "output copied", "proposals accepted",
                  "tokens per verification", "speedup"], rows)


@block("spec-draft", SPEC_CMD)
def spec_draft(res: Results) -> str:
    """A draft model whose every proposal is accepted: what its forwards cost."""
    d = spec_report(res)
    if isinstance(d, NotMeasured):
        return d
    rows = [[preset, x["draft_preset"], x["batch"], x["k"], times(x["speedup"], 2),
             pct(x.get("draft_time_fraction", 0.0), 0)]
            for preset, r in spec_presets(d) for x in r["draft"].values()]
    return table(["target", "draft", "batch", "k", "speedup", "draft's share of the step"], rows)


SPEC_REAL_FILE = "spec_decode_real.json"
SPEC_REAL_CMD = ("python benchmarks/spec_decode.py --presets --device cpu "
                 "--target-model mini_vllm/data/default_model "
                 "--draft-model mini_vllm/data/default_draft --output-len 64 "
                 "--output benchmarks/results/spec_decode_real.json")


@block("spec-real", SPEC_REAL_CMD)
def spec_real(res: Results) -> str:
    """Acceptance of a trained draft/target pair on text, or why there is none."""
    if not (res.root / SPEC_REAL_FILE).is_file():
        return NotMeasured(f"*Not measured yet: `{SPEC_REAL_CMD}`, then "
                           "`python scripts/figures.py`.*")
    real = res(SPEC_REAL_FILE)["real_pair"]
    if real.get("status") != "ok":
        return f"*No trained pair in this run ({real.get('status')}): " \
               f"{real.get('reason') or real.get('error')}.*"
    plain = {x["temperature"]: x for x in real["runs"] if not x["speculative"]}
    rows = [[f"{x['temperature']:g}", x["k"], pct(x["acceptance_rate"], 0),
             (f"{plain[x['temperature']]['num_target_forwards']:,} → "
              f"{x['num_target_forwards']:,}"),
             f"{x['num_tokens'] / x['num_target_forwards']:.2f}",
             pct(x["draft_time_fraction"], 0),
             ("yes" if x["identical_to_plain"] else "no") if x["temperature"] == 0 else "-"]
            for x in real["runs"] if x["speculative"]]
    return table(["temperature", "k", "proposals accepted", "target forwards",
                  "tokens per target forward", "draft's share of the time",
                  "same text as plain"], rows)


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite (or with --check, verify) every marked figure; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 and list the blocks that are out of date")
    mode.add_argument("--list", action="store_true", help="list the figures and what they are")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                   help="where the JSON lives (default: benchmarks/results)")
    ns = p.parse_args(argv)
    if ns.list:
        for name, fig in sorted(FIGURES.items()):
            kind = "value" if fig.inline else "block"
            print(f"{name} ({kind}): {fig.doc.splitlines()[0] if fig.doc else ''}")
        return 0
    try:
        stale = update(REPO_ROOT, ns.results_dir, write=not ns.check)
    except FigureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, names in stale.items():
        for name in names:
            print(f"{path}: {name} {'is out of date' if ns.check else 'rewritten'}")
    if ns.check and stale:
        print("run `python scripts/figures.py` to rewrite them from the JSON", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
