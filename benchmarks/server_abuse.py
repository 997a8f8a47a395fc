"""A small request's latency while one request tries to take the whole server.

Starts the OpenAI server in this process (the tiny random-weight model on the CPU
by default), then measures the end-to-end latency of a small completion
(`max_tokens` 8, greedy), sent one after another:

- alone: nothing else running (the median of `--count`);
- during "n": one request with `n` = `--max-n-sequences` and long outputs;
- during "prompts": one request with `--num-prompts` prompts of nearly the
  context's length.

During an abuse `--count` small requests go one after another, the first
`--lead` seconds after the big request; the table gives the first one's latency
and the slowest one's.

Each abuse runs twice: with the server's fair admission (`entrypoints/admission.py`:
units ranked inside their request, the bulk behind the fair gate) and with it
switched off (every unit at priority 0 and no gate: first come, first served), in
the same process, on the same engine. Writes the figures as JSON and the chapter's
table as Markdown:

    python benchmarks/server_abuse.py                          # CPU, tiny model
    python benchmarks/server_abuse.py --device cuda --preset qwen3-0.6b \\
        --max-model-len 4096 --max-num-seqs 256 --num-prompts 500 \\
        --output benchmarks/results/server_limits/abuse_h100.json
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, format_table, prepare_model_dir, write_json

from mini_vllm.config import EngineArgs
from mini_vllm.engine.async_engine import AsyncLLM
from mini_vllm.entrypoints import serving_engine
from mini_vllm.entrypoints.admission import FairGate, Unit, split_units
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.openai_server import build_app, make_server

MODEL = "abuse-test"
SMALL = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0}


def _fcfs_units(num_prompts: int, n: int, *sizes: int) -> list[Unit]:
    """Every unit at rank 0: all of a request goes in at once, at priority 0."""
    return [Unit(u.prompt_index, u.first_choice, u.n, 0)
            for u in split_units(num_prompts, n, *sizes)]


def _small_latencies(base: str, count: int) -> list[float]:
    latencies = []
    with httpx.Client(timeout=600) as http:
        for _ in range(count):
            start = time.perf_counter()
            response = http.post(base + "/v1/completions", json=SMALL)
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
    return latencies


def _run_abuse(base: str, body: dict[str, Any], count: int, lead_s: float) -> dict[str, Any]:
    """Send `body` (the abuse), wait `lead_s`, then time `count` small requests."""
    done: dict[str, float] = {}

    def abuse() -> None:
        start = time.perf_counter()
        with httpx.Client(timeout=3600) as http:
            http.post(base + "/v1/completions", json={"model": MODEL, **body}).raise_for_status()
        done["abuse_s"] = time.perf_counter() - start

    thread = threading.Thread(target=abuse)
    thread.start()
    time.sleep(lead_s)
    latencies = _small_latencies(base, count)
    abuse_still_running = "abuse_s" not in done
    thread.join()
    return {"small_latency_s": latencies, "small_median_s": statistics.median(latencies),
            "small_max_s": max(latencies), "abuse_s": done["abuse_s"],
            "abuse_still_running_after_small": abuse_still_running}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a preset)")
    parser.add_argument("--preset", default="tiny", help="random-weight preset without --model")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-model-len", type=int, default=256, help="context length")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="running batch")
    parser.add_argument("--max-n-sequences", type=int, default=128, help="n of the 'n' abuse")
    parser.add_argument("--num-prompts", type=int, default=500,
                        help="prompts of the 'prompts' abuse")
    parser.add_argument("--count", type=int, default=5, help="small requests per measurement")
    parser.add_argument("--lead", type=float, default=1.0,
                        help="seconds between the abuse and the first small request")
    parser.add_argument("--output", default=str(RESULTS_DIR / "server_limits" / "abuse_cpu.json"),
                        help="JSON to write (the Markdown table goes beside it, .md)")
    ns = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as work:
        model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(work))
        engine = AsyncLLM(EngineArgs(
            model=str(model_dir), load_format=load_format, device=ns.device,
            max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
            engine_process=None if ns.device != "cpu" else False).create_engine_config())
        args = FrontendArgs(max_n_sequences=ns.max_n_sequences,
                            max_completion_prompts=max(ns.num_prompts, 1),
                            max_queued_seqs=max(ns.num_prompts, ns.max_n_sequences) * 2)
        app = build_app(engine, served_model_name=MODEL, args=args)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = make_server(app, "127.0.0.1", port, log_level="warning", access_log=False,
                             args=args)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        prompt_len = ns.max_model_len - 16
        abuses = {
            "n": {"prompt": "Once upon a time", "n": ns.max_n_sequences,
                  "max_tokens": ns.max_model_len // 2, "ignore_eos": True},
            "prompts": {"prompt": [[7 + i % 50] * prompt_len for i in range(ns.num_prompts)],
                        "max_tokens": 8, "ignore_eos": True},
        }
        _small_latencies(base, 2)  # warm-up
        idle = _small_latencies(base, ns.count)
        rows: list[dict[str, Any]] = []
        results: dict[str, Any] = {"idle_latency_s": idle}
        admission = app.state.context.admission
        fair_gate = admission.bulk
        for policy in ("fair", "fcfs"):
            if policy == "fcfs":  # switch the fair admission off, for comparison only
                serving_engine.split_units = _fcfs_units  # type: ignore[assignment]
                admission.bulk = FairGate(capacity=10**9)
            for name, body in abuses.items():
                result = _run_abuse(base, body, ns.count, ns.lead)
                results[f"{policy}/{name}"] = result
                rows.append({"abuse": name, "admission": policy,
                             "small alone (s)": statistics.median(idle),
                             "first small during it (s)": result["small_latency_s"][0],
                             "slowest small (s)": result["small_max_s"],
                             "big request took (s)": result["abuse_s"]})
                print(rows[-1], flush=True)
            serving_engine.split_units = split_units  # type: ignore[assignment]
            admission.bulk = fair_gate
        server.should_exit = True
        thread.join(timeout=30)

    table = format_table(rows, ["abuse", "admission", "small alone (s)",
                                "first small during it (s)", "slowest small (s)",
                                "big request took (s)"])
    config = {k: v for k, v in vars(ns).items() if k != "output"}
    out = write_json(ns.output, {"config": config, "environment": environment(ns.device),
                                 "results": results, "table": rows})
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
