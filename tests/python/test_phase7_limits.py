"""Phase 7: the server under hostile clients (chapter 7, "Running the server safely").

Each finding of a hostile run against the server is a test here: a huge `n`,
a huge body, a large prompt, lone surrogates, loose JSON types, an overflowing
seed, a bug's 500, idle and slow connections, a full queue, one request that
would monopolise the engine, missing API keys, CORS, TLS, and the command
line's checks before the model loads. A bounded schemathesis run checks that
the OpenAPI document and the server's answers agree, with no 5xx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import httpx
import openai
import pytest
import schemathesis
import trustme
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from server_thread import serving

from mini_vllm import cli
from mini_vllm.cli import main
from mini_vllm.config import EngineArgs
from mini_vllm.engine.async_engine import AsyncLLM
from mini_vllm.entrypoints.admission import Admission, FairGate, split_units
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.cli_args import build_parser, frontend_args_from
from mini_vllm.entrypoints.connections import (
    RESERVED_DESCRIPTORS,
    RateLimitedLog,
    ensure_descriptors,
    rate_limited_exception_handler,
)
from mini_vllm.entrypoints.openai_server import build_app

pytestmark = pytest.mark.phase7

MODEL = "tiny-test"
MAX_MODEL_LEN = 128


@dataclass
class Server:
    base_url: str
    port: int
    engine: AsyncLLM
    app: FastAPI
    http: httpx.Client

    def url(self, path: str) -> str:
        return self.base_url + path


@contextmanager
def _serve(model_dir: Path, args: FrontendArgs | None = None, max_num_seqs: int = 64,
           scheme: str = "http", **engine_args: Any) -> Iterator[Server]:
    engine = AsyncLLM(EngineArgs(
        model=str(model_dir), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=600,
        max_num_seqs=max_num_seqs, engine_process=False, **engine_args).create_engine_config())
    args = args or FrontendArgs()
    app = build_app(engine, served_model_name=MODEL, args=args)
    with serving(app, args, stop_timeout=20) as port, \
            httpx.Client(timeout=60, verify=False) as http:
        yield Server(f"{scheme}://127.0.0.1:{port}", port, engine, app, http)


# Tight limits, so that the tests (and schemathesis) stay small.
LIMITS = FrontendArgs(max_n_sequences=8, max_completion_prompts=8, max_stop_strings=4,
                      max_stop_string_len=16, max_logprobs=5, max_queued_seqs=64,
                      max_request_body_bytes=1024 * 1024)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    with _serve(tiny_model_dir, LIMITS) as s:
        yield s


def _assert_error(response: httpx.Response, status: int, param: str | None = None
                  ) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    assert error["param"] == param, error
    return error


def _completion(server: Server, **fields: Any) -> httpx.Response:
    return server.http.post(server.url("/v1/completions"),
                            json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields})


# ----------------------------------------------------------------------------- raw HTTP


class RawConnection:
    """One HTTP/1.1 connection, by hand: to see that the server keeps it (or closes it)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h11.Connection(h11.CLIENT)

    def request(self, method: str, path: str, body: bytes = b"",
                headers: list[tuple[str, str]] | None = None) -> tuple[h11.Response, bytes]:
        headers = [("host", "127.0.0.1"), ("content-length", str(len(body))),
                   ("content-type", "application/json"), *(headers or [])]
        data = self.conn.send(h11.Request(method=method, target=path, headers=headers))
        data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        self.sock.sendall(data)
        response, chunks = None, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
        assert response is not None
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return response, b"".join(chunks)

    def closed_by_server(self, within: float) -> bool:
        """True if the server closes the connection within `within` seconds."""
        self.sock.settimeout(within)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def _json(body: bytes) -> Any:
    return json.loads(body.decode())


# ----------------------------------------------------------------------------- request limits


