"""The driver's side of a tensor-parallel engine: rank 0 here, the other ranks elsewhere.

The engine drives one model runner (`execute`, `to_host`, `num_blocks`,
`device`). With `tensor_parallel_size > 1` that runner is an executor: it
starts the other ranks, joins the group as rank 0, builds rank 0's own
runner in the engine's process, and runs every step on all ranks at once.
The scheduler and the sampler stay in the engine, on rank 0's device; the
logits rank 0 returns are whole (the LM head gathers them).

    engine (driver process)
    ├── Scheduler, Sampler, detokenizer
    └── Executor ─── rank 0's ModelRunner (GPU 0)
            │  host group (gloo): each step's entries
            ├──► worker rank 1 (GPU 1)    process of "mp" / Ray actor of "ray"
            ├──► worker rank 2 (GPU 2)
            └──► ...

A worker that dies ends the engine, never hangs it: its sockets close, the
driver's next collective fails at once, and the executor raises
`WorkerDiedError` naming the rank. The engine lets that error through (it is
not one request's failure): `LLM.generate` raises it, and the server fails
the requests in flight and answers 503 from then on. `shutdown` stops every
worker and waits for it.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from dataclasses import replace

import torch

from mini_vllm.config import EngineConfig
from mini_vllm.distributed.parallel_state import (
    ParallelContext,
    destroy_parallel_context,
    free_port,
    init_parallel_context,
)
from mini_vllm.distributed.worker import Step, WorkerSetup, make_rank_runner, rank_device
from mini_vllm.model_runner import BatchEntry, HostCopy, ModelRunner

logger = logging.getLogger(__name__)

# How long `shutdown` waits for a worker to leave its loop before killing it.
WORKER_EXIT_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A rank of the tensor-parallel group has died: the engine cannot go on."""


# --8<-- [start:executor]
class Executor:
    """Runs each step on every rank of the tensor-parallel group; rank 0 is in this process.

    Subclasses start the other ranks (`_start_workers`) and say which of them
    have died (`_dead_workers`).

    Args:
        engine_config: the engine's configuration (`parallel_config` gives the size).

    Attributes:
        driver: rank 0's model runner.
        parallel: rank 0's place in the group.
        device / num_blocks / block_size: rank 0's (the same blocks on every rank).
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.world_size = engine_config.parallel_config.tensor_parallel_size
        self._error: str | None = None  # set once a worker has died
        self._closed = False
        self.parallel = ParallelContext()
        host = self._driver_host()
        init_method = f"tcp://{host}:{free_port(host)}"
        self._start_workers(init_method)
        try:
            device = self._driver_device()
            # Blocks until every worker has joined: rank 0 listens at init_method.
            self.parallel = init_parallel_context(0, self.world_size, init_method, device)
            self.driver: ModelRunner = make_rank_runner(replace(engine_config, device=device),
                                                        self.parallel)
        except BaseException as e:
            dead = self._dead_workers(wait_s=2.0)
            # No stop message: a worker may be inside a collective of the start-up.
            # Closing its lifeline (or killing its actor) stops it.
            self._error = "the engine failed to start"
            self.shutdown()
            if dead:
                raise WorkerDiedError(self._describe(dead, "while the model loaded")) from e
            raise
        self.device = self.driver.device
        self.num_blocks = self.driver.num_blocks
        self.block_size = self.driver.block_size
        self._start_monitor()

    # --8<-- [start:execute]
    def execute(self, entries: list[BatchEntry], prev_sampled: torch.Tensor | None = None,
                float_logits: bool = True) -> torch.Tensor:
        """`ModelRunner.execute` on every rank; rank 0's logits (whole: `[N, vocab]`).

        Raises:
            WorkerDiedError: a rank has died (now or before).
            ValueError: the runner refused the entries (every rank did).
        """
        if self._error is not None:
            raise WorkerDiedError(self._error)
        dead = self._dead_workers()
        if dead:
            raise self._died(dead)
        uses_prev = prev_sampled is not None and any(e.prev_sample_row >= 0 for e in entries)
        try:
            self.parallel.broadcast_object(Step(
                entries, prev_sampled.shape[0] if uses_prev else 0,
                prev_sampled.dtype if uses_prev else torch.int64))
            if uses_prev:  # the workers have the entries, not last step's samples
                self.parallel.broadcast(prev_sampled.contiguous())
            return self.driver.execute(entries, prev_sampled, float_logits)
        except ValueError:
            raise
        except Exception as e:  # a collective failed: has a rank died?
            dead = self._dead_workers(wait_s=2.0)
            if dead:
                raise self._died(dead) from e
            raise
    # --8<-- [end:execute]

    @property
    def graph_memory_bytes(self) -> int:
        """What rank 0's CUDA graphs hold (0 without graphs)."""
        return getattr(self.driver, "graph_memory_bytes", 0)

    def to_host(self, tensors: list[torch.Tensor]) -> HostCopy:
        """Start copying a step's results to the host (rank 0's runner does it)."""
        return self.driver.to_host(tensors)

    # --8<-- [start:shutdown]
    def shutdown(self) -> None:
        """Stop every worker (they leave their loop, or are killed) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._error is None and self.parallel.world_size > 1:
            try:
                self.parallel.broadcast_object(None)  # stop: the workers leave their loop
            except Exception:  # a worker is gone: the others are stopped below
                logger.warning("a worker did not take the stop message", exc_info=True)
        self._stop_workers(WORKER_EXIT_TIMEOUT_S)
        destroy_parallel_context(self.parallel)
    # --8<-- [end:shutdown]

    def _died(self, dead: list[str]) -> WorkerDiedError:
        self._error = self._describe(dead, "")
        logger.error("%s", self._error)
        return WorkerDiedError(self._error)

    def _describe(self, dead: list[str], when: str) -> str:
        return (f"tensor-parallel worker {', '.join(dead)} died{' ' + when if when else ''}; "
                "the engine cannot run without it")

    def _on_worker_death(self) -> None:
        """Called by the monitor when a worker dies outside `shutdown`: on a GPU, abort
        the NCCL communicator, so that a collective waiting for the dead rank returns
        (with garbage, never read: the next step raises WorkerDiedError) instead of
        hanging the GPU and the host's wait on it."""
        if self._closed or self.device.type != "cuda":
            return
        try:
            self.parallel.group.abort()
        except Exception:  # best effort
            logger.exception("aborting the NCCL communicator failed")

    # ---- what a backend provides --------------------------------------------------
    def _driver_host(self) -> str:
        """The address the other ranks reach rank 0 at."""
        return "127.0.0.1"

    def _driver_device(self) -> torch.device:
        """Rank 0's device."""
        return rank_device(self.engine_config.device, 0)

    def _start_workers(self, init_method: str) -> None:
        raise NotImplementedError

    def _dead_workers(self, wait_s: float = 0.0) -> list[str]:
        """Descriptions of the workers that have died (waiting up to `wait_s` for one to)."""
        raise NotImplementedError

    def _stop_workers(self, timeout: float) -> None:
        raise NotImplementedError

    def _start_monitor(self) -> None:
        """Start watching the workers (see `_on_worker_death`)."""
