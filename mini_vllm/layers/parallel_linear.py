"""Linear layers split across the ranks of a tensor-parallel group.

A transformer layer has two matrix products in a row in each sub-layer:
q/k/v then o in attention, gate/up then down in the MLP. Megatron-LM's split
needs one all-reduce per sub-layer:

    x (every rank) ─► column-parallel: each rank holds some OUTPUT rows of W1
                      (some heads; some of the intermediate features)
                      └─► y_r = x @ W1_r.T   (no communication: rank r's columns of y)
                  ─► row-parallel: each rank holds the matching INPUT columns of W2
                      └─► z_r = y_r @ W2_r.T (a partial sum of the whole z)
                  ─► all-reduce: z = Σ_r z_r on every rank

Everything between the two products (attention over the rank's own heads,
SiLU · mul over its own features) is local to the rank, because a head or an
intermediate feature lives on one rank only.

Each class is a `Linear` holding this rank's part of the weight, so the
product itself, reference or fast (our GEMV, `gemm_wgmma`, the SiLU epilogue,
`add_to`), is `Linear`'s. What a parallel layer adds is which rows or columns
it holds, how it loads them out of a whole checkpoint tensor
(`weight_loader`), and, for the row-parallel one, the all-reduce. With the
trivial `ParallelContext` (one rank) each one holds the whole weight and
computes exactly what `Linear` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.distributed.parallel_state import ParallelContext
from mini_vllm.layers.linear import Linear, copy_checked


@dataclass(frozen=True)
class _Shard:
    """One stacked projection as a column-parallel layer holds it.

    Attributes:
        total: the projection's rows in the checkpoint.
        rows: the rows this rank holds.
        start: the first of them, in the checkpoint's rows.
    """

    total: int
    rows: int
    start: int


# --8<-- [start:column]
class ColumnParallelLinear(Linear):
    """`y = x @ W.T` with the output features (rows of `W`) split over the ranks.

    Rank `r` of `N` holds rows `[r * n/N, (r+1) * n/N)` of each stacked
    projection and returns those columns of `y`: no communication; what
    follows works on its own columns (or a row-parallel layer takes them).

    Args:
        input_size: features in (every rank sees all of them).
        output_size: features out, in all ranks together.
        bias: whether the layer adds a bias (split like the rows).
        parallel: the tensor-parallel group (one rank when None).
        device: where to allocate the weight.
        dtype: the weight's dtype.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        parallel: ParallelContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parallel = parallel or ParallelContext()
        rows = parallel.shard_size(output_size, "output features")
        self._init_shards(input_size, [_Shard(output_size, rows, parallel.rank * rows)],
                          bias, parallel, device, dtype)

    def _init_shards(self, input_size: int, shards: list[_Shard], bias: bool,
                     parallel: ParallelContext, device: torch.device | str | None,
                     dtype: torch.dtype | None) -> None:
        super().__init__(input_size, [s.rows for s in shards], bias, device, dtype)
        self.parallel = parallel
        self.shards = shards

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy this rank's rows of the checkpoint's projection `shard_id` into `param`."""
        if shard_id is None:
            if len(self.shards) != 1:
                raise ValueError(f"a layer of {len(self.shards)} stacked projections needs "
                                 "the shard_id of each checkpoint tensor")
            shard_id = 0
        shard = self.shards[shard_id]
        full = (shard.total, *param.shape[1:])  # what the checkpoint holds
        if tuple(loaded.shape) != full:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {full}")
        offset = sum(s.rows for s in self.shards[:shard_id])  # where it goes in `param`
        copy_checked(param.data.narrow(0, offset, shard.rows),
                     loaded.narrow(0, shard.start, shard.rows))
# --8<-- [end:column]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked (gate and up), each split over
    the ranks: rank `r` holds `[gate_r; up_r]`, so its output is `[gate_r | up_r]`
    and SiLU · mul stays local.

    Args:
        input_size: features in.
        output_sizes: the rows of each stacked projection, in all ranks together.
        bias, parallel, device, dtype: as for `ColumnParallelLinear`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        parallel: ParallelContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parallel = parallel or ParallelContext()
        shards = []
        for size in output_sizes:
            rows = parallel.shard_size(size, "output features")
            shards.append(_Shard(size, rows, parallel.rank * rows))
        self._init_shards(input_size, shards, bias, parallel, device, dtype)


def kv_heads_per_rank(total_num_kv_heads: int, world_size: int) -> int:
    """KV heads each rank holds: an even share, or one (replicated) when there
    are fewer KV heads than ranks."""
    return max(1, total_num_kv_heads // world_size)


# --8<-- [start:qkv]
class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections stacked, split by attention heads.

    The query heads are divided evenly. The KV heads are too when there are at
    least as many as ranks; with fewer, each KV head is replicated on
    `N / num_kv_heads` ranks, and each rank holds the one KV head its query
    heads read (grouped-query attention):

        8 query heads, 2 KV heads, 4 ranks
        rank        0          1          2          3
        q heads     0 1        2 3        4 5        6 7
        kv head     0          0          1          1     (q head h reads kv head h // 4)

    Args:
        hidden_size: features in.
        head_size: the size of one head.
        total_num_heads: query heads in the model.
        total_num_kv_heads: key/value heads in the model.
        bias, parallel, device, dtype: as for `ColumnParallelLinear`.

    Attributes:
        num_heads: query heads on this rank.
        num_kv_heads: KV heads on this rank.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        parallel: ParallelContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parallel = parallel or ParallelContext()
        n, rank = parallel.world_size, parallel.rank
        num_heads = parallel.shard_size(total_num_heads, "num_attention_heads")
        if total_num_kv_heads >= n:
            num_kv_heads = parallel.shard_size(total_num_kv_heads, "num_key_value_heads")
            kv_start = rank * num_kv_heads
        else:
            if n % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({n}) must be a multiple of num_key_value_heads "
                    f"({total_num_kv_heads}) when it is larger (each KV head is replicated)")
            num_kv_heads, kv_start = 1, rank // (n // total_num_kv_heads)
        d = head_size
        q = _Shard(total_num_heads * d, num_heads * d, rank * num_heads * d)
        kv = _Shard(total_num_kv_heads * d, num_kv_heads * d, kv_start * d)
        self._init_shards(hidden_size, [q, kv, kv], bias, parallel, device, dtype)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
# --8<-- [end:qkv]


# --8<-- [start:row]
class RowParallelLinear(Linear):
    """`z = y @ W.T` with the input features (columns of `W`) split over the ranks,
    followed by the all-reduce that sums the ranks' partial products.

    Rank `r` holds columns `[r * k/N, (r+1) * k/N)` and takes the same columns
    of `y` (what a column-parallel layer left on it). The bias is added once,
    after the sum.

    Args:
        input_size: features in, in all ranks together.
        output_size: features out.
        bias: whether the layer adds a bias.
        parallel: the tensor-parallel group (one rank when None).
        device: where to allocate the weight.
        dtype: the weight's dtype.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        parallel: ParallelContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parallel = parallel or ParallelContext()
        cols = parallel.shard_size(input_size, "input features")
        super().__init__(cols, [output_size], bias, device, dtype)
        self.parallel = parallel
        self.total_input_size = input_size

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward_native(x)
        z = self.parallel.all_reduce(F.linear(x, self.weight))  # [T, out]: Σ_r y_r @ W_r.T
        return z if self.bias is None else z.add_(self.bias)

    def forward_fast(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward_fast(x, out)
        z = self.parallel.all_reduce(self._product(x, out))
        return z if self.bias is None else z.add_(self.bias)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out += Σ_r x_r @ W_r.T`: the partial products summed over the ranks
        first, then added into `out` (the residual stream, the same on every rank)."""
        if self.parallel.world_size == 1:
            super().add_to(x, out)
            return
        if self.bias is not None:
            raise ValueError("add_to: a layer with a bias is not supported")
        out.add_(self.parallel.all_reduce(self._product(x)))
# --8<-- [end:row]

    def silu_and_mul(self, x: torch.Tensor, eps: float) -> torch.Tensor | None:
        raise ValueError("silu_and_mul: a row-parallel layer's output is a partial sum")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy this rank's columns of the checkpoint's weight (the whole bias)."""
        if shard_id is not None:
            raise ValueError("a row-parallel layer stacks no projections")
        if param.dim() == 1:  # the bias: every rank holds it, added once after the sum
            copy_checked(param.data, loaded)
            return
        full = (param.shape[0], self.total_input_size)
        if tuple(loaded.shape) != full:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {full}")
        cols = self.input_size
        copy_checked(param.data, loaded.narrow(1, self.parallel.rank * cols, cols))


__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "RowParallelLinear", "kv_heads_per_rank"]
