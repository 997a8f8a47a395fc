"""The vocabulary's two ends: token ids to vectors, and vectors to logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.layers.linear import Linear


# --8<-- [start:embedding]
class VocabEmbedding(nn.Module):
    """Token id -> row of a `[vocab_size, hidden_size]` table (left uninitialised)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype),
            requires_grad=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T] -> [T, hidden]


class LMHead(Linear):
    """`[N, hidden] -> [N, vocab]` logits; with tied embeddings, the embedding's table.

    Tied, the head owns no weight of its own: it multiplies by the embedding's
    parameter, which `named_parameters()` then lists once (as the embedding's),
    so the loader never asks a tied checkpoint for `lm_head.weight`.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        tied_to: VocabEmbedding | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, [vocab_size], device="meta" if tied_to else device,
                         dtype=dtype)
        if tied_to is not None:
            self.weight = tied_to.weight  # one tensor under two names
# --8<-- [end:embedding]


__all__ = ["LMHead", "VocabEmbedding"]
