"""Online serving: latency and throughput of an OpenAI-compatible server under load.

What it measures: requests of the offline workload (`common.make_workload`: prompts of
random token ids, EOS ignored, each request's own max_tokens) sent to
`POST /v1/completions` with `stream: true`, arriving as a Poisson process at each
`--request-rates` value (`inf` sends them all at once). For each rate:

- TTFT: time to first token (the first streamed chunk that carries text);
- TPOT: time per output token after the first, per request: (latency - TTFT) /
  (output tokens - 1), with output tokens from the stream's final `usage`;
- ITL: gaps between consecutive streamed chunks (a chunk may hold more than one token
  when a token's text is not complete UTF-8 on its own);
- mean, median and p99 of each, end-to-end latency, request and output-token
  throughput (over the time from the first request sent to the last one finished), and
  the failed requests.

With `--launch` it starts `mini-vllm serve` itself on a free loopback port, waits for
`/health`, runs, and stops the server. With `--compare-offline` it first runs the
offline engine on the same requests (in a subprocess, before the server holds the GPU)
and reports how close the HTTP stream's output throughput at the highest rate comes to it.

On a GPU (random Qwen3-0.6B weights; one command measures our server):

    python benchmarks/serving.py --launch --compare-offline
    python benchmarks/serving.py --launch --request-rates 4 inf --num-requests 256
    python benchmarks/serving.py --launch --request-rates 16 --max-piecewise-graph-tokens 0 \
        --output benchmarks/results/piecewise/serving_16_eager_prefill.json  # no piecewise graphs

Against any running OpenAI-compatible server:

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model qwen3

Whole responses instead of streams (`stream: false`; no TTFT, TPOT or ITL then, only
throughput and end-to-end latency):

    python benchmarks/serving.py --launch --no-stream --request-rates inf --num-requests 256 \
        --compare-offline --output benchmarks/results/final_only/serving_no_stream.json

On a CPU (a smoke run of the tiny model):

    python benchmarks/serving.py --launch --preset tiny --device cpu --num-requests 4 \\
        --input-len-range 8 16 --max-tokens-range 4 8 --request-rates inf

The client uses aiohttp when it is installed, else httpx. Results: a table on stdout
(last) and JSON in `--output` (default `benchmarks/runs/serving.json`, which git ignores).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `mini_vllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_SEED,
    RUNS_DIR,
    TEMPERATURE,
    Workload,
    environment,
    error_text,
    format_table,
    kill_process_group,
    make_workload,
    prepare_model_dir,
    resolve_device,
    resolve_dtype_name,
    subprocess_env,
    write_json,
)
from mini_vllm.engine.heap import heap_frozen

if TYPE_CHECKING:
    from typing_extensions import Self

PERCENTILES = (50, 90, 99)
# How long the client keeps an idle connection for the next request. Below the 5 s
# after which uvicorn (our server's, and vLLM's by default) closes an idle one:
# otherwise, at a low request rate, a request can go out on a connection the
# server is closing at that moment and fail with "Server disconnected".
CLIENT_KEEPALIVE_S = 3.0


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    srv = p.add_argument_group("server")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000",
                     help="the server to measure (ignored with --launch)")
    srv.add_argument("--endpoint", default="/v1/completions")
    srv.add_argument("--model", default=None,
                     help="with --launch: the checkpoint directory (default: --preset); "
                          "without: the model name to send (default: the server's first)")
    srv.add_argument("--served-model-name", default=None, help="the model name to send")
    srv.add_argument("--launch", action="store_true",
                     help="start `mini-vllm serve` on a free loopback port, stop it after")
    srv.add_argument("--preset", default="qwen3-0.6b", help="random-weight preset (--launch)")
    srv.add_argument("--write-weights", action="store_true",
                     help="write the preset's random weights instead of load_format dummy")
    srv.add_argument("--launch-timeout", type=float, default=900.0,
                     help="seconds to wait for the launched server's /health")
    srv.add_argument("--compare-offline", action="store_true",
                     help="also run the offline engine on the same requests (--launch)")
    srv.add_argument("--vocab-size", type=int, default=None,
                     help="fold token ids into a small vocabulary (automatic with --launch)")
    eng = p.add_argument_group("engine of the launched server")
    eng.add_argument("--device", default="auto")
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--max-model-len", type=int, default=4096)
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--enforce-eager", action="store_true")
    eng.add_argument("--max-piecewise-graph-tokens", type=int, default=None,
                     help="steps with prompts of up to this many tokens replay piecewise "
                          "CUDA graphs (0: they run eagerly; default: the engine's)")
    eng.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="the engine core in its own process (default: the server's, "
                          "on with CUDA) or on a thread of the server")
    eng.add_argument("--load-format", default=None, choices=("auto", "dummy"))
    load = p.add_argument_group("load")
    load.add_argument("--request-rates", nargs="+", default=["1", "4", "16", "inf"],
                      help="requests per second (Poisson arrivals); inf = all at once")
    load.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    load.add_argument("--input-len-range", type=int, nargs=2, default=list(DEFAULT_INPUT_LEN),
                      metavar=("LO", "HI"))
    load.add_argument("--max-tokens-range", type=int, nargs=2,
                      default=list(DEFAULT_OUTPUT_LEN), metavar=("LO", "HI"))
    load.add_argument("--seed", type=int, default=DEFAULT_SEED)
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight (default: no limit)")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds one request may take")
    load.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                      help="stream each response (--no-stream: whole responses, timed to "
                           "their end only)")
    p.add_argument("--output", default=str(RUNS_DIR / "serving.json"),
                   help="where to write the JSON results (default: benchmarks/runs/, which "
                        "git ignores)")
    return p


# --8<-- [start:metrics]
@dataclass
class RequestResult:
    """One request, as the client saw it.

    Attributes:
        success: the stream ended with `[DONE]` and no error (a whole response:
            status 200 with its choices).
        prompt_len: prompt tokens sent.
        output_tokens: completion tokens (the final `usage`, else text chunks counted).
        start: when the request was sent (`time.perf_counter()`).
        ttft: seconds to the first chunk with text.
        latency: seconds to the end of the stream.
        chunk_times: arrival time of every chunk with text.
        error: why it failed.
        streamed: False for a whole response, which has no TTFT, TPOT or ITL.
    """

    success: bool
    prompt_len: int
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""
    streamed: bool = True

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None for a one-token output or a
        whole response."""
        if self.output_tokens < 2 or not self.streamed:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def result_from_events(prompt_len: int, start: float, events: Sequence[tuple[float, str]]
                       ) -> RequestResult:
    """Turn a stream's Server-Sent Events into a `RequestResult`.

    Args:
        prompt_len: prompt tokens sent.
        start: when the request was sent.
        events: `(arrival time, data)` for each `data:` line, `[DONE]` included.
    """
    chunk_times: list[float] = []
    first_choice: float | None = None
    usage_tokens: int | None = None
    text_chunks = 0
    done_at: float | None = None
    for t, data in events:
        if data.strip() == "[DONE]":
            done_at = t
            break
        obj = json.loads(data)
        if "error" in obj:
            msg = obj["error"].get("message") if isinstance(obj["error"], dict) else obj["error"]
            return RequestResult(False, prompt_len, start=start, error=f"server: {msg}")
        if obj.get("usage"):
            usage_tokens = obj["usage"].get("completion_tokens")
        for choice in obj.get("choices") or []:
            first_choice = t if first_choice is None else first_choice
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                text_chunks += 1
                chunk_times.append(t)
                break
    if done_at is None:
        return RequestResult(False, prompt_len, start=start,
                             error="the stream ended without [DONE]")
    first = chunk_times[0] if chunk_times else first_choice
    if first is None:
        return RequestResult(False, prompt_len, start=start, error="no output chunk")
    return RequestResult(True, prompt_len,
                         output_tokens=usage_tokens if usage_tokens is not None else text_chunks,
                         start=start, ttft=first - start, latency=done_at - start,
                         chunk_times=chunk_times)


