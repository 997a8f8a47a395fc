"""Plot the committed benchmark results: the figures of the chapter "Going fast".

Reads the JSON that `throughput.py`, `latency.py` and `step_profile.py` wrote
into `benchmarks/results/` and draws four PNGs (needs matplotlib):

- `throughput.png`: output tok/s of each backend against the floor and the bar
  (80 % of the floor, and 30,000 tok/s), all from `throughput.json`;
- `latency.png`: batch-1 decode ms per token and time to first token against
  prompt length, each with its floor (`latency.json`);
- `step_gpu.png`: GPU time of one decode step by kernel group at batch 256 and
  batch 1, against the step's floor (`step_profile.json`, `step_profile_b1.json`);
- `host_overlap.png`: a batch-256 engine step with its host work serialised
  against the same step with async scheduling (`step_profile.json`).

    python benchmarks/plot.py                      # -> chapters/img/*.png
    python benchmarks/plot.py --out-dir /some/dir  # elsewhere
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
IMG_DIR = REPO_ROOT / "chapters" / "img"

# Bar colours: ours, a peer, the floor, and neutral parts.
OURS, PEER, FLOOR, GREY = "#3f51b5", "#e07b39", "#2e7d32", "#9e9e9e"
# The throughput target's absolute part (chapter 9): 30,000 output tok/s on an H200,
# beside 80 % of the floor.
BAR_TOK_S = 30_000


def load(name: str, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """One benchmark's JSON from `results_dir`."""
    return json.loads((results_dir / name).read_text())


