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

With `engine_process` (the default on a GPU) the same loop runs in a process
of its own instead (`core_process.py`, phase 9): an input thread forwards the
commands to it, and an output thread hands each step's outputs to `_dispatch`,
just as the engine thread does.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.engine.llm_engine import InputProcessor, LLMEngine, ProcessedRequest
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mini_vllm.engine.core_process import EngineCoreProcess

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine stopped: no request can be served any more."""


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
    stream: _Stream | None  # None on its way to an engine process: streams stay here


@dataclass
class _Abort:
    request_ids: list[str]


class _Shutdown:
    pass
# --8<-- [end:stream]


class AsyncLLM:
    """An `LLMEngine` driven by a background thread, with one async stream per request.

    With `engine_config.engine_process` the engine runs in a child process
    instead, and this process keeps the tokenizer, validation and the streams.

    Args:
        engine_config: the resolved engine configuration.
        engine_cls: the engine class to build. In process mode it is pickled by
            name into the child, so it must be a module-level class.

    Attributes:
        engine: the `LLMEngine` (thread mode); None in process mode.
        core_process: the engine process's handle (process mode); else None.
        processor: tokenizes and validates requests, in the caller's thread.
    """

    # --8<-- [start:init]
    def __init__(self, engine_config: EngineConfig,
                 engine_cls: type[LLMEngine] = LLMEngine) -> None:
        self.engine_config = engine_config
        self._commands: queue.Queue = queue.Queue()
        # The live requests' streams. Only the engine thread touches them and the
        # engine in thread mode; in process mode two threads share them: the lock.
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self._shutting_down = False
        self.engine: LLMEngine | None = None
        self.core_process: EngineCoreProcess | None = None
        if engine_config.engine_process:
            # (core_process imports this module)
            from mini_vllm.engine.core_process import (
                EngineCoreProcess,
                forward_commands,
                receive_outputs,
            )

            self.processor = InputProcessor(engine_config)  # validation stays in this process
            self.core_process = EngineCoreProcess(engine_config, engine_cls)
            self._stats = self.core_process.stats
            self._input_thread = threading.Thread(target=forward_commands, args=(self,),
                                                  name="mini-vllm-input", daemon=True)
            self._input_thread.start()
            self._thread = threading.Thread(target=receive_outputs, args=(self,),
                                            name="mini-vllm-output", daemon=True)
        else:
            self.engine = engine_cls(engine_config)
            self.processor = self.engine.input_processor
            self._thread = threading.Thread(target=self._run, name="mini-vllm-engine",
                                            daemon=True)
        self.tokenizer = self.processor.tokenizer
        self.generation_config = self.processor.generation_config
        self._thread.start()
    # --8<-- [end:init]

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    # ---- health -------------------------------------------------------------------
    # --8<-- [start:health]
    @property
    def errored(self) -> bool:
        """True once the engine thread (or process) has died."""
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        """True while the engine accepts and serves requests."""
        return self._thread.is_alive() and not self.errored and not self._shutting_down
    # --8<-- [end:health]

    def get_stats(self) -> dict:
        """Engine statistics (a snapshot: counters are read without a lock).

        In process mode, the engine process's latest report: at most
        `STATS_INTERVAL_S` old while it steps, current once it is idle.
        """
        if self.engine is not None:
            return self.engine.get_stats()
        return dict(self._stats)

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
        processed = self.processor.process_inputs(request_id, prompt, sampling_params, priority)
        await self.compile_structured_output(processed.params)
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
                    # Refused, failed or the engine died: nothing of ours is left
                    # to abort (and a refused id may be another request's).
                    finished = True
                    raise item
                finished = item.finished
                # An engine process does not send the prompt back: it is ours.
                item.prompt, item.prompt_token_ids = processed.prompt, processed.prompt_token_ids
                yield item
        finally:
            if not finished:  # the caller went away (disconnect, cancel, error)
                self._commands.put(_Abort([request_id]))
    # --8<-- [end:generate]

    async def compile_structured_output(self, params: SamplingParams) -> None:
        """Compile a request's structured output, if any, off the event loop.

        Its grammar is then in this process's cache: the engine thread finds it
        compiled, and an engine process compiles its own copy.

        Raises:
            ValueError: the spec is invalid, or took longer than the bound to compile.
        """
        if params.structured_outputs is not None:
            # The first use builds the manager (imports xgrammar, reads the vocabulary):
            # a second or two, on a worker thread rather than the event loop.
            manager = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.processor.structured_output_manager)
            await manager.compile_async(params.structured_outputs)

    # --8<-- [start:abort]
    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its stream ends with finish_reason "abort"."""
        self._commands.put(_Abort([request_id]))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight end with finish_reason "abort"."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._commands.put(_Shutdown())
        if self.core_process is not None:
            self.core_process.join(timeout)  # terminated if it does not stop in time
            self._input_thread.join(timeout)
        self._thread.join(timeout)
        if self.core_process is not None:
            self.core_process.close()
        self.processor.shutdown()  # the grammar compiler's threads
    # --8<-- [end:abort]

    # ---- the engine thread --------------------------------------------------------
    # --8<-- [start:run]
    @staticmethod
    def run_engine_loop(
        engine: LLMEngine,
        next_command: Callable[[bool], _Add | _Abort | _Shutdown | None],
        apply: Callable[[_Add | _Abort], None],
        emit: Callable[[list[RequestOutput]], None],
    ) -> None:
        """The engine loop: apply commands, step while there is work, block when idle.

        The engine thread runs it, and so does an engine process
        (`core_process.py`), each with its own way to take commands
        (`next_command(block)`: None when none has come and `block` is False)
        and to hand outputs on (`emit`). It returns on `_Shutdown`.
        """
        while True:
            # Block only when idle: with work in hand, take what has arrived and step.
            block = not engine.has_unfinished_requests()
            while (cmd := next_command(block)) is not None:
                if isinstance(cmd, _Shutdown):
                    return
                apply(cmd)
                block = False
            if engine.has_unfinished_requests():
                emit(engine.step())

    def _run(self) -> None:
        """The engine thread."""
        try:
            self.run_engine_loop(self.engine, self._next_command, self._apply, self._dispatch)
            self._abort_all("the engine is shutting down")
            self._fail_all(EngineDeadError(self._dead_message()))
        except BaseException as e:
            logger.exception("the engine thread died")
            self.dead_error = e
            self._fail_all(EngineDeadError(self._dead_message()))
        finally:
            self.engine.shutdown()  # a tensor-parallel engine's workers: none outlives it

    def _next_command(self, block: bool) -> _Add | _Abort | _Shutdown | None:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None
    # --8<-- [end:run]

    # --8<-- [start:dispatch]
    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            if not self._register(cmd.request.request_id, cmd.stream):
                return
            try:
                self.engine.add_processed_request(cmd.request)
            except ValueError as e:  # e.g. it can never fit the KV cache
                self._refuse(cmd.request.request_id, e)
        else:
            with self._lock:
                live = [rid for rid in cmd.request_ids if rid in self._streams]
            if live:
                self._dispatch(self.engine.abort_request(live))

    def _register(self, request_id: str, stream: _Stream) -> bool:
        """Give a new request its stream; or refuse it (through the stream) and return False."""
        with self._lock:
            if self.dead_error is not None:
                error: Exception = EngineDeadError(self._dead_message())
            elif request_id in self._streams:
                error = ValueError(f"request id {request_id!r} is already in use")
            else:
                self._streams[request_id] = stream
                return True
        stream.put(error)
        return False

    def _refuse(self, request_id: str, error: Exception) -> None:
        """End a registered request that the engine could not add, with `error`."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One hand-off per event loop per step, not one per request: each
        # call_soon_threadsafe wakes the loop (a write to its self-pipe) and
        # makes the two threads trade the GIL.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, object]]] = {}
        with self._lock:
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
        self._dispatch(self.engine.abort_request(self._live_request_ids()))
        logger.info("%s", reason)

    def _live_request_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
        if self.core_process is not None:
            return  # the input thread still reads the commands: it refuses each add
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