def test_a_huge_n_is_a_400_within_100_ms(server: Server) -> None:
    _completion(server)  # a warm connection
    for n in (454_098_283, 10**6, 20_000, LIMITS.max_n_sequences + 1):
        start = time.perf_counter()
        response = _completion(server, n=n)
        elapsed = time.perf_counter() - start
        _assert_error(response, 400, "n")
        assert elapsed < 0.1, f"n={n} took {elapsed * 1000:.0f} ms"
    chat = server.http.post(server.url("/v1/chat/completions"), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 10**9})
    _assert_error(chat, 400, "n")
    assert _completion(server, n=LIMITS.max_n_sequences).status_code == 200


def test_prompts_stops_and_logprobs_are_bounded(server: Server) -> None:
    _assert_error(_completion(server, prompt=["a"] * (LIMITS.max_completion_prompts + 1)),
                  400, "prompt")
    _assert_error(_completion(server, prompt=[[1, 2]] * 500), 400, "prompt")
    _assert_error(_completion(server, stop=["a", "b", "c", "d", "e"]), 400, "stop")
    _assert_error(_completion(server, stop="x" * (LIMITS.max_stop_string_len + 1)), 400, "stop")
    _assert_error(_completion(server, logprobs=LIMITS.max_logprobs + 1), 400, "logprobs")
    chat = server.http.post(server.url("/v1/chat/completions"), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": LIMITS.max_logprobs + 1})
    _assert_error(chat, 400, "top_logprobs")
    # At the limits, a request is served.
    ok = _completion(server, prompt=["a"] * LIMITS.max_completion_prompts,
                     stop=["x" * LIMITS.max_stop_string_len] * LIMITS.max_stop_strings,
                     logprobs=LIMITS.max_logprobs)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == LIMITS.max_completion_prompts


@pytest.mark.parametrize(("field", "value"), [
    ("stream", "yes"), ("stream", 1), ("echo", "true"), ("max_tokens", "16"), ("n", "2"),
    ("n", 2.0), ("temperature", True), ("prompt", [True]), ("prompt", [1, True]),
    ("prompt", [[1], [False]]), ("stop_token_ids", [True]), ("seed", "1"), ("logprobs", False),
    ("ignore_eos", "false"), ("prompt", 5)])
def test_json_types_are_strict(server: Server, field: str, value: Any) -> None:
    _assert_error(_completion(server, **{field: value}), 400, field)


def test_chat_json_types_are_strict(server: Server) -> None:
    for fields, param in (({"logprobs": "true"}, "logprobs"), ({"stream": 0}, "stream"),
                          ({"max_completion_tokens": "4"}, "max_completion_tokens"),
                          ({"messages": [{"role": "user", "content": 5}]}, "messages"),
                          ({"chat_template_kwargs": {"enable_thinking": False}, "n": True}, "n")):
        response = server.http.post(server.url("/v1/chat/completions"), json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})
        _assert_error(response, 400, param)


def test_a_seed_that_overflows_with_n_is_a_400(server: Server) -> None:
    error = _assert_error(_completion(server, seed=2**64 - 1, n=2), 400, "seed")
    assert "torch" not in error["message"].lower() and "overflow" not in error["message"].lower()
    # The largest seed that fits works, and seeded choices stay reproducible.
    first = _completion(server, seed=2**64 - 2, n=2, max_tokens=4)
    assert first.status_code == 200, first.text
    again = _completion(server, seed=2**64 - 2, n=2, max_tokens=4)
    assert [c["text"] for c in first.json()["choices"]] == [
        c["text"] for c in again.json()["choices"]]


