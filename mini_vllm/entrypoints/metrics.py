"""Prometheus metrics for `GET /metrics`, with vLLM's metric names under `mini_vllm:`.

Two kinds of numbers end up on the page:

- the engine's own state and totals (running / waiting requests, KV-cache
  usage, prompt and generated tokens), read from `engine.get_stats()` each
  time the page is scraped by a custom collector, so they can never drift
  from what `/stats` says;
- per-request latencies the server measures itself as it streams outputs
  (time to first token, time per output token, end-to-end latency) and the
  count of finished choices by finish reason. A request answered as a whole
  gets one output, at its end; its time to first token and per output token
  come from the engine's own timestamps in that output (`RequestOutput.metrics`).

Each app owns its `CollectorRegistry`, so two servers in one process (tests)
never share counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mini_vllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# --8<-- [start:engine_collector]
class EngineStatsCollector(Collector):
    """Turns `engine.get_stats()` into gauges and counters at scrape time."""

    # (stats key, metric name, help, kind)
    _METRICS = (
        ("num_running", "mini_vllm:num_requests_running", "Requests in the running batch.", "gauge"),
        ("num_waiting", "mini_vllm:num_requests_waiting", "Requests waiting to be scheduled.",
         "gauge"),
        ("kv_cache_usage", "mini_vllm:kv_cache_usage_perc",
         "Fraction of KV-cache blocks in use (1 = full).", "gauge"),
        ("prefix_cache_hit_rate", "mini_vllm:prefix_cache_hit_rate",
         "Fraction of queried prompt tokens found in the prefix cache.", "gauge"),
        ("prompt_tokens_total", "mini_vllm:prompt_tokens", "Prompt tokens processed.", "counter"),
        ("generation_tokens_total", "mini_vllm:generation_tokens", "Tokens generated.",
         "counter"),
        ("num_preemptions", "mini_vllm:num_preemptions", "Requests preempted.", "counter"),
        ("prefix_cache_queries", "mini_vllm:prefix_cache_queries",
         "Prompt tokens looked up in the prefix cache.", "counter"),
        ("prefix_cache_hits", "mini_vllm:prefix_cache_hits",
         "Prompt tokens found in the prefix cache.", "counter"),
        # Speculative decoding (present only when it is configured).
        ("spec_decode_num_drafts", "mini_vllm:spec_decode_num_drafts",
         "Sequence-steps that verified proposals.", "counter"),
        ("spec_decode_num_draft_tokens", "mini_vllm:spec_decode_num_draft_tokens",
         "Proposed tokens.", "counter"),
        ("spec_decode_num_accepted_tokens", "mini_vllm:spec_decode_num_accepted_tokens",
         "Proposed tokens accepted.", "counter"),
        ("spec_decode_draft_time_fraction", "mini_vllm:spec_decode_draft_time_fraction",
         "The proposer's share of the speculative steps' time.", "gauge"),
    )

    def __init__(self, get_stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        for key, name, doc, kind in self._METRICS:
            if key not in stats:
                continue
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_cls(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(stats[key]))
            yield family
# --8<-- [end:engine_collector]


class ServerMetrics:
    """The registry behind one app's `/metrics` page.

    Args:
        get_stats: the engine's `get_stats`.
        model_name: the served model name, the `model_name` label of every series.
    """

    def __init__(self, get_stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))
        labels = ["model_name"]
        self._model_name = model_name
        self.request_success = Counter(
            "mini_vllm:request_success", "Finished choices, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "mini_vllm:time_to_first_token_seconds", "Seconds from arrival to the first token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.time_per_output_token = Histogram(
            "mini_vllm:time_per_output_token_seconds",
            "Mean seconds between output tokens after the first, per request.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e_request_latency = Histogram(
            "mini_vllm:e2e_request_latency_seconds", "Seconds from arrival to the last token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def track(self, n: int, final_only: bool = False) -> RequestTimer:
        """A timer for one engine request of `n` choices, started now (`final_only`:
        its only output comes when it finishes)."""
        return RequestTimer(self, n, final_only)

    def count_finished(self, finish_reason: str) -> None:
        self.request_success.labels(self._model_name, finish_reason).inc()


# --8<-- [start:request_timer]
class RequestTimer:
    """Measures one engine request from its delta outputs.

    Call `observe(output)` for every `RequestOutput` the engine yields; when
    the last one (`finished`) arrives the latencies are recorded. Choices run
    in lockstep, so the number of decode steps is the longest choice's length.
    `abort()` counts the choices that had not finished when the request was
    aborted (its consumer cancelled) under `abort`.

    A final-only request's one output arrives when it finishes, so the server
    cannot see its first token come: its first-token and per-token times are
    the engine's (`arrival_time`, `first_token_time`, `finished_time` of the
    output's `metrics`, one clock), and its end-to-end latency the server's.
    """

    def __init__(self, metrics: ServerMetrics, n: int, final_only: bool = False) -> None:
        self._metrics = metrics
        self._final_only = final_only
        self._arrival = time.perf_counter()
        self._first_token: float | None = None
        self._tokens: dict[int, int] = {}
        self._unfinished = set(range(n))

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        # (arrival, first token, now) on one clock: the server's, or the engine's.
        stamps = output.metrics
        engine_clock = self._final_only and output.finished and {
            "arrival_time", "first_token_time", "finished_time"} <= stamps.keys()
        for completion in output.outputs:
            if completion.token_ids:
                self._tokens[completion.index] = (
                    self._tokens.get(completion.index, 0) + len(completion.token_ids))
                if self._first_token is None:
                    self._first_token = now
                    self._metrics.time_to_first_token.observe(
                        stamps["first_token_time"] - stamps["arrival_time"] if engine_clock
                        else now - self._arrival)
            if completion.finish_reason is not None:
                self._unfinished.discard(completion.index)
                self._metrics.count_finished(completion.finish_reason)
        if output.finished:
            self._metrics.e2e_request_latency.observe(now - self._arrival)
            steps = max(self._tokens.values(), default=0)
            if self._first_token is not None and steps > 1:
                first, last = ((stamps["first_token_time"], stamps["finished_time"])
                               if engine_clock else (self._first_token, now))
                self._metrics.time_per_output_token.observe((last - first) / (steps - 1))

    def abort(self) -> None:
        for _ in self._unfinished:
            self._metrics.count_finished("abort")
        self._unfinished.clear()
# --8<-- [end:request_timer]
