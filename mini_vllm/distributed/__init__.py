"""Tensor parallelism on one host and beyond it (Part IV).

- `parallel_state`: the explicit tensor-parallel group (`ParallelContext`)
  and its collectives (all-reduce, all-gather), over NCCL on GPUs and gloo
  on CPUs.
- `worker`: one rank's process: its share of the model and of the KV cache,
  one step per message from the driver.
- `executor`: the driver's side, in front of the engine: rank 0 in the
  engine's own process, the other ranks as processes it starts (`"mp"`) or
  as Ray actors in a placement group (`"ray"`, `ray_executor`).
- `data_parallel`: several engine replicas as Ray actors behind one server.
"""

from mini_vllm.distributed.parallel_state import (
    ParallelContext,
    destroy_parallel_context,
    init_parallel_context,
)

__all__ = ["ParallelContext", "destroy_parallel_context", "init_parallel_context"]
