"""The engine core in a process of its own: `AsyncLLM`'s step loop, away from the server's GIL.

```
 server process (front)                              engine-core process
 ──────────────────────                              ───────────────────
 generate ─ process_inputs ─► commands (queue.Queue)
                                 │ input thread ──── pipe ───► _Add / _Abort / _Shutdown
                                 │                                    │
                                 │                           AsyncLLM.run_engine_loop
                                 │                           (the engine thread's loop)
                                 │                                    │ LLMEngine.step()
 _dispatch ◄─ decode ◄─ output thread (recv) ◄─ pipe ◄── one message per step:
   └─► call_soon_threadsafe per event loop                ("outputs", rows of primitives, stats)
```

The child is started with `spawn` (a forked child cannot use CUDA), builds
the engine and answers `("ready", stats)` or `("failed", error)`. Then it runs
the same loop as the engine thread: take every command that has arrived, step
while there is work, block in `recv()` only when idle. A step's outputs cross
as one pickled list of tuples of strings, ints and floats (`encode_outputs`):
pickling a tree of dataclasses costs several times more, and this is the only
serialisation on the engine's critical path. The prompt does not travel back;
the front knows it.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
from multiprocessing.connection import Connection

import torch

from mini_vllm.config import EngineConfig
from mini_vllm.engine.async_engine import AsyncLLM, EngineDeadError, _Abort, _Add, _Shutdown
from mini_vllm.engine.heap import freeze_heap
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger(__name__)

# The engine process attaches its statistics to a step's message at most this often
# while it steps (and always to the message after which it is idle).
STATS_INTERVAL_S = 0.05


# --8<-- [start:codec]
def encode_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """One step's outputs as tuples of primitives, cheap to pickle (prompts left out)."""
    return [(o.request_id, o.finished, o.error, o.num_cached_tokens, o.metrics,
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
               None if c.logprobs is None else _encode_logprobs(c.logprobs))
              for c in o.outputs])
            for o in outputs]


def decode_outputs(rows: list[tuple]) -> list[RequestOutput]:
    """`RequestOutput`s back from `encode_outputs`' rows; `generate` fills in the prompt."""
    return [RequestOutput(request_id, None, [],
                          [CompletionOutput(index, text, token_ids,
                                            None if lps is None else _decode_logprobs(lps),
                                            finish_reason, stop_reason)
                           for index, text, token_ids, finish_reason, stop_reason, lps in comps],
                          finished, num_cached_tokens, error, metrics)
            for request_id, finished, error, num_cached_tokens, metrics, comps in rows]
# --8<-- [end:codec]


def _encode_logprobs(logprobs: list[dict[int, Logprob]]) -> list[list[tuple]]:
    return [[(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items()]
            for entry in logprobs]


def _decode_logprobs(rows: list[list[tuple]]) -> list[dict[int, Logprob]]:
    return [{t: Logprob(value, rank, text) for t, value, rank, text in entry} for entry in rows]


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError that carries its repr."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means "not portable"
        return RuntimeError(repr(error))


# --8<-- [start:child]
def run_engine_core(engine_cls: type[LLMEngine], engine_config: EngineConfig,
                    commands: Connection, outputs: Connection, log_level: int,
                    num_threads: int) -> None:
    """The engine-core process: build the engine, then run the loop until told to stop."""
    # Ctrl-C reaches every process of the terminal's group: the front decides
    # what happens (it sends _Shutdown), not the signal. (SIGTERM keeps its
    # default: it is how the front stops a child that does not listen.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_logging(log_level)
    torch.set_num_threads(num_threads)
    code = _serve(engine_cls, engine_config, commands, outputs)
    # Leave without the interpreter's teardown, which takes a second or more with
    # torch loaded: nothing here needs it (the driver frees the GPU's memory).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(engine_cls: type[LLMEngine], engine_config: EngineConfig,
           commands: Connection, outputs: Connection) -> int:
    """Build the engine and run the loop; the process's exit code."""
    try:
        engine = engine_cls(engine_config)
    except BaseException as e:  # noqa: BLE001 - reported to the front, which raises it
        outputs.send(("failed", _portable(e)))
        return 1
    core = _EngineCore(engine, commands, outputs)
    freeze_heap()  # this process is the engine from here on (engine/heap.py)
    outputs.send(("ready", engine.get_stats()))
    try:
        AsyncLLM.run_engine_loop(engine, core.next_command, core.apply, core.emit)
    except BrokenPipeError:  # the front process is gone
        return 0
    except BaseException as e:
        logger.exception("the engine process's loop died")
        try:
            outputs.send(("error", _portable(e)))
        except OSError:
            pass
        return 1
    finally:
        engine.shutdown()  # a tensor-parallel engine's workers stop with it
    return 0