def test_choices_of_a_large_n_are_split_but_numbered_and_seeded_as_one(server: Server) -> None:
    """n = 8 runs as units of 4 + 4 and 8, then of 1 and at most 3: the same choices."""
    units = split_units(2, 8, unit_seqs=3, first_unit_seqs=1)
    assert [(u.prompt_index, u.first_choice, u.n, u.rank) for u in units] == [
        (0, 0, 1, 0), (0, 1, 3, 1), (0, 4, 3, 2), (0, 7, 1, 3), (1, 0, 3, 4), (1, 3, 3, 5),
        (1, 6, 2, 6)]
    assert [(u.first_choice, u.n) for u in split_units(1, 1)] == [(0, 1)]
    assert [(u.prompt_index, u.n) for u in split_units(2, 2)] == [(0, 2), (1, 2)]
    body = {"prompt": ["Hello", "Once upon"], "n": 8, "seed": 11, "max_tokens": 5,
            "temperature": 1.0}

    def texts() -> list[str]:
        response = _completion(server, **body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert sorted(c["index"] for c in choices) == list(range(16))
        return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]

    whole = texts()
    assert len(set(whole[:8])) > 1  # the choices differ...
    admission = server.app.state.context.admission
    saved = admission.unit_seqs, admission.first_unit_seqs
    admission.unit_seqs, admission.first_unit_seqs = 3, 1
    try:
        split = texts()
    finally:
        admission.unit_seqs, admission.first_unit_seqs = saved
    assert split == whole  # ...and choice j is the same, whatever unit computed it


