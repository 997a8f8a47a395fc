"""Data parallelism: several engine replicas as Ray actors behind one server.

Tensor parallelism makes one engine faster or larger; data parallelism runs
`N` whole engines side by side, each with its own KV cache, scheduler and
tensor-parallel group, and sends each request to one of them. Nothing is
shared between replicas, so nothing crosses between them during a step: the
only traffic is a request going in and its outputs streaming out.

    HTTP clients ─► OpenAI server ─► DataParallelAsyncLLM (this process)
                                       │ tokenize + validate (400s here)
                                       │ pick the least-loaded replica
                       ┌───────────────┼───────────────┐
                       ▼               ▼               ▼
                 EngineReplica 0  EngineReplica 1  ... (Ray actors, one per replica)
                 AsyncLLM         AsyncLLM
                 TP group of its  TP group of its
                 own ("mp"/"ray") own

`DataParallelAsyncLLM` has the surface of `AsyncLLM` that the server uses
(`generate`, `abort`, `get_stats`, `is_running`, `errored`, `shutdown`,
`engine_config`, `tokenizer`), so `build_app` serves it unchanged. A
replica's outputs stream back through a Ray streaming generator, one Ray
object per output. "Least loaded" is the replica with the fewest requests in
flight from this front, counted here: no round trip to ask.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.distributed.ray_executor import import_ray
from mini_vllm.engine.async_engine import AsyncLLM, EngineDeadError
from mini_vllm.engine.input_processor import InputProcessor
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# --8<-- [start:replica]
class EngineReplica:
    """One engine replica inside a Ray actor (`ray.remote(EngineReplica)`): an `AsyncLLM`
    on the actor's event loop, its engine on a thread of the actor's process.

    Args:
        engine_args: the engine arguments (resolved here, on the replica's node).
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        args = replace(engine_args, data_parallel_size=1, engine_process=False)
        self.llm = AsyncLLM(args.create_engine_config())

    def engine_config(self) -> EngineConfig:
        return self.llm.engine_config

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (called with `num_returns="streaming"`)."""
        async for out in self.llm.generate(prompt_token_ids, params, request_id, priority):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def get_stats(self) -> dict[str, Any]:
        return self.llm.get_stats()

    def shutdown(self) -> None:
        self.llm.shutdown()
# --8<-- [end:replica]


# --8<-- [start:front]
class DataParallelAsyncLLM:
    """`data_parallel_size` engine replicas behind one `AsyncLLM`-shaped front.

    Args:
        engine_args: the engine arguments; `data_parallel_size` replicas are
            started, each with `tensor_parallel_size` ranks of its own.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: a replica failed to start (its error is the cause).
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        ray = import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()  # joins the cluster RAY_ADDRESS names, else starts a local one
        n = engine_args.data_parallel_size
        if n < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {n}")
        self.replicas = [ray.remote(EngineReplica).options(**self._resources(engine_args))
                         .remote(engine_args) for _ in range(n)]
        try:  # every replica's model loaded, or the first error
            configs = ray.get([r.engine_config.remote() for r in self.replicas])
        except Exception as e:
            self._kill_all()
            raise RuntimeError(f"an engine replica failed to start: {e}") from e
        self.engine_config: EngineConfig = configs[0]
        self.processor = InputProcessor(self.engine_config)  # validation stays here
        self.tokenizer = self.processor.tokenizer
        self.generation_config = self.processor.generation_config
        self.load = [0] * n  # requests in flight on each replica
        self.dead: list[str | None] = [None] * n
        self._shutting_down = False

    @staticmethod
    def _resources(args: EngineArgs) -> dict[str, Any]:
        """What Ray reserves for one replica's actor: its GPU (all of its group's with
        the "mp" backend, whose workers are its own processes), or one CPU."""
        ray = import_ray()
        gpu = (args.device.startswith("cuda") if args.device != "auto"
               else ray.cluster_resources().get("GPU", 0) > 0)
        if not gpu:
            return {"num_cpus": 1}
        mp = args.distributed_executor_backend == "mp"
        return {"num_gpus": args.tensor_parallel_size if mp else 1, "num_cpus": 0}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> DataParallelAsyncLLM:
        return cls(engine_args)

    # ---- health ---------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True once every replica has died."""
        return all(d is not None for d in self.dead)

    @property
    def is_running(self) -> bool:
        return not self._shutting_down and not self.errored

    def _pick(self) -> int:
        """The live replica with the fewest requests in flight (the first of equals)."""
        live = [i for i, d in enumerate(self.dead) if d is None]
        if self._shutting_down or not live:
            raise EngineDeadError("the engine is shut down" if self._shutting_down else
                                  f"every engine replica has died: {self.dead}")
        return min(live, key=lambda i: self.load[i])
    # --8<-- [end:front]

    # --8<-- [start:generate]
    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncLLM.generate` on the least-loaded replica.

        Raises:
            ValueError: the request is invalid (checked here, before any replica).
            EngineDeadError: no replica is alive, or this one died under the request.
            RequestFailedError: the replica failed while computing this request.
        """
        ray = import_ray()
        request_id = request_id or uuid.uuid4().hex
        processed = self.processor.process_inputs(request_id, prompt, sampling_params, priority)
        await self.compile_structured_output(processed.params)
        i = self._pick()
        replica = self.replicas[i]
        self.load[i] += 1
        finished = False
        try:
            stream = replica.generate.options(num_returns="streaming").remote(
                processed.prompt_token_ids, processed.params, request_id, priority)
            async for ref in stream:
                out: RequestOutput = await ref
                finished = out.finished
                out.prompt, out.prompt_token_ids = processed.prompt, processed.prompt_token_ids
                yield out
        except ray.exceptions.RayActorError as e:  # the replica's process died
            self.dead[i] = str(e).splitlines()[0] if str(e) else type(e).__name__
            finished = True
            raise EngineDeadError(f"engine replica {i} died: {self.dead[i]}") from None
        except ray.exceptions.RayTaskError as e:  # the replica raised: its own error
            finished = True
            raise e.cause from None
        finally:
            self.load[i] -= 1
            if not finished:  # the caller went away: free the replica's slot
                replica.abort.remote(request_id)
    # --8<-- [end:generate]

    async def compile_structured_output(self, params: SamplingParams) -> None:
        """`AsyncLLM.compile_structured_output`: validated here, compiled again by the replica."""
        if params.structured_outputs is not None:
            # The first use builds the manager (imports xgrammar, reads the vocabulary):
            # a second or two, on a worker thread rather than the event loop.
            manager = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.processor.structured_output_manager)
            await manager.compile_async(params.structured_outputs)

    async def abort(self, request_id: str) -> None:
        """Abort a request on every replica (only the one that has it acts)."""
        for replica, dead in zip(self.replicas, self.dead):
            if dead is None:
                replica.abort.remote(request_id)
        await asyncio.sleep(0)

    def get_stats(self) -> dict[str, Any]:
        """The live replicas' statistics summed, and each replica's load."""
        ray = import_ray()
        live = [r for r, d in zip(self.replicas, self.dead) if d is None]
        total: dict[str, Any] = {}
        try:
            for stats in ray.get([r.get_stats.remote() for r in live], timeout=10):
                for key, value in stats.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        total[key] = total.get(key, 0) + value
        except Exception:  # a replica died meanwhile: its requests say so
            logger.warning("could not read every replica's statistics", exc_info=True)
        total["data_parallel_size"] = len(self.replicas)
        total["replica_load"] = list(self.load)
        return total

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every replica (requests in flight end with "abort") and its workers."""
        if self._shutting_down:
            return
        self._shutting_down = True
        ray = import_ray()
        live = [r for r, d in zip(self.replicas, self.dead) if d is None]
        try:
            ray.get([r.shutdown.remote() for r in live], timeout=timeout)
        except Exception:  # a replica that does not stop is killed below
            logger.warning("an engine replica did not shut down cleanly", exc_info=True)
        self._kill_all()
        self.processor.shutdown()  # the grammar compiler's threads, if it was used
        if self._owns_ray:
            ray.shutdown()

    def _kill_all(self) -> None:
        ray = import_ray()
        for replica in self.replicas:
            ray.kill(replica)


__all__ = ["DataParallelAsyncLLM", "EngineReplica"]