class _EngineCore:
    """The engine process's side of the loop: commands from one pipe, outputs into another."""

    def __init__(self, engine: LLMEngine, commands: Connection, outputs: Connection) -> None:
        self.engine = engine
        self.commands, self.outputs = commands, outputs
        self.stats_time = time.monotonic()

    def next_command(self, block: bool) -> _Add | _Abort | _Shutdown | None:
        """The next command, or None when none has arrived and `block` is False."""
        if not block and not self.commands.poll():
            return None
        try:
            return self.commands.recv()
        except EOFError:  # the front process is gone: stop as if told to
            return _Shutdown()

    def apply(self, cmd: _Add | _Abort) -> None:
        """Add a request (a refusal goes back as a ValueError's message) or abort some."""
        if isinstance(cmd, _Add):
            try:
                self.engine.add_processed_request(cmd.request)
            except ValueError as e:  # e.g. it can never fit the KV cache
                self.outputs.send(("refused", cmd.request.request_id, str(e)))
        else:
            self.emit(self.engine.abort_request(cmd.request_ids))

    def emit(self, outputs: list[RequestOutput]) -> None:
        """Send a step's outputs as one message, with the statistics when they are due."""
        stats = None
        now = time.monotonic()
        # Every STATS_INTERVAL_S, and with the message that leaves the engine idle:
        # the front then sees the last outputs and the idle state together.
        if now - self.stats_time >= STATS_INTERVAL_S or not self.engine.has_unfinished_requests():
            stats, self.stats_time = self.engine.get_stats(), now
        if outputs or stats is not None:
            self.outputs.send(("outputs", encode_outputs(outputs), stats))
# --8<-- [end:child]


# ---- the front's two threads, in the server process ------------------------------
# --8<-- [start:front]
def forward_commands(llm: AsyncLLM) -> None:
    """Input thread: register each new request's stream, send every command on.

    A thread of its own, so that a full pipe (the engine process in the
    middle of a long step) never blocks an event loop.
    """
    while True:
        cmd = llm._commands.get()
        if isinstance(cmd, _Add):
            if not llm._register(cmd.request.request_id, cmd.stream):
                continue
            cmd = _Add(cmd.request, None)  # the stream stays in this process
        elif isinstance(cmd, _Shutdown):  # like the engine thread's _abort_all
            llm.core_process.send(_Abort(llm._live_request_ids()))
        llm.core_process.send(cmd)
        if isinstance(cmd, _Shutdown):
            return


def receive_outputs(llm: AsyncLLM) -> None:
    """Output thread: deliver what the engine process sends, until it exits."""
    try:
        while True:
            messages = [llm.core_process.recv()]  # blocks, the GIL released
            # Whatever else arrived while this thread waited for the GIL is
            # handled in the same turn, its steps in one hand-off: behind a
            # busy event loop, one message per GIL turn would fall behind.
            while llm.core_process.ready():
                messages.append(llm.core_process.recv())
            outputs: list[RequestOutput] = []
            for kind, *body in messages:
                if kind == "outputs":
                    outputs += body[0]
                    if body[1] is not None:
                        llm._stats = body[1]
                    continue
                llm._dispatch(outputs)  # keep the order of what came before
                outputs = []
                if kind == "refused":
                    request_id, message = body
                    llm._refuse(request_id, ValueError(message))
                else:  # "error": its loop died, and the process is exiting
                    llm.dead_error = body[0]
                    llm._fail_all(EngineDeadError(llm._dead_message()))
            llm._dispatch(outputs)
    except EOFError:  # the engine process has exited
        pass
    except BaseException as e:  # a bug here must not leave streams waiting
        logger.exception("the engine output thread died")
        llm.dead_error = llm.dead_error or e
    if llm.dead_error is None and not llm._shutting_down:
        code = llm.core_process.join(timeout=5)
        llm.dead_error = RuntimeError(
            f"the engine process exited unexpectedly (exit code {code})")
    llm._fail_all(EngineDeadError(llm._dead_message()))