def test_lone_surrogates_are_400_and_the_connection_survives(server: Server) -> None:
    conn = RawConnection(server.port)
    try:
        cases = [
            ("/v1/completions", b'{"model": "tiny-test", "prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", b'{"model": "tiny-test", "prompt": ["ok", "\\udfff"]}', "prompt"),
            ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
            ("/v1/completions", b'{"model": "tiny-test", "prompt": "x", "stop": ["\\ud800"]}',
             "stop"),
            ("/v1/chat/completions",
             b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\ud800"}]}',
             "messages"),
            ("/v1/chat/completions", (b'{"model": "tiny-test", "messages": [{"role": "user", '
             b'"content": [{"type": "text", "text": "\\udc00"}]}]}'), "messages"),
            ("/v1/chat/completions", (b'{"model": "tiny-test", "messages": [{"role": "user", '
             b'"content": "hi"}], "chat_template_kwargs": {"x": ["\\ud800"]}}'),
             "chat_template_kwargs"),
        ]
        for path, body, param in cases:
            response, data = conn.request("POST", path, body)
            assert response.status_code == 400, data
            assert _json(data)["error"]["param"] == param
            assert "surrogate" in _json(data)["error"]["message"]
        # The same connection is still served.
        response, data = conn.request("POST", "/v1/completions",
                                      b'{"model": "tiny-test", "prompt": "x", "max_tokens": 1}')
        assert response.status_code == 200 and _json(data)["usage"]["completion_tokens"] == 1
    finally:
        conn.close()


def test_a_bug_is_a_500_that_names_only_a_request_id(
        server: Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret detail from /home/someone/model")

    monkeypatch.setattr(server.engine, "generate", broken)
    conn = RawConnection(server.port)
    try:
        with caplog.at_level(logging.ERROR, logger="mini_vllm"):
            response, data = conn.request("POST", "/v1/completions",
                                          b'{"model": "tiny-test", "prompt": "x"}')
        assert response.status_code == 500
        error = _json(data)["error"]
        request_id = dict(response.headers)[b"x-request-id"].decode()
        assert request_id.startswith("req-") and request_id in error["message"]
        assert "secret" not in data.decode() and "RuntimeError" not in data.decode()
        assert error["param"] is None and error["type"] == "internal_server_error"
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert logged and "secret detail" in str(logged[0].exc_info[1])  # type: ignore[index]
        monkeypatch.undo()
        response, _ = conn.request("POST", "/v1/completions",  # the connection survived
                                   b'{"model": "tiny-test", "prompt": "x", "max_tokens": 1}')
        assert response.status_code == 200
    finally:
        conn.close()


def test_the_openapi_document_says_400_not_422(server: Server) -> None:
    doc = server.http.get(server.url("/openapi.json")).json()
    text = json.dumps(doc)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "413", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
        assert "text/event-stream" in responses["200"]["content"]
    assert "security" not in doc  # no key asked for


def test_models_show_the_served_name_not_a_path(server: Server,
                                                tiny_model_dir: Path) -> None:
    body = server.http.get(server.url("/v1/models")).text
    assert str(tiny_model_dir) not in body
    card = json.loads(body)["data"][0]
    assert card["id"] == card["root"] == MODEL


# ----------------------------------------------------------------------------- the event loop


def _health_latencies_during(server: Server, count: int, client_script: str,
                             *args: str) -> tuple[list[float], str]:
    """`/health` round trips (seconds) measured while a client in another process (so
    that it takes nothing from this process's GIL, which the server shares) runs
    `client_script`; returns them with what the client printed."""
    latencies = []
    with httpx.Client(timeout=10) as http:
        http.get(server.url("/health"))  # a warm connection
        client = subprocess.Popen([sys.executable, "-c", client_script, str(server.port), *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "ready"  # started, its payload built
        client.stdin.write("go\n")
        client.stdin.flush()
        while len(latencies) < count:
            start = time.perf_counter()
            assert http.get(server.url("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    out = client.stdout.read()
    client.wait(timeout=120)
    assert client.returncode == 0
    return latencies, out


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


_BIG_BODIES = """
import socket, sys, time
port = int(sys.argv[1])
body = b'{"prompt": "' + b"a" * 20_000_000 + b'"}'
print("ready", flush=True)
sys.stdin.readline()
for _ in range(5):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json"
                  b"\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body))
        try:
            s.sendall(body)  # the server answers (and closes) before it has all of it
        except OSError:
            pass
        print(s.recv(65536).split(b" ")[1].decode(), flush=True)
"""


def test_a_20_mb_body_is_a_413_while_health_answers_within_100_ms(server: Server) -> None:
    latencies, out = _health_latencies_during(server, 100, _BIG_BODIES)
    assert out.split() == ["413"] * 5
    assert _p99(latencies) < 0.1, f"/health p99 {_p99(latencies) * 1000:.0f} ms"
    # A body over the limit without a Content-Length (chunked) is refused as it grows.
    chunked = server.http.post(server.url("/v1/completions"),
                               content=iter([b"x" * 65536] * 40),
                               headers={"content-type": "application/json"})
    _assert_error(chunked, 413)


_WORST_JSON = """
import socket, sys
port, limit = int(sys.argv[1]), int(sys.argv[2])
ids = b",".join([b"1"] * ((limit - 16) // 2))
body = b'{"prompt": [' + ids + b']}'
assert len(body) <= limit
print("ready", flush=True)
sys.stdin.readline()
for _ in range(5):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json"
                  b"\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
        print(s.recv(65536).split(b" ")[1].decode(), flush=True)
"""


def test_the_largest_body_parses_while_health_answers_within_100_ms(
        tiny_model_dir: Path) -> None:
    """The default body limit bounds what parsing (which holds the GIL) can cost: five
    bodies of the slowest JSON to parse, a million token ids each, just under the
    limit, while /health keeps its p99 under 100 ms."""
    args = FrontendArgs()
    with _serve(tiny_model_dir, args) as server:
        latencies, out = _health_latencies_during(server, 100, _WORST_JSON,
                                                  str(args.max_request_body_bytes))
    assert out.split() == ["400"] * 5  # parsed, then found far longer than the context
    assert _p99(latencies) < 0.1, f"/health p99 {_p99(latencies) * 1000:.0f} ms"


_LARGE_PROMPT = """
import json, sys, time, httpx
words = ("hello world the quick brown fox über 日本語 123\\n" * 30_000)[:600_000]
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
response = httpx.post(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", timeout=60,
                      json={"model": sys.argv[2], "prompt": words})
print(response.status_code, time.perf_counter() - start)
"""


def test_a_large_prompt_is_tokenized_off_the_event_loop(server: Server) -> None:
    """A prompt of 600,000 characters takes the tokenizer a while; /health does not wait."""
    latencies, out = _health_latencies_during(server, 30, _LARGE_PROMPT, MODEL)
    status, took = out.split()
    assert status == "400"  # far longer than the context, found once tokenized
    assert float(took) > 0.3  # the tokenizer really worked while /health was asked
    assert _p99(latencies) < 0.1, f"/health p99 {_p99(latencies) * 1000:.0f} ms"


# ----------------------------------------------------------------------------- connections


def test_the_connection_cap_answers_503_with_retry_after_and_recovers(
        tiny_model_dir: Path) -> None:
    args = FrontendArgs(limit_concurrency=4, timeout_request_headers=20)
    with _serve(tiny_model_dir, args) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        time.sleep(0.2)
        extra = RawConnection(server.port)
        response, data = extra.request("POST", "/v1/completions",
                                       b'{"model": "tiny-test", "prompt": "x"}')
        assert response.status_code == 503
        headers = dict(response.headers)
        assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
        assert _json(data)["error"]["code"] == 503
        assert extra.closed_by_server(within=2)
        extra.close()
        # Far beyond the cap, new connections are closed at once: descriptors stay bounded.
        flood = [RawConnection(server.port) for _ in range(40)]
        assert sum(c.closed_by_server(within=0.5) for c in flood) >= 40 - 16
        for c in flood:
            c.close()
        for s in idle:
            s.close()
        time.sleep(0.3)
        served = server.http.post(server.url("/v1/completions"),
                                  json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert served.status_code == 200


def test_slow_headers_and_bodies_time_out(tiny_model_dir: Path) -> None:
    args = FrontendArgs(timeout_request_headers=0.5, timeout_request_body=0.5,
                        timeout_keep_alive=2)
    with _serve(tiny_model_dir, args) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        trickle = socket.create_connection(("127.0.0.1", server.port))
        start = time.monotonic()
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for i in range(3):  # a slowloris: a header line now and then, never the end
            time.sleep(0.2)
            try:
                trickle.sendall(f"X-Slow-{i}: 1\r\n".encode())
            except OSError:
                break
        trickle.settimeout(5)
        silent.settimeout(5)
        assert silent.recv(1) == b"" and trickle.recv(1) == b""  # both closed by the server
        assert time.monotonic() - start < 3
        silent.close()
        trickle.close()

        slow_body = RawConnection(server.port)
        slow_body.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                               b'{"prompt"')
        slow_body.conn.send(h11.Request(method="POST", target="/", headers=[
            ("host", "x"), ("content-length", "100")]))  # keep the parser's state in step
        data = b""
        slow_body.sock.settimeout(5)
        while b"\r\n\r\n" not in data:
            data += slow_body.sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 408")
        slow_body.close()

        # Keep-alive: an idle connection is closed after timeout_keep_alive, not after
        # the header deadline (no request has begun) ...
        conn = RawConnection(server.port)
        response, _ = conn.request("GET", "/health")
        assert response.status_code == 200
        assert not conn.closed_by_server(within=1.0)
        assert conn.closed_by_server(within=3)
        conn.close()
        # ... while the next request's headers, once begun, are due within the deadline.
        conn = RawConnection(server.port)
        response, _ = conn.request("GET", "/health")
        assert response.status_code == 200
        conn.sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert conn.closed_by_server(within=3)
        assert time.monotonic() - start < 1.5  # the header deadline (0.5 s), not keep-alive
        conn.close()
        assert server.http.get(server.url("/health")).status_code == 200


def test_accept_errors_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(interval=10, clock=lambda: now[0])
    handler = rate_limited_exception_handler(log)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="mini_vllm"):
            for i in range(1000):
                now[0] = i * 0.01  # 1,000 failed accepts in 10 s
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(24, "Too many open files")})
            now[0] = 10.5
            handler(loop, {"message": "socket.accept() out of system resource",
                           "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "Too many open files" in lines[0] and "999 more" in lines[1]


def test_the_descriptor_limit_is_raised_or_the_cap_lowered(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    resource = pytest.importorskip("resource")
    limits = {"soft": 1024, "hard": 1_000_000}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_: int, value: tuple[int, int]) -> None:
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert ensure_descriptors(2048) == 2048  # the soft limit rose to what 2048 needs
    assert limits["soft"] >= 2048 + 2048 // 4 + RESERVED_DESCRIPTORS
    limits.update(soft=1024, hard=1024)  # the hard limit is too low: a smaller cap
    with caplog.at_level(logging.WARNING, logger="mini_vllm"):
        lowered = ensure_descriptors(2048)
    assert lowered + max(16, lowered // 4) + RESERVED_DESCRIPTORS <= 1024
    assert "ulimit" in caplog.text


# ----------------------------------------------------------------------------- admission


def test_a_full_queue_is_a_503_with_retry_after(tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    args = FrontendArgs(max_queued_seqs=0)
    with _serve(tiny_model_dir, args, max_num_seqs=4) as server:
        too_big = server.http.post(server.url("/v1/completions"), json={
            "model": MODEL, "prompt": "x", "n": 5})
        _assert_error(too_big, 400, "n")
        real_generate = server.engine.generate
        hold = threading.Event()

        async def held_generate(*a: Any, **kw: Any) -> Any:  # keeps its room until told
            async for output in real_generate(*a, **kw):
                yield output
            while not hold.is_set():
                await asyncio.sleep(0.01)

        monkeypatch.setattr(server.engine, "generate", held_generate)
        with httpx.stream("POST", server.url("/v1/completions"), timeout=60, json={
                "model": MODEL, "prompt": "a long story", "n": 4, "max_tokens": 20,
                "ignore_eos": True, "stream": True}) as long_one:
            lines = long_one.iter_lines()  # (dropping the iterator would close the stream)
            next(lines)  # it runs, with all 4 places of the server
            busy = server.http.post(server.url("/v1/completions"), json={
                "model": MODEL, "prompt": "x", "max_tokens": 1})
            _assert_error(busy, 503)
            assert busy.headers["retry-after"] == "1"
        hold.set()
        monkeypatch.undo()
        deadline = time.monotonic() + 10
        admission = server.app.state.context.admission
        while admission.in_flight:  # the abandoned stream gives its room back
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok = server.http.post(server.url("/v1/completions"), json={
            "model": MODEL, "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_the_fair_gate_grants_by_rank_then_arrival() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(capacity=4)
        order: list[str] = []
        await gate.acquire(4, rank=1)  # full

        async def wait(name: str, weight: int, rank: int) -> None:
            await gate.acquire(weight, rank)
            order.append(name)

        tasks = [asyncio.create_task(wait(name, w, r)) for name, w, r in
                 (("A2", 2, 2), ("A3", 2, 3), ("B1", 2, 1), ("B2", 2, 2), ("C1", 1, 1))]
        await asyncio.sleep(0)
        tasks[3].cancel()  # B gave up on its second unit
        await asyncio.sleep(0)
        gate.release(4)
        await asyncio.sleep(0)
        assert order == ["B1", "C1"]  # rank 1 first; A2 (3 more) does not fit yet
        gate.release(2)
        gate.release(1)
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.in_use == 4
        return order

    assert asyncio.run(scenario()) == ["B1", "C1", "A2", "A3"]


def test_admission_bounds_the_sequences_in_flight() -> None:
    admission = Admission(max_num_seqs=4, max_queued_seqs=4)
    first = admission.admit(6)
    with pytest.raises(Exception, match="full"):
        admission.admit(3)
    with pytest.raises(ValueError, match="at most 8"):
        admission.admit(9)
    first.release()
    first.release()  # twice is harmless
    assert admission.in_flight == 0
    admission.admit(8).release()


def _stream_until_done(server: Server, body: dict[str, Any], marks: dict[str, float],
                       name: str) -> None:
    with httpx.Client(timeout=120) as http:
        response = http.post(server.url("/v1/completions"), json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
    marks[name] = time.perf_counter()


@pytest.mark.parametrize("abuse", ["prompts", "n"])
def test_one_big_request_does_not_hold_up_a_small_one(tiny_model_dir: Path, abuse: str) -> None:
    """500 near-context prompts, or n = 128 long choices, in one request; a small
    request sent after it finishes long before it, within a few of its idle latencies."""
    args = FrontendArgs(max_completion_prompts=512, max_queued_seqs=1024)
    with _serve(tiny_model_dir, args, max_num_seqs=16) as server:
        small = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        idle = []
        for _ in range(5):
            start = time.perf_counter()
            assert server.http.post(server.url("/v1/completions"),
                                    json={"model": MODEL, **small}).status_code == 200
            idle.append(time.perf_counter() - start)
        if abuse == "prompts":
            body = {"prompt": [[7 + i % 50] * (MAX_MODEL_LEN - 9) for i in range(500)],
                    "max_tokens": 8, "ignore_eos": True}
        else:
            body = {"prompt": "Once upon a time", "n": 128, "max_tokens": 100,
                    "ignore_eos": True}
        marks: dict[str, float] = {}
        big = threading.Thread(target=_stream_until_done, args=(server, body, marks, "big"))
        sent = time.perf_counter()
        big.start()
        time.sleep(0.5)  # the big request is well under way
        start = time.perf_counter()
        response = server.http.post(server.url("/v1/completions"), json={"model": MODEL, **small})
        abused = time.perf_counter() - start
        assert response.status_code == 200
        big.join(timeout=300)
        big_took = marks["big"] - sent
    # The big request takes hundreds of steps; the small one a few more than alone.
    assert abused < big_took / 5, (abused, big_took)
    assert abused < 10 * statistics.median(idle) + 0.5, (abused, idle)


# ----------------------------------------------------------------------------- security


def test_api_key(tiny_model_dir: Path) -> None:
    args = FrontendArgs(api_key=("first-key", "second-key"))
    with _serve(tiny_model_dir, args) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        missing = server.http.post(server.url("/v1/completions"), json=body)
        error = _assert_error(missing, 401)
        assert error["type"] == "authentication_error"
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = server.http.post(server.url("/v1/completions"), json=body,
                                 headers={"Authorization": "Bearer first-keyX"})
        _assert_error(wrong, 401)
        for key in ("first-key", "second-key"):
            ok = server.http.post(server.url("/v1/completions"), json=body,
                                  headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        assert server.http.get(server.url("/health")).status_code == 200  # open
        assert server.http.get(server.url("/metrics")).status_code == 401
        doc = server.http.get(server.url("/openapi.json")).json()
        assert doc["security"] == [{"bearer": []}]
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="second-key", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url("/v1"), api_key="nope",
                          max_retries=0).models.list()


def test_the_api_key_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    monkeypatch.delenv("MINI_VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert frontend_args_from(parse(["serve"])).api_key == ()
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert frontend_args_from(parse(["serve"])).api_key == ("from-vllm",)
    monkeypatch.setenv("MINI_VLLM_API_KEY", "from-mini")
    assert frontend_args_from(parse(["serve"])).api_key == ("from-mini",)
    assert frontend_args_from(parse(["serve", "--api-key", "a", "b"])).api_key == ("a", "b")


def test_cors_is_closed_by_default_and_open_when_configured(server: Server,
                                                           tiny_model_dir: Path) -> None:
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    closed = server.http.get(server.url("/v1/models"), headers={"Origin": origin})
    assert "access-control-allow-origin" not in closed.headers
    denied = server.http.options(server.url("/v1/completions"), headers=preflight)
    assert "access-control-allow-origin" not in denied.headers
    args = FrontendArgs(allowed_origins=(origin,), allowed_methods=("GET", "POST"),
                        allowed_headers=("content-type", "authorization"))
    with _serve(tiny_model_dir, args) as opened:
        allowed = opened.http.options(opened.url("/v1/completions"), headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == origin
        got = opened.http.get(opened.url("/v1/models"), headers={"Origin": origin})
        assert got.headers["access-control-allow-origin"] == origin
        other = opened.http.get(opened.url("/v1/models"),
                                headers={"Origin": "https://elsewhere.example"})
        assert "access-control-allow-origin" not in other.headers


def test_docs_can_be_turned_off(tiny_model_dir: Path, server: Server) -> None:
    assert server.http.get(server.url("/docs")).status_code == 200
    with _serve(tiny_model_dir, FrontendArgs(disable_fastapi_docs=True)) as bare:
        for path in ("/docs", "/redoc", "/openapi.json"):
            _assert_error(bare.http.get(bare.url(path)), 404)


def test_tls(tiny_model_dir: Path, tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    args = FrontendArgs(ssl_keyfile=str(key_file), ssl_certfile=str(cert_file))
    with _serve(tiny_model_dir, args, scheme="https") as server:
        context = ssl.create_default_context(cafile=str(ca_file))
        with httpx.Client(verify=context) as http:
            assert http.get(server.url("/health")).status_code == 200
        with pytest.raises(httpx.TransportError):  # plain HTTP is not answered as HTTP
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)


# ----------------------------------------------------------------------------- the command line


def test_help_lists_the_serving_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in ("serve", "chat", "--model", "--port", "--max-num-seqs", "--api-key",
                 "--allowed-origins", "--max-n-sequences", "--limit-concurrency",
                 "--ssl-certfile", "--disable-fastapi-docs", "--max-request-body-bytes"):
        assert flag in out, flag


@pytest.mark.parametrize("bad", ["80000", "-1", "http"])
def test_a_bad_port_is_one_line_before_the_model_loads(
        bad: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_load_engine", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--port", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--port" in err and "Traceback" not in err


def test_a_port_in_use_is_one_line_before_the_model_loads(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_load_engine", lambda *a: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"127.0.0.1:{port}" in err and "in use" in err


def test_bad_tls_files_and_frontend_args_fail_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_load_engine", lambda *a: pytest.fail("the model was loaded"))
    missing = str(tmp_path / "missing.pem")
    assert main(["--ssl-keyfile", missing, "--ssl-certfile", missing]) == 2
    assert main(["--ssl-certfile", missing]) == 2
    assert main(["--limit-concurrency", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("mini-vllm: error:") for line in lines)
    assert "ssl_keyfile and ssl_certfile go together" in lines[1]


def test_frontend_args_refuse_out_of_range_values() -> None:
    for bad in ({"max_n_sequences": 0}, {"max_logprobs": 21}, {"timeout_request_body": 0},
                {"api_key": ("",)}, {"allowed_origins": "https://a.example"},
                {"max_queued_seqs": -1}, {"ssl_cert_reqs": 3}):
        with pytest.raises(ValueError):
            FrontendArgs(**bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- schemathesis


def test_schemathesis_finds_no_5xx_and_no_disagreement_with_the_document(
        server: Server) -> None:
    """A bounded, reproducible fuzzing run over every operation of /openapi.json, with
    valid and invalid examples: each answer must be a documented status, content type
    and shape, and never a 5xx; an invalid request must be refused.

    Not checked: that every schema-valid request is accepted. The document gives
    types, not every rule (a prompt must fit the context, `model` must be the one
    served), and such a request gets the 400 the document lists.
    """
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(mode))
        def run(case: Any) -> None:
            case.call_and_validate(timeout=60, excluded_checks=[positive_data_acceptance])

        run()
