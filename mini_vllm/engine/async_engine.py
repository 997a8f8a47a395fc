"""`AsyncLLM`: the engine's step loop on a background thread, async streams in front.

```
 event loop (FastAPI, asyncio)            engine thread
 ─────────────────────────────            ─────────────────────────────
 generate(prompt) ─ process_inputs ─┐
                                    ├─► commands (queue.Queue) ─► add / abort
 abort(id) ─────────────────────────┘                               │
                                                          LLMEngine.step()
 per-request asyncio.Queue ◄── loop.call_soon_threadsafe ◄── RequestOutput deltas
   └─► async for out in generate(...)
```

The thread blocks on the command queue when it has nothing to do and wakes
when a command arrives: no polling, no sleeps. Outputs cross back into the
caller's event loop with `call_soon_threadsafe`, the one thread-safe way into
a running loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.engine.llm_engine import LLMEngine, ProcessedRequest
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped: no request can be served any more."""


class RequestFailedError(RuntimeError):
    """The engine failed while computing this request; it keeps serving others."""


# --8<-- [start:stream]
@dataclass
class _Stream:
    """Where one request's outputs go: a queue owned by the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


def _deliver(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Runs in the caller's event loop: hand each output to its request's queue."""
    for stream, item in items:
        stream.queue.put_nowait(item)


@dataclass
class _Add:
    request: ProcessedRequest
    stream: _Stream


@dataclass
class _Abort:
    request_ids: list[str]


class _Shutdown:
    pass
# --8<-- [end:stream]


class AsyncLLM:
    """An `LLMEngine` driven by a background thread, with one async stream per request.

    Args:
        engine_config: the resolved engine configuration.
    """

    # --8<-- [start:init]
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine = LLMEngine(engine_config)
        self.engine_config = engine_config
        self.tokenizer = self.engine.tokenizer
        self.generation_config = self.engine.generation_config
        self._commands: queue.Queue = queue.Queue()
        # Only the engine thread touches `_streams` and the engine itself.
        self._streams: dict[str, _Stream] = {}
        self.dead_error: BaseException | None = None
        self._shutting_down = False
        self._thread = threading.Thread(target=self._run, name="mini-vllm-engine", daemon=True)
        self._thread.start()
    # --8<-- [end:init]

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    # ---- health -------------------------------------------------------------------
    # --8<-- [start:health]
    @property
    def errored(self) -> bool:
        """True once the engine thread has died."""
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        """True while the engine accepts and serves requests."""
        return self._thread.is_alive() and not self.errored and not self._shutting_down
    # --8<-- [end:health]

    def get_stats(self) -> dict:
        """Engine statistics (a snapshot: counters are read without a lock)."""
        return self.engine.get_stats()

    # ---- the public API -----------------------------------------------------------
    # --8<-- [start:generate]
    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (deltas) as they are produced.

        Raises:
            ValueError: the request is invalid (raised before any output).
            EngineDeadError: the engine stopped.
            RequestFailedError: the engine failed while computing this request.
        """
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        request_id = request_id or uuid.uuid4().hex
        processed = self.engine.process_inputs(request_id, prompt, sampling_params, priority)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(_Add(processed, stream))
        if not self.is_running:  # the thread may have stopped before taking the command
            raise EngineDeadError(self._dead_message())
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                # Everything already queued is folded into one delta.
                while not isinstance(item, BaseException) and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        item = nxt
                        break
                    item.add(nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller went away (disconnect, cancel, error)
                self._commands.put(_Abort([request_id]))
    # --8<-- [end:generate]

    # --8<-- [start:abort]
    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its stream ends with finish_reason "abort"."""
        self._commands.put(_Abort([request_id]))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests in flight end with finish_reason "abort"."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._commands.put(_Shutdown())
        self._thread.join(timeout)
    # --8<-- [end:abort]

    # ---- the engine thread --------------------------------------------------------
    # --8<-- [start:run]
    def _run(self) -> None:
        """The engine loop: apply commands, step while there is work, block when idle."""
        try:
            while True:
                # Block only when idle: with work in hand, take what has arrived and step.
                block = not self.engine.has_unfinished_requests()
                try:
                    while True:
                        cmd = self._commands.get(block=block)
                        block = False
                        if isinstance(cmd, _Shutdown):
                            self._abort_all("the engine is shutting down")
                            self._fail_all(EngineDeadError(self._dead_message()))
                            return
                        self._apply(cmd)
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
        except BaseException as e:
            logger.exception("the engine thread died")
            self.dead_error = e
            self._fail_all(EngineDeadError(self._dead_message()))
    # --8<-- [end:run]

    # --8<-- [start:dispatch]
    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            rid = cmd.request.request_id
            if rid in self._streams:
                cmd.stream.put(ValueError(f"request id {rid!r} is already in use"))
                return
            try:
                self.engine.add_processed_request(cmd.request)
            except ValueError as e:
                cmd.stream.put(e)
                return
            self._streams[rid] = cmd.stream
        else:
            live = [rid for rid in cmd.request_ids if rid in self._streams]
            if live:
                self._dispatch(self.engine.abort_request(live))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One hand-off per event loop per step, not one per request: each
        # call_soon_threadsafe wakes the loop (a write to its self-pipe) and
        # makes the two threads trade the GIL.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, object]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            item = RequestFailedError(out.error) if out.error is not None else out
            batches.setdefault(stream.loop, []).append((stream, item))
            if out.finished or out.error is not None:
                del self._streams[out.request_id]
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass
    # --8<-- [end:dispatch]

    # --8<-- [start:fail_all]
    def _abort_all(self, reason: str) -> None:
        self._dispatch(self.engine.abort_request(list(self._streams)))
        logger.info("%s", reason)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        # Commands still queued would otherwise wait forever.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.stream.put(error)
    # --8<-- [end:fail_all]

    def _dead_message(self) -> str:
        if self.dead_error is not None:
            return f"the engine stopped after an error: {self.dead_error!r}"
        return "the engine is shut down"


__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError"]
