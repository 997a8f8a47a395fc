"""One rank of a tensor-parallel group, other than the driver's.

A worker holds its rank's share of the model and a KV cache of its rank's KV
heads, and runs the same steps as rank 0, in lockstep: the driver broadcasts
each step's batch entries over the host group, every rank runs its forward,
and the forward's all-reduces meet on the device group. Rank 0 keeps the
logits; a worker's are dropped.

    driver (rank 0)                              worker (rank r)
    ───────────────                              ───────────────
    schedule                                     broadcast_object() ◄─ waits here
    broadcast_object(Step(entries)) ────────────►   Step(entries)
    [broadcast(prev_sampled)] ──────────────────►   [prev_sampled]
    forward ── all-reduce ◄═══ device group ═══► forward ── all-reduce
    logits ─► sampler                             (logits dropped)
    ...                                          broadcast_object() ◄─ waits again
    broadcast_object(None) ─────────────────────►   stop: leave the loop

The same `Worker` runs in a process the driver started (`python -m
mini_vllm.distributed.worker`, the `"mp"` backend) and inside a Ray actor
(the `"ray"` backend).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from dataclasses import dataclass, replace

import torch

from mini_vllm.config import EngineConfig
from mini_vllm.distributed.parallel_state import (
    ParallelContext,
    destroy_parallel_context,
    init_parallel_context,
)
from mini_vllm.model_runner import BatchEntry, ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class WorkerSetup:
    """What a worker needs to join its group and build its share of the model.

    Attributes:
        engine_config: the engine's configuration (its device is resolved per rank).
        rank: this worker's rank (1 .. world_size - 1).
        world_size: the tensor-parallel size.
        init_method: where rank 0 listens (`tcp://host:port`).
        num_threads: torch's intra-op threads for a CPU worker.
        device: the worker's device; None for `rank_device(engine_config.device, rank)`
            (a Ray actor sees only the GPU Ray gave it: `cuda:0`).
    """

    engine_config: EngineConfig
    rank: int
    world_size: int
    init_method: str
    num_threads: int = 1
    device: torch.device | None = None


# --8<-- [start:step]
@dataclass
class Step:
    """One engine step as the driver broadcasts it.

    Attributes:
        entries: the step's batch entries, as the runner takes them.
        prev_rows: rows of the previous step's sampled ids that the entries
            read (`BatchEntry.prev_sample_row`, async scheduling), 0 if none;
            the driver broadcasts that tensor on the device group next.
        prev_dtype: its dtype.
    """

    entries: list[BatchEntry]
    prev_rows: int = 0
    prev_dtype: torch.dtype = torch.int64
# --8<-- [end:step]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: GPU `rank` on a GPU (of those this process sees), else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def make_rank_runner(engine_config: EngineConfig, parallel: ParallelContext) -> ModelRunner:
    """One rank's model runner: the GPU runner on a GPU, the reference one elsewhere."""
    if engine_config.device.type == "cuda":
        from mini_vllm.gpu.model_runner import GPUModelRunner

        return GPUModelRunner(engine_config, parallel)
    return ModelRunner(engine_config, parallel)


# --8<-- [start:worker]
class Worker:
    """A rank other than the driver's: join the group, build the runner, follow the steps.

    Args:
        setup: the rank, the group's meeting point and the engine's configuration.
    """

    def __init__(self, setup: WorkerSetup) -> None:
        config = setup.engine_config
        device = setup.device or rank_device(config.device, setup.rank)
        if device.type == "cpu":
            torch.set_num_threads(setup.num_threads)
        self.parallel = init_parallel_context(setup.rank, setup.world_size,
                                              setup.init_method, device)
        self.runner = make_rank_runner(replace(config, device=device), self.parallel)

    def run(self) -> None:
        """Follow the driver's steps until it broadcasts None (stop)."""
        while (step := self.parallel.broadcast_object()) is not None:
            prev = None
            if step.prev_rows:  # the values of last step's samples, from rank 0
                prev = torch.empty(step.prev_rows, dtype=step.prev_dtype,
                                   device=self.runner.device)
                self.parallel.broadcast(prev)
            try:
                self.runner.execute(step.entries, prev, float_logits=False)
            except ValueError:
                # Entries the runner refuses are refused before any collective,
                # by rank 0 too: the engine fails those requests and goes on.
                logger.debug("rank %d: step refused", self.parallel.rank, exc_info=True)

    def close(self) -> None:
        destroy_parallel_context(self.parallel)
# --8<-- [end:worker]


def _watch_lifeline(stream: object) -> None:
    """Exit when the driver's end of our stdin closes: the driver is gone."""
    stream.read()  # type: ignore[attr-defined]  # returns at end of file only
    os._exit(1)


def main() -> None:
    """`python -m mini_vllm.distributed.worker`: a worker process of the `"mp"` backend.

    stdin brings the pickled `WorkerSetup` and then stays open: its end of
    file means the driver has exited, and the worker exits too. The original
    stdout carries one line back if the worker fails (its error); everything
    the worker prints goes to stderr.
    """
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # print() and tqdm go to stderr; fd 1's copy is the report channel
    logging.basicConfig(level=os.environ.get("MINI_VLLM_WORKER_LOG", "WARNING"),
                        format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    setup: WorkerSetup = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_watch_lifeline, args=(sys.stdin.buffer,), daemon=True).start()
    try:
        worker = Worker(setup)
        worker.run()
        worker.close()
    except BaseException as e:  # reported to the driver, then exit
        logger.exception("worker rank %d failed", setup.rank)
        report.write(f"{type(e).__name__}: {e}".replace("\n", " ") + "\n")
        report.flush()
        os._exit(1)
    report.close()
    os._exit(0)  # without the interpreter's teardown (torch's takes seconds)


if __name__ == "__main__":
    main()


__all__ = ["Step", "Worker", "WorkerSetup", "make_rank_runner", "rank_device"]