def distribution(values: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    """Mean, median, std and percentiles of `values` x `scale` (None when empty).

    Percentiles interpolate linearly between order statistics (numpy's default).
    """
    keys = ["mean", "median", "std", *(f"p{q}" for q in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    xs = sorted(v * scale for v in values)
    out: dict[str, float | None] = {"mean": statistics.fmean(xs),
                                    "median": statistics.median(xs),
                                    "std": statistics.pstdev(xs)}
    for q in PERCENTILES:
        pos = (len(xs) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Aggregate one run: throughputs over `duration_s`, latency distributions in ms."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "duration_s": duration_s,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": distribution([r.ttft for r in ok if r.streamed]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2el_ms": distribution([r.latency for r in ok]),
    }
# --8<-- [end:metrics]


# --8<-- [start:client]
class _StreamClient:
    """POST a JSON body and yield the response's `data:` payloads (aiohttp or httpx)."""

    def __init__(self, timeout_s: float, max_connections: int | None) -> None:
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._session: Any = None
        try:
            import aiohttp  # noqa: F401

            self.library = "aiohttp"
        except ImportError:
            import httpx  # noqa: F401

            self.library = "httpx"

    async def __aenter__(self) -> Self:
        if self.library == "aiohttp":
            import aiohttp

            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.max_connections or 0,
                                               keepalive_timeout=CLIENT_KEEPALIVE_S))
        else:
            import httpx

            self._session = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=self.max_connections,
                                    max_keepalive_connections=self.max_connections,
                                    keepalive_expiry=CLIENT_KEEPALIVE_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.library == "aiohttp":
            await self._session.close()
        else:
            await self._session.aclose()

    async def stream(self, url: str, body: dict[str, Any]) -> AsyncIterator[str]:
        """Yield each `data:` payload of the event stream; raise on an HTTP error status."""
        if self.library == "aiohttp":
            async with self._session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if line.startswith("data:"):
                        yield line[5:].strip()
        else:
            async with self._session.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: "
                                       f"{(await resp.aread()).decode()[:300]}")
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        yield line[5:].strip()

    async def post_json(self, url: str, body: dict[str, Any]) -> Any:
        """POST `body` and parse the JSON response; raise on an HTTP error status."""
        if self.library == "aiohttp":
            async with self._session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                return await resp.json()
        resp = await self._session.post(url, json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    async def get_json(self, url: str) -> Any:
        """GET `url` and parse its JSON body."""
        if self.library == "aiohttp":
            async with self._session.get(url) as resp:
                return await resp.json()
        resp = await self._session.get(url)
        return resp.json()


async def send_request(client: _StreamClient, url: str, model: str, prompt: list[int],
                       max_tokens: int, stream: bool = True) -> RequestResult:
    """Send one completion request: a stream whose chunks are timed, or (`stream`
    False) a whole response, timed to its end."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    events: list[tuple[float, str]] = []
    whole: dict[str, Any] = {}

    async def collect() -> None:
        if not stream:
            whole.update(await client.post_json(url, body))
            return
        async for data in client.stream(url, body):
            events.append((time.perf_counter(), data))
            if data == "[DONE]":
                break

    start = time.perf_counter()
    try:  # the whole request is bounded, however slowly its bytes trickle in
        await asyncio.wait_for(collect(), timeout=client.timeout_s)
    except asyncio.TimeoutError:
        return RequestResult(False, len(prompt), start=start,
                             error=f"no complete response within {client.timeout_s} s")
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        return RequestResult(False, len(prompt), start=start, error=error_text(e))
    if stream:
        return result_from_events(len(prompt), start, events)
    if not whole.get("choices") or not whole.get("usage"):
        return RequestResult(False, len(prompt), start=start, streamed=False,
                             error=f"not a completion: {json.dumps(whole)[:200]}")
    return RequestResult(True, len(prompt), output_tokens=whole["usage"]["completion_tokens"],
                         start=start, latency=time.perf_counter() - start, streamed=False)
# --8<-- [end:client]


# --8<-- [start:poisson]
async def run_at_rate(client: _StreamClient, url: str, model: str, workload: Workload,
                      rate: float, seed: int, max_concurrency: int | None,
                      stream: bool = True) -> dict[str, Any]:
    """Send every request of `workload`, Poisson arrivals at `rate` per second.

    The gaps between sends are exponential with mean `1 / rate` (none at `inf`); a
    request is sent at its arrival time whatever is still running, unless
    `max_concurrency` requests are in flight.
    """
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(prompt: list[int], max_tokens: int) -> RequestResult:
        if limit is None:
            return await send_request(client, url, model, prompt, max_tokens, stream)
        async with limit:
            return await send_request(client, url, model, prompt, max_tokens, stream)

    tasks = []
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    metrics = compute_metrics(results, time.perf_counter() - start)
    return {"request_rate": rate if math.isfinite(rate) else "inf", "stream": stream,
            **metrics}
# --8<-- [end:poisson]


async def run_benchmark(ns: argparse.Namespace, base_url: str, model: str | None,
                        workload: Workload, rates: list[float], report: dict[str, Any]
                        ) -> None:
    """A warm-up request, then one run per rate, each appended to `report["runs"]` as it
    ends (a later failure keeps the earlier runs). The client's heap is frozen meanwhile
    (mini_vllm/engine/heap.py): its own collector's pauses must not be timed as the
    server's."""
    url = base_url.rstrip("/") + ns.endpoint
    with heap_frozen():
        async with _StreamClient(ns.request_timeout, ns.max_concurrency) as client:
            report["client"] = client.library
            if model is None:
                listing = await client.get_json(base_url.rstrip("/") + "/v1/models")
                model = listing["data"][0]["id"]
            report["model"] = model
            warm = await send_request(client, url, model, workload.prompts[0][:32], 4, ns.stream)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
            runs = report.setdefault("runs", [])
            for rate in rates:
                print(f"request rate {rate}: {workload.num_requests} requests ...", flush=True)
                runs.append(await run_at_rate(client, url, model, workload, rate, ns.seed,
                                              ns.max_concurrency, ns.stream))


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_flags(ns: argparse.Namespace) -> list[str]:
    flags = ["--device", ns.device, "--dtype", ns.dtype, "--max-num-seqs", str(ns.max_num_seqs),
             "--max-model-len", str(ns.max_model_len),
             "--gpu-memory-utilization", str(ns.gpu_memory_utilization),
             "--load-format", ns.load_format]
    if ns.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(ns.max_num_batched_tokens)]
    if ns.enforce_eager:
        flags.append("--enforce-eager")
    if ns.max_piecewise_graph_tokens is not None:
        flags += ["--max-piecewise-graph-tokens", str(ns.max_piecewise_graph_tokens)]
    if ns.engine_process is not None:
        flags.append("--engine-process" if ns.engine_process else "--no-engine-process")
    return flags


# --8<-- [start:launch]
@contextmanager
def launched_server(model_dir: Path, ns: argparse.Namespace, served_name: str,
                    log_path: Path) -> Iterator[str]:
    """Run `mini-vllm serve` on a free loopback port until the block ends.

    Yields the base URL once `/health` answers 200. Raises RuntimeError when the
    server exits or is not healthy within `--launch-timeout` (with its log's tail).
    """
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mini_vllm", "serve", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
           "--log-level", "warning", "--disable-uvicorn-access-log", *_engine_flags(ns)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=subprocess_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + ns.launch_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}:\n"
                                   + _tail(log_path))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy after {ns.launch_timeout} s:\n"
                                   + _tail(log_path))
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        yield base
    finally:
        kill_process_group(proc, grace_s=30.0)
