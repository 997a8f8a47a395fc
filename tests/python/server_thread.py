"""What the server tests share: the app on a uvicorn server on a thread of the test
process, on a free port of the loopback interface."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI

from mini_vllm.distributed.parallel_state import free_port
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.openai_server import make_server


@contextmanager
def serving(app: FastAPI, args: FrontendArgs | None = None, start_timeout: float = 30,
            stop_timeout: float = 30) -> Iterator[int]:
    """Serve `app` (with `make_server`, as `mini-vllm serve` does) until the block exits;
    yields the port. The server must start within `start_timeout` seconds and, told to
    exit, stop within `stop_timeout`."""
    port = free_port()
    uv = make_server(app, "127.0.0.1", port, log_level="warning", access_log=False, args=args)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        uv.should_exit = True
        thread.join(timeout=stop_timeout)
    assert not thread.is_alive()
