"""The tensor-parallel group: who this process is among the ranks, and how they talk.

A model split over `N` ranks computes each layer's matrix products on its own
shard of the weights and then combines the partial results: an all-reduce
(the sum of every rank's tensor, on every rank) after a row-parallel product,
an all-gather (every rank's slice, side by side) for the logits. Which group
of processes takes part, and this process's place in it, is one explicit
object, `ParallelContext`, handed to the model when it is built. No module
keeps it in a global: a block that communicates holds the context it was
given.

At `N = 1` the context is the trivial one (`ParallelContext()`): every
collective returns its input untouched, and the parallel blocks compute
exactly what the plain ones do.

Two process groups make one context:

- `group`, for tensors on the model's device: NCCL between GPUs, gloo on the
  CPU. The all-reduces inside the forward run here; on a GPU they are
  launched on the current stream, so a CUDA graph can capture them.
- `cpu_group`, always gloo, for what the host sends: the step's batch entries
  from the driver to the workers (`broadcast_object`), the agreement on the
  number of KV blocks (`min_int`). A worker waits here between steps, so this
  group's timeout is long (`IDLE_TIMEOUT`).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a collective may wait for the other ranks before it fails. A rank
# that has died makes the others fail at once (its sockets close); this only
# bounds a rank that is alive and stuck.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# The workers wait for the next step on the host group: an idle server may wait for days.
IDLE_TIMEOUT = datetime.timedelta(days=365)


# PyTorch 2.13 renames `all_gather_into_tensor` (and deprecates the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --8<-- [start:context]
@dataclass(frozen=True)
class ParallelContext:
    """This process's place in a tensor-parallel group, and the group's collectives.

    Attributes:
        rank: this process's rank, `0 .. world_size - 1` (rank 0 is the driver).
        world_size: the ranks that share the model (the tensor-parallel size).
        group: the process group for tensors on the model's device (NCCL or
            gloo); None when `world_size` is 1.
        cpu_group: a gloo group for host-side messages; None when `world_size` is 1.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    cpu_group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")
        if self.world_size > 1 and (self.group is None or self.cpu_group is None):
            raise ValueError(f"a group of {self.world_size} ranks needs its process groups")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the sum. Returns `x`."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order, on every rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        _all_gather_single(out, x, group=self.group)  # the ranks' x stacked along dim 0
        return torch.cat(out.view(self.world_size, *x.shape).unbind(0), dim=dim)
# --8<-- [end:context]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x` (same shape and dtype), in place."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` (any picklable object), returned on every rank (host group)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value` (host group)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def shard_size(self, total: int, what: str) -> int:
        """`total // world_size`, raising when `total` does not divide evenly.

        Raises:
            ValueError: naming `what` (a config field) and the sizes.
        """
        if total % self.world_size:
            raise ValueError(f"tensor_parallel_size: {what} ({total}) is not divisible by "
                             f"the tensor-parallel size ({self.world_size})")
        return total // self.world_size


# --8<-- [start:init]
def init_parallel_context(rank: int, world_size: int, init_method: str,
                          device: torch.device) -> ParallelContext:
    """Join the group of `world_size` ranks that meet at `init_method`.

    Every rank calls this with the same `init_method` (`tcp://host:port`, where
    rank 0 listens) and its own `rank`; it returns once all have joined.

    Args:
        rank: this process's rank.
        world_size: the number of ranks.
        init_method: where rank 0 listens for the others.
        device: the model's device: NCCL for CUDA, gloo otherwise.

    Raises:
        RuntimeError: another group is already set up in this process (one
            tensor-parallel engine per process), or the ranks did not meet.
    """
    if world_size == 1:
        return ParallelContext()
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group: one "
                           "tensor-parallel engine per process (shut the other one down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    # Every rank creates the groups in the same order (a collective itself).
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelContext(rank, world_size, dist.group.WORLD, cpu_group)
# --8<-- [end:init]


def destroy_parallel_context(ctx: ParallelContext) -> None:
    """Leave the group (this process may then join another); a no-op at one rank."""
    if ctx.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for rank 0 to listen on)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


__all__ = ["COLLECTIVE_TIMEOUT", "IDLE_TIMEOUT", "ParallelContext", "destroy_parallel_context",
           "free_port", "init_parallel_context"]