# --8<-- [end:front]


def _enlarge_pipe(conn: Connection, size: int = 1 << 20) -> None:
    """Let the outputs pipe hold dozens of steps (64 KiB by default, two or three).

    The engine blocks in `send` when the pipe is full; a larger pipe lets the
    front fall a few steps behind (its output thread waiting for the GIL)
    without stalling the engine. Linux only; elsewhere the default stays.
    """
    try:
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)
    except (AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
        pass


def _setup_logging(level: int) -> None:
    """The engine's log lines (KV-cache size, errors) to stderr, at the front's level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("mini_vllm")
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


class EngineCoreProcess:
    """The front's handle on the engine-core process: start it, talk to it, stop it.

    The constructor returns once the engine is built (the model loaded, the KV
    cache allocated) and raises the child's own error if that failed.

    Args:
        engine_config: the resolved configuration.
        engine_cls: the engine class to build in the child; it is pickled by
            name, so it must be importable there (a module-level class).

    Attributes:
        process: the child process.
        stats: the engine's statistics when it was built.
    """

    def __init__(self, engine_config: EngineConfig, engine_cls: type[LLMEngine] = LLMEngine) -> None:
        ctx = multiprocessing.get_context("spawn")  # a forked child cannot use CUDA
        commands_reader, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs_writer = ctx.Pipe(duplex=False)
        _enlarge_pipe(self._outputs)
        num_threads = torch.get_num_threads()
        if engine_config.device.type == "cpu":
            # The engine's matmuls run on the cores the front streams from: leave
            # the front one, or busy intra-op threads wait on each other.
            num_threads = max(1, num_threads - 1)
        self.process = ctx.Process(
            target=run_engine_core, name="mini-vllm-engine-core", daemon=True,
            args=(engine_cls, engine_config, commands_reader, outputs_writer,
                  logging.getLogger("mini_vllm").getEffectiveLevel(), num_threads))
        self.process.start()
        # The child holds its own copies now. Closing ours means that when the
        # child exits, for whatever reason, `recv()` here raises EOFError.
        commands_reader.close()
        outputs_writer.close()
        try:
            kind, payload = self._outputs.recv()  # the model loads meanwhile
        except EOFError:
            self.process.join()
            self.close()
            raise RuntimeError("the engine process exited while starting "
                               f"(exit code {self.process.exitcode})") from None
        if kind == "failed":
            self.process.join()
            self.close()
            raise payload
        self.stats: dict = payload

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, cmd: _Add | _Abort | _Shutdown) -> None:
        """Send a command; if the child is gone, drop it (`recv` reports the exit)."""
        try:
            self._commands.send(cmd)
        except OSError:
            pass

    def recv(self) -> tuple:
        """The child's next message, its outputs decoded (blocks, with the GIL released).

        Returns:
            `("outputs", [RequestOutput], stats or None)`, `("refused",
            request_id, message)` or `("error", exception)` (its loop died).

        Raises:
            EOFError: the child has exited.
        """
        msg = self._outputs.recv()
        if msg[0] == "outputs":
            return "outputs", decode_outputs(msg[1]), msg[2]
        return msg

    def ready(self) -> bool:
        """Whether a message is waiting (`recv` would not block)."""
        return self._outputs.poll()

    def join(self, timeout: float) -> int | None:
        """Wait for the child to exit, terminating it after `timeout`; its exit code."""
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s: terminating it",
                           timeout)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        return self.process.exitcode

    def close(self) -> None:
        self._commands.close()
        self._outputs.close()


__all__ = ["EngineCoreProcess", "decode_outputs", "encode_outputs", "forward_commands",
           "receive_outputs", "run_engine_core"]