def plot_throughput(data: dict[str, Any], out: Path) -> None:
    """Output tok/s of every backend that ran, the floor, 80 % of it and the bar's
    30,000 tok/s."""
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in data["results"].items() if v.get("status") == "ok"}
    floor = data["floor"]["floor_output_tok_s"]
    names = [*ran, "floor"]
    values = [v["output_tok_s"] for v in ran.values()] + [floor]
    colours = [OURS if n == "mini-vllm" else PEER for n in ran] + [FLOOR]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    bars = ax.barh(names, values, color=colours)
    ax.axvline(0.8 * floor, color=FLOOR, linestyle="--", linewidth=1)
    ax.text(0.8 * floor, -0.55, "80 % of the floor ", color=FLOOR, fontsize=8,
            va="bottom", ha="right")
    ax.axvline(BAR_TOK_S, color=GREY, linestyle=":", linewidth=1)
    ax.text(BAR_TOK_S, -0.55, f" {BAR_TOK_S:,} tok/s", color=GREY, fontsize=8,
            va="bottom", ha="left")
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:,.0f}",
                va="center", fontsize=8)
    bw = data["copy_bandwidth"]["bandwidth_bytes_per_s"] / 1e12
    ax.set_xlabel("output tokens / s")
    ax.set_xlim(0, floor * 1.18)
    ax.set_ylim(len(names) - 0.5, -0.75)  # top to bottom, room for the label above
    ax.set_title(f"Standard workload, {data['environment']['gpu']} "
                 f"(floor from {bw:.2f} TB/s copy bandwidth)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_latency(data: dict[str, Any], out: Path) -> None:
    """TPOT and TTFT at batch 1 against prompt length, with their floors (log scale)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    lens = sorted(data["floors"], key=int)
    x = [int(n) for n in lens]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2))
    for ax, metric, floor_key, title in (
        (axes[0], "tpot_ms", "decode_floor_ms", "decode, ms per output token"),
        (axes[1], "ttft_ms", "ttft_floor_ms", "time to first token, ms"),
    ):
        for backend, colour in (("mini-vllm", OURS), ("transformers", PEER)):
            res = data["results"].get(backend, {})
            if res.get("status") != "ok":
                continue
            ax.plot(x, [res["by_prompt_len"][n][metric] for n in lens], "o-", color=colour,
                    label=backend)
        ax.plot(x, [data["floors"][n][floor_key] for n in lens], "s--", color=FLOOR,
                label="floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xticks(x, [str(n) for n in x])
        ax.set_xlabel("prompt tokens")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _step_groups(runner: dict[str, Any]) -> dict[str, float]:
    """GPU ms of one decode step by kernel group, from the named top kernels.

    Kernels are grouped by name (the profile's own categories are keyword
    guesses); whatever the top-kernel list does not name goes to "rest".
    """
    groups = {"decode attention": 0.0, "matmuls": 0.0, "fused norm / RoPE / SiLU": 0.0,
              "KV write": 0.0, "rest of the graph": 0.0}
    for k in runner["top_kernels"]:
        name, ms = k["kernel"], k["ms_per_step"]
        if "paged_attention" in name or "combine_splits" in name:
            groups["decode attention"] += ms
        elif name.startswith("nvjet") or "cublas" in name.lower() or "gemm" in name.lower():
            groups["matmuls"] += ms
        elif any(s in name for s in ("rms_norm", "qk_norm_rope", "silu_and_mul")):
            groups["fused norm / RoPE / SiLU"] += ms
        elif "reshape_and_cache" in name:
            groups["KV write"] += ms
    named = sum(groups.values())
    groups["rest of the graph"] = max(runner["graph_replay_gpu_ms"] - named, 0.0)
    groups["sampler (outside the graph)"] = runner["sampler_gpu_ms"]
    return groups


def plot_step_gpu(b256: dict[str, Any], b1: dict[str, Any], out: Path) -> None:
    """Stacked GPU ms per decode step at two batch sizes, each beside its floor."""
    import matplotlib.pyplot as plt

    colours = ["#3f51b5", "#e07b39", "#8e24aa", "#00897b", GREY, "#c62828"]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, prof in ((axes[0], b256), (axes[1], b1)):
        runner = prof["runner"]
        groups = _step_groups(runner)
        left = 0.0
        for (name, ms), colour in zip(groups.items(), colours):
            ax.barh(["mini-vllm"], [ms], left=left, color=colour, label=name)
            left += ms
        ax.barh(["floor"], [runner["floor_ms"]], color=FLOOR)
        ax.text(left, 0, f" {left:.2f} ms", va="center", fontsize=8)
        ax.text(runner["floor_ms"], 1, f" {runner['floor_ms']:.2f} ms", va="center", fontsize=8)
        ax.set_xlim(0, left * 1.25)
        ax.invert_yaxis()
        ax.set_xlabel("GPU ms per decode step")
        ax.set_title(f"batch {runner['batch']} x context {runner['context']}", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_host_overlap(prof: dict[str, Any], out: Path) -> None:
    """One engine step at batch 256: host phases + GPU wait in series, then overlapped."""
    import matplotlib.pyplot as plt

    eng, runner = prof["engine"], prof["runner"]
    # In the order they run when a sync follows the sampler.
    parts = [("schedule", eng["schedule_ms"], "#5c6bc0"),
             ("build entries", eng["build_entries_ms"], "#7986cb"),
             ("runner host", eng["execute_host_ms"], "#9fa8da"),
             ("sampling metadata", eng["sampling_metadata_ms"], "#b39ddb"),
             ("sampler launch", eng["sampler_host_ms"], "#ce93d8"),
             ("waiting for the GPU", eng["wait_gpu_ms"], GREY),
             ("post-process", eng["postprocess_ms"], "#f48fb1")]
    fig, ax = plt.subplots(figsize=(8.4, 2.9))
    left = 0.0
    for name, ms, colour in parts:
        ax.barh(["serialised"], [ms], left=left, color=colour, label=name)
        left += ms
    ax.text(eng["step_wall_ms"], 0, f" {eng['step_wall_ms']:.1f} ms", va="center", fontsize=8)
    ax.barh(["async"], [eng["step_wall_as_configured_ms"]], color=OURS)
    ax.text(eng["step_wall_as_configured_ms"], 1,
            f" {eng['step_wall_as_configured_ms']:.1f} ms", va="center", fontsize=8)
    gpu = runner["graph_replay_gpu_ms"] + runner["sampler_gpu_ms"]
    ax.barh(["GPU work"], [gpu], color=FLOOR)
    ax.text(gpu, 2, f" {gpu:.1f} ms", va="center", fontsize=8)
    ax.set_xlim(0, eng["step_wall_ms"] * 1.15)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per engine step (batch {eng['batch']}, context {eng['context']})")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=4, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--out-dir", type=Path, default=IMG_DIR)
    ns = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    step_b256 = load("step_profile.json", ns.results_dir)
    plot_throughput(load("throughput.json", ns.results_dir), ns.out_dir / "throughput.png")
    plot_latency(load("latency.json", ns.results_dir), ns.out_dir / "latency.png")
    plot_step_gpu(step_b256, load("step_profile_b1.json", ns.results_dir),
                  ns.out_dir / "step_gpu.png")
    plot_host_overlap(step_b256, ns.out_dir / "host_overlap.png")
    print(f"figures in {ns.out_dir}")


if __name__ == "__main__":
    main()
