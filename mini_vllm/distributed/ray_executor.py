"""The `"ray"` executor: the workers as Ray actors in a placement group.

Ray starts, places and supervises the workers; the executor only asks. A
placement group reserves one bundle per rank (a GPU, or a CPU on a machine
without one) all at once, before anything starts, and `PACK` fills one node
before the next: a group that fits one node stays on it (the all-reduces run
over NVLink), a larger one spans nodes (over the network). Bundle 0 is rank
0's, pinned to this node (`node:<ip>`): the engine's own process, where the
scheduler and the sampler run, is rank 0, and a placeholder actor holds its
reservation so that Ray gives its GPU to nobody else.

    placement group (PACK)
    ┌─ node A (this one) ────────────────────┐   ┌─ node B ───────────────┐
    │ bundle 0: placeholder → rank 0 = engine │   │ bundle 2: RayWorker r2 │
    │ bundle 1: RayWorker r1                  │   │ bundle 3: RayWorker r3 │
    └─────────────────────────────────────────┘   └────────────────────────┘

Inside a data-parallel replica (itself a Ray actor that Ray gave a GPU) rank
0 is the replica's actor and its device is already reserved: the group then
has bundles for ranks 1 .. N-1 only.

Each `RayWorker` runs the same `Worker` as a process of the `"mp"` backend:
it joins the group at rank 0's address and follows the steps broadcast on
the host group. Its `run` call returns when the driver says stop; if the
actor dies, that call's result is an error: that is how the executor learns
of a death.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from mini_vllm.distributed.executor import Executor
from mini_vllm.distributed.worker import Worker, WorkerSetup

logger = logging.getLogger(__name__)

# How long to wait for Ray to reserve the placement group's resources.
PLACEMENT_TIMEOUT_S = 120.0


def import_ray() -> Any:
    """`ray`, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray backend needs Ray: pip install 'mini-vllm[ray]'") from None
    return ray


class RayWorker:
    """A tensor-parallel rank inside a Ray actor (`ray.remote(RayWorker)`)."""

    def start(self, setup: WorkerSetup) -> None:
        """Join the group and build this rank's runner (returns once it is built)."""
        self.worker = Worker(setup)

    def run(self) -> None:
        """Follow the driver's steps until it says stop."""
        self.worker.run()
        self.worker.close()


class _Placeholder:
    """Holds rank 0's bundle so that Ray gives its device to no other actor."""

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()]


# --8<-- [start:ray_executor]
class RayExecutor(Executor):
    """The other ranks as Ray actors in a placement group (see the module docstring)."""

    def _driver_host(self) -> str:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init()  # joins the cluster RAY_ADDRESS names, else starts a local one
        return ray.util.get_node_ip_address()

    def _driver_device(self) -> torch.device:
        if self.engine_config.device.type != "cuda":
            return self.engine_config.device
        if self._placeholder is None:  # a replica's actor: Ray gave it its GPU
            return torch.device("cuda", 0)
        # The GPU Ray reserved for rank 0, by its number on this node: this process
        # must see the node's GPUs as numbered (no CUDA_VISIBLE_DEVICES of its own).
        ray = import_ray()
        return torch.device("cuda", ray.get(self._placeholder.gpu_ids.remote())[0])

    def _start_workers(self, init_method: str) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.engine_config.device.type == "cuda"
        unit = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        in_actor = ray.get_runtime_context().get_actor_id() is not None
        bundles = [dict(unit) for _ in range(self.world_size - (1 if in_actor else 0))]
        if not in_actor:  # bundle 0: rank 0, on this node
            bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
        self.pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"Ray could not reserve {bundles} for tensor_parallel_size "
                               f"{self.world_size} within {PLACEMENT_TIMEOUT_S:.0f} s "
                               f"(cluster: {ray.cluster_resources()})")

        def in_bundle(i: int) -> dict[str, Any]:
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, i),
                    "num_gpus": 1 if gpu else 0, "num_cpus": 0 if gpu else 1}

        self._placeholder = (None if in_actor else
                             ray.remote(_Placeholder).options(**in_bundle(0)).remote())
        first = 0 if in_actor else 1
        self.actors, self._runs = [], []
        for rank in range(1, self.world_size):
            actor = ray.remote(RayWorker).options(**in_bundle(rank - 1 + first)).remote()
            setup = WorkerSetup(self.engine_config, rank, self.world_size, init_method, 1,
                                device=torch.device("cuda", 0) if gpu else None)
            actor.start.remote(setup)  # joins the group; the driver joins meanwhile
            self._runs.append(actor.run.remote())  # queued behind start: the step loop
            self.actors.append(actor)
    # --8<-- [end:ray_executor]

    def _dead_workers(self, wait_s: float = 0.0) -> list[str]:
        ray = import_ray()
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=wait_s)
        dead = []
        for ref in done:
            rank = self._runs.index(ref) + 1
            try:
                ray.get(ref)
                why = "left its loop"
            except Exception as e:  # noqa: BLE001 - RayActorError when the actor died, or its error
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            dead.append(f"rank {rank} (Ray actor, {why})")
        return dead

    def _stop_workers(self, timeout: float) -> None:
        ray = import_ray()
        if getattr(self, "_runs", None):
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "_placeholder", None) is not None:
            ray.kill(self._placeholder)
        if getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)

    def _start_monitor(self) -> None:
        if self.device.type == "cuda":  # (on the CPU a death fails the next collective)
            threading.Thread(target=self._watch, daemon=True, name="mini-vllm-ray-watch").start()

    def _watch(self) -> None:
        import_ray().wait(self._runs, num_returns=1)
        if not self._closed:
            self._on_worker_death()


__all__ = ["RayExecutor", "RayWorker", "import_ray"]