# --8<-- [end:launch]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_offline(model_dir: Path, ns: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The offline engine on the same requests: `throughput.py` in a subprocess."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "throughput.py"),
           "--model", str(model_dir), "--load-format", ns.load_format, "--backends", "mini-vllm",
           "--num-requests", str(ns.num_requests),
           "--input-len-range", *map(str, ns.input_len_range),
           "--max-tokens-range", *map(str, ns.max_tokens_range), "--seed", str(ns.seed),
           "--device", ns.device, "--dtype", ns.dtype, "--max-num-seqs", str(ns.max_num_seqs),
           "--max-model-len", str(ns.max_model_len),
           "--gpu-memory-utilization", str(ns.gpu_memory_utilization),
           "--no-isolate", "--output", str(out)]
    if ns.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(ns.max_num_batched_tokens)]
    if ns.enforce_eager:
        cmd.append("--enforce-eager")
    proc = subprocess.run(cmd, env=subprocess_env(), timeout=ns.launch_timeout + 1800,
                          check=False)
    if not out.is_file():
        return {"status": "error", "error": f"throughput.py exited with {proc.returncode}"}
    return json.loads(out.read_text())["results"]["mini-vllm"]


def print_report(report: dict[str, Any]) -> None:
    """Print one table row per request rate, and the comparison with the offline engine."""
    rows = []
    for run in report.get("runs", []):
        row = {"rate": run["request_rate"], "done": run["completed"], "failed": run["failed"],
               "req/s": run["request_throughput"], "out tok/s": run["output_throughput"]}
        for name in ("ttft", "tpot", "itl", "e2el"):
            d = run[f"{name}_ms"]
            row.update({f"{name.upper()} mean": d["mean"], f"{name.upper()} med": d["median"],
                        f"{name.upper()} p99": d["p99"]})
        rows.append(row)
    cmp = report.get("http_vs_offline")
    if cmp:
        how = "streaming" if report["args"]["stream"] else "whole responses"
        print(f"HTTP {how} at rate {cmp['request_rate']}: {cmp['http_output_tok_s']:,.1f} "
              f"output tok/s = {100 * cmp['fraction']:.1f} % of the offline engine's "
              f"{cmp['offline_output_tok_s']:,.1f} on the same requests")
    print(f"\n{report['workload']['num_requests']} requests per rate, "
          f"{report['workload']['prompt_tokens']:,} prompt / "
          f"{report['workload']['output_tokens']:,} output tokens, client {report['client']}; "
          "times in ms")
    print(format_table(rows, ["rate", "done", "failed", "req/s", "out tok/s",
                              "TTFT mean", "TTFT med", "TTFT p99", "TPOT mean", "TPOT med",
                              "TPOT p99", "ITL mean", "ITL med", "ITL p99", "E2EL med",
                              "E2EL p99"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the report that is also written to `--output`."""
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    rates = [float(r) for r in ns.request_rates]
    if any(not r > 0 for r in rates):
        raise SystemExit("--request-rates must be positive (or inf)")
    if ns.compare_offline and not ns.launch:
        raise SystemExit("--compare-offline needs --launch (the engine runs the model "
                         "directory the server would)")
    report: dict[str, Any] = {"benchmark": "serving", "args": vars(ns)}
    with tempfile.TemporaryDirectory(prefix="mini-vllm-bench-") as tmp:
        vocab = ns.vocab_size
        model_dir: Path | None = None
        if ns.launch:
            ns.device = resolve_device(ns.device)
            ns.dtype = resolve_dtype_name(ns.dtype, ns.device)
            model_dir, load_format = prepare_model_dir(ns.model, ns.preset, Path(tmp),
                                                       write_weights=ns.write_weights)
            ns.load_format = ns.load_format or load_format
            vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
        workload = make_workload(ns.num_requests, tuple(ns.input_len_range),
                                 tuple(ns.max_tokens_range), ns.seed, vocab)
        report["workload"] = {**workload.summary(), "seed": ns.seed,
                              "temperature": TEMPERATURE, "ignore_eos": True}
        report["environment"] = environment(resolve_device(ns.device))
        try:
            if ns.compare_offline:
                print("offline engine on the same requests ...", flush=True)
                report["offline"] = run_offline(model_dir, ns, Path(tmp) / "offline.json")
            if ns.launch:
                served = ns.served_model_name or (model_dir.name if ns.model else ns.preset)
                print(f"starting mini-vllm serve ({served}) ...", flush=True)
                with launched_server(model_dir, ns, served, Path(tmp) / "server.log") as base:
                    report["base_url"] = base
                    asyncio.run(run_benchmark(ns, base, served, workload, rates, report))
            else:
                report["base_url"] = ns.base_url
                model = ns.served_model_name or ns.model
                asyncio.run(run_benchmark(ns, ns.base_url, model, workload, rates, report))
            report["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - the JSON records why the run ended
            report["status"] = "error"
            report["error"] = str(e)[-4000:]
            print(f"error: {e}", file=sys.stderr)
    offline = report.get("offline") or {}
    if report.get("runs") and offline.get("status") == "ok":
        last = max(report["runs"], key=lambda r: float(r["request_rate"]))
        report["http_vs_offline"] = {
            "request_rate": last["request_rate"],
            "http_output_tok_s": last["output_throughput"],
            "offline_output_tok_s": offline["output_tok_s"],
            "fraction": last["output_throughput"] / offline["output_tok_s"]}
    write_json(ns.output, report)
    print(f"wrote {ns.output}")
    if report.get("runs"):
        print_report(report)
    return report


if __name__ == "__main__":
    main()
