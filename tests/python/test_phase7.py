"""Phase 7: the OpenAI-compatible server and the `mini-vllm` command line.

A real uvicorn server runs the tiny model on a free loopback port in a
background thread; the tests talk to it with the official `openai` client,
and with raw `httpx` where the client cannot express a case (malformed JSON,
SSE bytes, a client that hangs up). The CLI is driven in-process through
`main()` and, for `chat` and for shutdown on SIGTERM, as a real subprocess.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import free_port, serving

import mini_vllm
from mini_vllm import cli
from mini_vllm.cli import main
from mini_vllm.config import EngineArgs
from mini_vllm.engine.async_engine import AsyncLLM, RequestFailedError
from mini_vllm.entrypoints.cli_args import build_parser
from mini_vllm.entrypoints.openai_server import build_app
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.phase7

MODEL = "tiny-test"
MAX_MODEL_LEN = 128
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    base_url: str
    engine: AsyncLLM
    client: openai.OpenAI  # the official client
    http: httpx.Client  # raw HTTP, for what the client cannot express

    def url(self, path: str) -> str:
        return self.base_url + path

    def stats(self) -> dict[str, Any]:
        return self.http.get(self.url("/stats")).json()


@contextmanager
def _serve(model_dir: Path, engine_process: bool) -> Iterator[Server]:
    engine = AsyncLLM(EngineArgs(
        model=str(model_dir), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=600,
        max_num_seqs=64, engine_process=engine_process).create_engine_config())
    with serving(build_app(engine, served_model_name=MODEL), stop_timeout=20) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with httpx.Client(timeout=60) as http:
            yield Server(base, engine, client, http)
    assert not engine.is_running  # the app's lifespan shut the engine down


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    """The server, its engine loop on a thread (the CPU's default)."""
    with _serve(tiny_model_dir, engine_process=False) as s:
        yield s


@pytest.fixture(scope="module")
def process_server(tiny_model_dir: Path) -> Iterator[Server]:
    """The server, its engine loop in a process of its own (the GPU's default)."""
    with _serve(tiny_model_dir, engine_process=True) as s:
        assert s.engine.core_process is not None
        yield s


@pytest.fixture(params=["thread", "process"])
def any_server(request: pytest.FixtureRequest) -> Server:
    """Each of the two, for the tests that must hold in both modes."""
    return request.getfixturevalue("server" if request.param == "thread" else "process_server")


def _sse_payloads(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def _post_stream(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = server.http.post(server.url(path), json=body, timeout=60)
    assert response.status_code == 200, response.text
    payloads = _sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def _assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    return error


def _greedy(server: Server, prompt: Any, max_tokens: int = 8, ignore_eos: bool = False,
            **kw: Any) -> Any:
    """A temperature-0 completion through the official client."""
    return server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                            temperature=0,
                                            extra_body={"ignore_eos": ignore_eos}, **kw)


# ----------------------------------------------------------------------------- completions


def test_completion_stream_equals_non_stream_and_usage_is_exact(any_server: Server) -> None:
    server = any_server
    prompt = "The quick brown fox"
    full = _greedy(server, prompt, max_tokens=12, ignore_eos=True)
    choice = full.choices[0]
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.model == MODEL
    assert choice.finish_reason == "length"
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens,
            full.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)

    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_default_max_tokens_is_16(server: Server) -> None:
    out = server.client.completions.create(model=MODEL, prompt="Hello", temperature=0,
                                           extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


def test_completion_prompt_forms_and_n(server: Server) -> None:
    tok = server.engine.tokenizer
    prompts = ["Hello world", "Once upon a time"]
    texts = [_greedy(server, p, ignore_eos=True).choices[0].text for p in prompts]
    ids = [tok.encode(p) for p in prompts]

    by_ids = _greedy(server, ids[0], ignore_eos=True)  # one list of token ids
    assert by_ids.choices[0].text == texts[0]
    assert by_ids.usage.prompt_tokens == len(ids[0])

    # Each prompt x n choices, numbered prompt-major; at temperature 0 all agree.
    for prompt_field in (prompts, ids):
        out = _greedy(server, prompt_field, n=2, ignore_eos=True)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [texts[0], texts[0], texts[1], texts[1]]
        assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert out.usage.completion_tokens == 4 * 8

    # Sampled choices with a seed are reproducible and use their own random streams.
    a = server.client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, n=3,
                                         temperature=1.0, seed=7)
    b = server.client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, n=3,
                                         temperature=1.0, seed=7)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1