# --8<-- [end:executor]


# --8<-- [start:mp]
class MultiprocExecutor(Executor):
    """The other ranks as processes of this host (`python -m mini_vllm.distributed.worker`).

    Each worker reads its `WorkerSetup` from its stdin, which then stays open
    as a lifeline: when this process exits, however it exits, the worker sees
    the end of file and exits too, so no worker outlives its engine.
    """

    def _start_workers(self, init_method: str) -> None:
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, self.world_size):
            setup = WorkerSetup(self.engine_config, rank, self.world_size, init_method, threads)
            proc = subprocess.Popen([sys.executable, "-m", "mini_vllm.distributed.worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            proc.stdin.write(pickle.dumps(setup))
            proc.stdin.flush()  # (kept open: the lifeline)
            self.procs.append(proc)

    def _dead_workers(self, wait_s: float = 0.0) -> list[str]:
        for proc in self.procs:
            if proc.poll() is None and wait_s > 0:
                try:
                    proc.wait(wait_s)  # a rank in trouble is usually on its way out
                except subprocess.TimeoutExpired:
                    pass
                wait_s = 0.0
        return [self._describe_exit(rank, proc) for rank, proc in enumerate(self.procs, 1)
                if proc.poll() is not None]

    @staticmethod
    def _describe_exit(rank: int, proc: subprocess.Popen) -> str:
        code = proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        error = proc.stdout.read().decode(errors="replace").strip() if proc.stdout else ""
        return f"rank {rank} (pid {proc.pid}, {how}{': ' + error if error else ''})"

    def _stop_workers(self, timeout: float) -> None:
        for proc in self.procs:
            proc.stdin.close()  # the lifeline: a worker still waiting exits now
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("worker pid %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def _start_monitor(self) -> None:
        for proc in self.procs:
            threading.Thread(target=self._watch, args=(proc,), daemon=True,
                             name=f"mini-vllm-watch-{proc.pid}").start()

    def _watch(self, proc: subprocess.Popen) -> None:
        proc.wait()
        if not self._closed:
            logger.error("tensor-parallel worker pid %d exited (code %s)", proc.pid,
                         proc.returncode)
            self._on_worker_death()
# --8<-- [end:mp]


def make_executor(engine_config: EngineConfig) -> Executor:
    """The executor of `engine_config.parallel_config.distributed_executor_backend`."""
    if engine_config.parallel_config.distributed_executor_backend == "ray":
        from mini_vllm.distributed.ray_executor import RayExecutor

        return RayExecutor(engine_config)
    return MultiprocExecutor(engine_config)


__all__ = ["Executor", "MultiprocExecutor", "WorkerDiedError", "make_executor"]
