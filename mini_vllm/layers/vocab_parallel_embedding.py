"""The vocabulary's two ends split across the ranks of a tensor-parallel group.

The embedding table and the LM head are `[vocab, hidden]`: for Qwen3-8B,
151,936 × 4,096 values each, 1.2 GiB apiece in bfloat16. Both are split by
vocabulary rows: rank `r` of `N` holds rows `[r * V', (r+1) * V')` with
`V' = ceil(V / N)` (the last rank's rows past `V` are zeros).

    embedding   id ─► the rank that holds row `id` looks it up, the others
                      give zeros ─► all-reduce: the row on every rank
    LM head     h  ─► each rank: logits of its V' tokens ─► all-gather along
                      the vocabulary ─► [N, V] on every rank (rank 0 samples)

With tied embeddings the head multiplies by the embedding's shard, which is
the same rows. With one rank each class holds the whole table and computes
what `VocabEmbedding` / `LMHead` do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.distributed.parallel_state import ParallelContext
from mini_vllm.layers.linear import copy_checked
from mini_vllm.layers.vocab_embedding import LMHead, VocabEmbedding


class _VocabShard:
    """The vocabulary rows `[vocab_start, vocab_end)` this rank holds, in `rows_per_rank`
    rows of its table (padded with zero rows past the vocabulary)."""

    def __init__(self, vocab_size: int, parallel: ParallelContext) -> None:
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // parallel.world_size)  # ceil
        self.vocab_start = min(parallel.rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of a checkpoint's `[vocab, hidden]` table into `param`."""
        full = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {full}")
        n = self.vocab_end - self.vocab_start
        copy_checked(param.data[:n], loaded[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()  # padding rows: no token maps here


# --8<-- [start:embedding]
class VocabParallelEmbedding(VocabEmbedding):
    """Token id -> row of the `[vocab_size, hidden]` table, the rows split over the ranks.

    Args:
        num_embeddings: the vocabulary size.
        embedding_dim: the hidden size.
        parallel: the tensor-parallel group (one rank when None).
        device: where to allocate the table.
        dtype: its dtype.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        parallel: ParallelContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parallel = parallel or ParallelContext()
        shard = _VocabShard(num_embeddings, parallel)
        super().__init__(shard.rows_per_rank, embedding_dim, device, dtype)
        self.parallel = parallel
        self.shard = shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward(input_ids)
        start, end = self.shard.vocab_start, self.shard.vocab_end
        elsewhere = (input_ids < start) | (input_ids >= end)  # [T]: rows other ranks hold
        local_ids = (input_ids - start).masked_fill_(elsewhere, 0)
        rows = F.embedding(local_ids, self.weight)  # [T, hidden]
        rows.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.parallel.all_reduce(rows)  # one rank's row plus zeros: the row

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy this rank's rows of the checkpoint's table."""
        self.shard.load_rows(param, loaded)
# --8<-- [end:embedding]


# --8<-- [start:lm_head]
class ParallelLMHead(LMHead):
    """`[N, hidden] -> [N, vocab]` logits, each rank computing its rows of the
    vocabulary and the ranks' logits gathered side by side.

    Args:
        hidden_size: features in.
        vocab_size: the vocabulary size.
        tied_to: the embedding whose table (this rank's rows of it) the head
            multiplies by, or None for a weight of its own.
        parallel: the tensor-parallel group (one rank when None).
        device: where to allocate the weight.
        dtype: its dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        tied_to: VocabParallelEmbedding | None = None,
        parallel: ParallelContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parallel = parallel or ParallelContext()
        shard = _VocabShard(vocab_size, parallel)
        super().__init__(hidden_size, shard.rows_per_rank, tied_to, device, dtype)
        self.parallel = parallel
        self.shard = shard

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self._gather(super().forward_native(x))

    def forward_fast(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward_fast(x, out)
        return self._gather(super().forward_fast(x))

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """`[N, V']` logits of this rank's rows -> `[N, V]` of the whole vocabulary."""
        if self.parallel.world_size == 1:
            return local
        logits = self.parallel.all_gather(local, dim=-1)  # [N, world * V']
        if logits.shape[-1] != self.shard.vocab_size:  # the padding rows' logits
            logits = logits[:, : self.shard.vocab_size].contiguous()
        return logits

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy this rank's rows of the checkpoint's `lm_head.weight`."""
        self.shard.load_rows(param, loaded)
# --8<-- [end:lm_head]


__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]