def test_completion_streaming_n_and_multiple_prompts(server: Server) -> None:
    prompts = ["alpha beta", "gamma delta"]
    full = _greedy(server, prompts, n=2, max_tokens=6)
    chunks = _post_stream(server, "/v1/completions", {
        "model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0,
        "stream": True})
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {i: [full.choices[i].finish_reason] for i in range(4)}
    assert all("usage" not in c or c["usage"] is None for c in chunks)


def test_completion_stop_strings(server: Server) -> None:
    text = _greedy(server, "Stop here please", max_tokens=16, ignore_eos=True).choices[0].text
    stop = text[4:7]
    assert len(stop) == 3
    expected = text[: text.index(stop)]
    out = _greedy(server, "Stop here please", max_tokens=16, ignore_eos=True,
                  stop=[stop, "never-seen-xyz"])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = list(server.client.completions.create(
        model=MODEL, prompt="Stop here please", max_tokens=16, temperature=0, stop=stop,
        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_completion_echo_and_logprobs(any_server: Server) -> None:
    server = any_server
    prompt = "Echo me"
    plain = _greedy(server, prompt, max_tokens=5)
    out = _greedy(server, prompt, max_tokens=5, echo=True, logprobs=3)
    choice = out.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == len(prompt)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 1 <= len(top) <= 3
        # Greedy: the sampled token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-5)
        assert top.get(token) == pytest.approx(value, abs=1e-5)

    # Streamed logprobs are the same, delta by delta.
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def _metric_samples(server: Server) -> list[Any]:
    """Every sample on `/metrics`, parsed by `prometheus_client`."""
    text = server.http.get(server.url("/metrics")).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _metric_totals(server: Server) -> dict[str, float]:
    """`_count` and `_sum` of the three latency histograms on `/metrics`."""
    return {s.name: s.value for s in _metric_samples(server)
            if s.name.endswith(("seconds_count", "seconds_sum"))}


def test_a_whole_response_is_final_only_and_equals_the_stream(
        any_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that is not streamed asks the engine for one output at the end
    (FINAL_ONLY: its text decoded once); a stream still gets deltas. Both give the
    same choices, and the latency metrics still count the whole response."""
    server = any_server
    kinds: list[RequestOutputKind] = []
    generate = server.engine.generate

    def spy(prompt: Any, params: SamplingParams, *args: Any, **kwargs: Any) -> Any:
        kinds.append(params.output_kind)
        return generate(prompt, params, *args, **kwargs)

    monkeypatch.setattr(server.engine, "generate", spy)
    body = {"model": MODEL, "prompt": ["Once upon", "a time"], "n": 2, "max_tokens": 9,
            "temperature": 0.9, "seed": 11, "logprobs": 2, "ignore_eos": True}
    before = _metric_totals(server)
    whole = server.http.post(server.url("/v1/completions"), json=body).json()
    after = _metric_totals(server)
    assert kinds == [RequestOutputKind.FINAL_ONLY] * 2
    chunks = _post_stream(server, "/v1/completions", {**body, "stream": True})
    assert kinds[2:] == [RequestOutputKind.DELTA] * 2
    streamed: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        acc = streamed.setdefault(choice["index"], {"text": "", "tokens": []})
        acc["text"] += choice["text"]
        acc["tokens"] += (choice["logprobs"] or {}).get("tokens", [])
        acc["finish_reason"] = choice["finish_reason"]
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        assert streamed[choice["index"]] == {"text": choice["text"],
                                             "tokens": choice["logprobs"]["tokens"],
                                             "finish_reason": "length"}
        assert len(choice["logprobs"]["tokens"]) == 9
    assert whole["usage"]["completion_tokens"] == 36

    # Two engine requests: each adds one of every latency. Their first and later
    # tokens were timed by the engine (the server saw only the end: on its clock the
    # time per output token would be 0), inside their end-to-end time (the server's).
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert grew[f"mini_vllm:{name}_seconds_count"] == 2, name
    ttft = grew["mini_vllm:time_to_first_token_seconds_sum"]
    tpot = grew["mini_vllm:time_per_output_token_seconds_sum"]
    assert ttft > 0 and tpot > 0
    assert ttft + 8 * tpot < grew["mini_vllm:e2e_request_latency_seconds_sum"]

    # The chat endpoint, and a stop string (checked token by token even when final-only).
    messages = [{"role": "user", "content": "Tell me"}]
    chat = {"model": MODEL, "messages": messages, "n": 2, "max_tokens": 12, "temperature": 0.9,
            "seed": 5, "ignore_eos": True}
    whole_chat = server.http.post(server.url("/v1/chat/completions"), json=chat).json()
    chat_chunks = _post_stream(server, "/v1/chat/completions", {**chat, "stream": True})
    for choice in whole_chat["choices"]:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chat_chunks
                       if c["choices"][0]["index"] == choice["index"])
        assert text == choice["message"]["content"]
    one = {**chat, "n": 1}
    text = server.http.post(server.url("/v1/chat/completions"),
                            json=one).json()["choices"][0]["message"]["content"]
    stop = text[3:6]
    assert len(stop) == 3
    stopped = server.http.post(server.url("/v1/chat/completions"),
                               json={**one, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["message"]["content"] == text[:text.index(stop)]
    assert kinds[4:] == [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA,
                         RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY]


# ----------------------------------------------------------------------------- chat


def _chat_ids(server: Server, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    return list(server.engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **kw))


def test_chat_stream_equals_non_stream_with_exact_usage(any_server: Server) -> None:
    server = any_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    n_prompt = len(_chat_ids(server, messages))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 10)
    assert full.usage.total_tokens == n_prompt + 10

    chunks = _post_stream(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None,
                                     "stop_reason": None}]
    body = chunks[1:-1]
    finish_chunks = [c for c in body if c["choices"][0]["finish_reason"] is not None]
    assert len(finish_chunks) == 1 and finish_chunks[0] is body[-1]
    assert finish_chunks[0]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == \
        full.choices[0].message.content
    assert all("role" not in c["choices"][0]["delta"] for c in body)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == full.usage.model_dump(exclude_none=True)


def test_chat_n_streams_one_role_and_one_finish_per_choice(server: Server) -> None:
    chunks = _post_stream(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Count"}], "n": 3,
        "max_tokens": 4, "temperature": 0.8, "seed": 1, "stream": True})
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    finishes = [c["choices"][0]["index"] for c in chunks
                if c["choices"][0]["finish_reason"] is not None]
    assert sorted(roles) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert all("usage" not in c or c["usage"] is None for c in chunks)


def test_chat_content_parts_template_kwargs_and_max_tokens(server: Server) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0)
    as_text = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello\nthere"}], max_tokens=6,
        temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens

    messages = [{"role": "user", "content": "Think?"}]
    no_think = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    think = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                  temperature=0)
    assert no_think.usage.prompt_tokens == len(_chat_ids(server, messages,
                                                         enable_thinking=False))
    assert think.usage.prompt_tokens == len(_chat_ids(server, messages))
    assert no_think.usage.prompt_tokens != think.usage.prompt_tokens

    # max_completion_tokens wins over max_tokens.
    both = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, max_completion_tokens=5, temperature=0,
        extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens == 5

    # Neither: the reply may run to the end of the context.
    long_messages = [{"role": "user", "content": "word " * 100}]
    n_prompt = len(_chat_ids(server, long_messages))
    assert MAX_MODEL_LEN - 30 < n_prompt < MAX_MODEL_LEN
    rest = server.client.chat.completions.create(
        model=MODEL, messages=long_messages, temperature=0, extra_body={"ignore_eos": True})
    assert rest.choices[0].finish_reason == "length"
    assert rest.usage.completion_tokens == MAX_MODEL_LEN - n_prompt


def test_chat_logprobs(server: Server) -> None:
    out = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    only_sampled = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
        logprobs=True)
    assert all(e.top_logprobs == [] for e in only_sampled.choices[0].logprobs.content)
    assert server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=0).choices[0].logprobs is None


# ----------------------------------------------------------------------------- other endpoints


def test_models_health_version_stats_metrics(any_server: Server) -> None:
    server = any_server
    models = server.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "mini-vllm"
    assert card["max_model_len"] == MAX_MODEL_LEN and isinstance(card["created"], int)
    assert server.http.get(server.url("/health")).status_code == 200
    assert server.http.get(server.url("/version")).json() == {"version": mini_vllm.__version__}

    _greedy(server, "metrics please", max_tokens=3)
    stats = server.stats()
    for key in ("num_running", "num_waiting", "kv_cache_usage", "prompt_tokens_total",
                "generation_tokens_total", "num_requests_finished"):
        assert key in stats

    response = server.http.get(server.url("/metrics"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in ("mini_vllm:num_requests_running", "mini_vllm:num_requests_waiting",
                 "mini_vllm:kv_cache_usage_perc", "mini_vllm:prompt_tokens",
                 "mini_vllm:generation_tokens", "mini_vllm:request_success",
                 "mini_vllm:time_to_first_token_seconds",
                 "mini_vllm:time_per_output_token_seconds",
                 "mini_vllm:e2e_request_latency_seconds"):
        assert name in families, name

    def value(family: str, sample: str, **labels: str) -> float:
        return sum(s.value for s in families[family].samples
                   if s.name == sample and labels.items() <= s.labels.items())

    stats = server.stats()
    assert value("mini_vllm:prompt_tokens", "mini_vllm:prompt_tokens_total") == \
        stats["prompt_tokens_total"]
    assert value("mini_vllm:generation_tokens", "mini_vllm:generation_tokens_total") == \
        stats["generation_tokens_total"]
    assert value("mini_vllm:request_success", "mini_vllm:request_success_total",
                 finished_reason="length") >= 1
    assert value("mini_vllm:time_to_first_token_seconds",
                 "mini_vllm:time_to_first_token_seconds_count") >= 1
    assert value("mini_vllm:e2e_request_latency_seconds",
                 "mini_vllm:e2e_request_latency_seconds_count") >= 1


# ----------------------------------------------------------------------------- errors

_COMPLETION_400 = [
    {"model": MODEL, "prompt": ""},  # empty prompt
    {"model": MODEL, "prompt": []},
    {"model": MODEL, "prompt": [[]]},
    {"model": MODEL, "prompt": ["fine", ""]},  # one bad prompt of several
    {"model": MODEL, "prompt": [[1, 2], [10**6]], "stream": True},
    {"model": MODEL, "prompt": [0, 10**6]},  # token id outside the vocabulary
    {"model": MODEL, "prompt": [-1]},
    {"model": MODEL, "prompt": "x", "temperature": -1},
    {"model": MODEL, "prompt": "x", "top_p": 1.5},
    {"model": MODEL, "prompt": "x", "top_k": -2},
    {"model": MODEL, "prompt": "x", "n": 0},
    {"model": MODEL, "prompt": "x", "max_tokens": 0},
    {"model": MODEL, "prompt": "x", "logprobs": 21},
    {"model": MODEL, "prompt": "x", "presence_penalty": 3},
    {"model": MODEL, "prompt": "x", "stop": [""]},
    {"model": MODEL, "prompt": "x", "temperature": "hot"},  # schema violations
    {"model": MODEL},
    {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
    {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN},  # prompt + max_tokens
    {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN, "stream": True},
    {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1},  # prompt too long
]
_CHAT_400 = [
    {"model": MODEL, "messages": []},
    {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
     "top_logprobs": 21},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
     "stream_options": {"include_usage": True}},
    {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]},  # too long
    {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}], "stream": True},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
     "chat_template_kwargs": {"add_generation_prompt": False}},
]


def test_every_bad_request_is_a_400_and_the_server_keeps_serving(server: Server) -> None:
    def still_serving() -> None:
        out = server.http.post(server.url("/v1/completions"), json={
            "model": MODEL, "prompt": "ok", "max_tokens": 1, "temperature": 0})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 1

    requests = [("/v1/completions", body) for body in _COMPLETION_400]
    requests += [("/v1/chat/completions", body) for body in _CHAT_400]
    for path, body in requests:
        _assert_error(server.http.post(server.url(path), json=body), 400)
        still_serving()
    for path in ("/v1/completions", "/v1/chat/completions"):
        for raw in (b"{not json", b"", b"[1, 2]"):
            _assert_error(server.http.post(server.url(path), content=raw,
                                           headers={"content-type": "application/json"}), 400)
            still_serving()

    error = _assert_error(server.http.post(server.url("/v1/completions"), json={
        "model": MODEL, "prompt": "x", "temperature": -1}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == "temperature"
    assert "temperature" in error["message"]
    error = _assert_error(server.http.post(server.url("/v1/completions"), json={
        "model": MODEL, "prompt": "x", "top_p": "many"}), 400)
    assert error["param"] == "top_p"
    error = _assert_error(server.http.post(server.url("/v1/completions"), json={"model": MODEL}),
                          400)
    assert error["param"] == "prompt"
    # The official client sees the same, as BadRequestError.
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x", max_tokens=MAX_MODEL_LEN)
    assert server.http.get(server.url("/health")).status_code == 200
    stats = _wait_idle(server)
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)


def test_unknown_model_and_route_are_404(server: Server) -> None:
    error = _assert_error(server.http.post(server.url("/v1/completions"),
                                     json={"model": "gpt-4", "prompt": "x"}), 404)
    assert error["param"] == "model" and "gpt-4" in error["message"]
    _assert_error(server.http.post(server.url("/v1/chat/completions"), json={
        "model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}), 404)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="x")
    _assert_error(server.http.get(server.url("/v1/nothing-here")), 404)


def test_unknown_fields_are_ignored(server: Server) -> None:
    out = server.http.post(server.url("/v1/completions"), json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "best_of": 1,
        "user": "someone", "suffix": None, "some_future_field": {"a": 1}})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    chat = server.http.post(server.url("/v1/chat/completions"), json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": "me"}],
        "max_tokens": 3, "temperature": 0, "user": "x", "response_format": {"type": "text"}})
    assert chat.status_code == 200


def test_a_bug_is_a_500_and_the_next_request_is_served(server: Server,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.engine, "generate", broken)
    _assert_error(server.http.post(server.url("/v1/completions"), json={"model": MODEL,
                                                                  "prompt": "x"}), 500)
    monkeypatch.undo()
    assert _greedy(server, "after the bug", max_tokens=2).usage.completion_tokens == 2


def test_an_error_mid_stream_is_one_error_event_then_done(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    real_generate = server.engine.generate

    async def fails_after_first(*args: Any, **kwargs: Any) -> Any:
        async for output in real_generate(*args, **kwargs):
            yield output
            raise RequestFailedError("the engine failed while computing this request")

    monkeypatch.setattr(server.engine, "generate", fails_after_first)
    response = server.http.post(server.url("/v1/chat/completions"), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True, "stream": True})
    monkeypatch.undo()
    assert response.status_code == 200
    payloads = _sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])
    assert set(error) == {"error"} and error["error"]["code"] == 500
    assert all("error" not in json.loads(p) for p in payloads[:-2])
    _wait_idle(server)


# ----------------------------------------------------------------------------- reliability


def _wait_idle(server: Server, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0.0):
            return stats
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        time.sleep(0.02)


def _aborted(server: Server) -> float:
    return sum(s.value for s in _metric_samples(server)
               if s.name == "mini_vllm:request_success_total"
               and s.labels["finished_reason"] == "abort")


def test_disconnects_abort_their_requests(any_server: Server) -> None:
    server = any_server
    long = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True}
    before_aborts = _aborted(server)
    before_tokens = server.stats()["generation_tokens_total"]
    # Streams that hang up after their first event.
    with httpx.Client(timeout=30) as client:
        for _ in range(4):
            with client.stream("POST", server.url("/v1/completions"),
                               json={**long, "stream": True}) as response:
                assert response.status_code == 200
                next(response.iter_lines())
            # Leaving the block closed this connection mid-stream.
    # Non-streaming requests whose client times out.
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            server.http.post(server.url("/v1/completions"), json=long, timeout=0.05)
    stats = _wait_idle(server)
    deadline = time.monotonic() + 5
    while _aborted(server) < before_aborts + 6:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _aborted(server) == before_aborts + 6
    # Far fewer tokens than 6 complete requests would have made.
    assert stats["generation_tokens_total"] - before_tokens < 3 * 120
    start = time.monotonic()
    assert _greedy(server, "fresh request", max_tokens=4).usage.completion_tokens == 4
    assert time.monotonic() - start < 5


def test_64_concurrent_streams_each_get_their_own_text(any_server: Server) -> None:
    server = any_server
    prompts = [f"Request number {i} says" for i in range(64)]

    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=60)

        async def streamed(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def whole(prompt: str) -> str:
            out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                  temperature=0)
            return out.choices[0].text

        got = await asyncio.gather(*(streamed(p) for p in prompts))
        want = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return got, want

    got, want = asyncio.run(run())
    assert got == want
    assert len(set(want)) > 1  # the prompts really lead to different texts
    _wait_idle(server)


def test_health_is_503_once_the_engine_is_down(tiny_model_dir: Path) -> None:
    engine = AsyncLLM(EngineArgs(model=str(tiny_model_dir), max_model_len=64,
                                 num_gpu_blocks_override=16).create_engine_config())
    app = build_app(engine)

    async def run() -> tuple[int, int, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            alive = (await client.get("/health")).status_code
            engine.shutdown()
            dead = (await client.get("/health")).status_code
            refused = await client.post("/v1/completions", json={"prompt": "x"})
            return alive, dead, refused

    alive, dead, refused = asyncio.run(run())
    assert (alive, dead) == (200, 503)
    _assert_error(refused, 503)


# ----------------------------------------------------------------------------- CLI


def test_every_cli_flag_has_help() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "serve" in a.choices)
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
    serve_flags = {s for a in subparsers.choices["serve"]._actions for s in a.option_strings}
    for flag in ("--model", "--host", "--port", "--served-model-name", "--max-model-len",
                 "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
                 "--block-size", "--dtype", "--device", "--num-gpu-blocks-override",
                 "--cpu-kv-cache-gb", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--enforce-eager", "--seed"):
        assert flag in serve_flags, flag


def test_cli_generate_prints_the_completion(server: Server, tiny_model_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    expected = _greedy(server, "Hello there", max_tokens=6).choices[0].text
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "Hello there",
                 "--max-tokens", "6", "--temperature", "0",
                 "--num-gpu-blocks-override", "16"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_cli_uses_the_embedded_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "Once upon a time", "--max-tokens", "4",
                 "--temperature", "0", "--num-gpu-blocks-override", "8"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.strip()  # the trained default writes text


def test_cli_make_model_writes_a_checkpoint(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "made"
    assert main(["make-model", str(out), "--preset", "tiny", "--seed", "3"]) == 0
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert list(out.glob("*.safetensors"))
    assert str(out) in capsys.readouterr().out
    assert main(["make-model", str(tmp_path / "x"), "--preset", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mini-vllm: error:") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x", "--model"],
    ["chat", "--model"],
    ["--model"],  # no command: serve
    ["serve", "--model"],
])
def test_cli_bad_model_is_a_one_line_error(argv: list[str], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        assert main([*argv, str(bad)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        err = captured.err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert str(bad) in err
        assert "mini-vllm make-model" in err and "hf download Qwen/Qwen3" in err


def _run_cli(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "mini_vllm", *args], cwd=REPO_ROOT,
                            env=env, text=True, **kwargs)


def test_cli_chat_streams_replies_and_resets(server: Server, tiny_model_dir: Path) -> None:
    proc = _run_cli("chat", "--model", str(tiny_model_dir), "--temperature", "0",
                    "--max-tokens", "6", "--num-gpu-blocks-override", "32",
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate("hello\n/reset\nhi\n/exit\n", timeout=60)
    assert proc.returncode == 0, err

    def reply(messages: list[dict[str, str]]) -> str:
        return server.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        ).choices[0].message.content

    hello = reply([{"role": "user", "content": "hello"}])
    hi_fresh = reply([{"role": "user", "content": "hi"}])
    assert f"> {hello}\n" in out
    assert "(conversation cleared)" in out
    assert f"> {hi_fresh}\n" in out  # /reset forgot the first exchange
    assert "Traceback" not in err


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_cli_serve_shuts_down_cleanly_on_sigterm(tiny_model_dir: Path, mode: str) -> None:
    port = free_port()
    proc = _run_cli("--model", str(tiny_model_dir), "--port", str(port),
                    "--max-model-len", "512", "--num-gpu-blocks-override", "64",
                    "--engine-process" if mode == "process" else "--no-engine-process",
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        assert model == str(tiny_model_dir)
        payloads = []
        with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
                "model": model, "prompt": "a long story", "max_tokens": 400,
                "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if not line:
                    continue
                payloads.append(line.removeprefix("data: "))
                if len(payloads) == 2:
                    proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert payloads[-1] == "[DONE]"
    finishes = [json.loads(p)["choices"][0]["finish_reason"] for p in payloads[:-1]]
    assert finishes[-1] == "abort" and finishes.count("abort") == 1
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    # What a user needs at start-up: the model, the KV cache and an example.
    assert str(tiny_model_dir) in out and "device cpu" in out and "curl " in out
    assert f"engine {mode}" in out
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "KV cache: 64 blocks" in err and "max concurrency" in err


def test_cli_serve_freezes_its_heap_before_it_serves(tiny_model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`mini-vllm serve` exempts its start-up heap from the garbage collector's
    scans (engine/heap.py) before the server runs; the front's event loop then
    pays for no full scan of torch and the app while it streams."""
    assert gc.get_freeze_count() == 0
    seen = []

    class _Server:  # stands in for uvicorn: records the heap's state and returns
        def run(self, sockets: Any = None) -> None:
            seen.append(gc.get_freeze_count())

    monkeypatch.setattr(cli, "make_server", lambda *args, **kwargs: _Server())
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve", "--model", str(tiny_model_dir), "--max-model-len", "512",
                     "--num-gpu-blocks-override", "64", "--no-engine-process"]) == 0
    finally:
        gc.unfreeze()
        signal.signal(signal.SIGTERM, sigterm)
    assert len(seen) == 1 and seen[0] > 10_000
