"""The attention layer: store the step's new K/V in the paged cache, then attend."""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    TorchAttentionBackend,
)


# --8<-- [start:attention_layer]
class Attention(nn.Module):
    """The attention of one decoder layer over its paged KV cache.

    It owns no weights; the projections, norms and RoPE stay in the model. How
    the cache is written and read is the backend's business: the torch
    reference (`mini_vllm.attention`) by default, the CUDA kernels on a GPU.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads (a divisor of `num_heads`).
        head_dim: size of one head.
        scale: softmax scale.
        backend: how to write and read the cache; the torch reference by default.
        sliding_window: each token attends to this many positions, itself
            included (Mistral); None for the whole context.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = backend or TorchAttentionBackend()
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend the new tokens `q [T, Hq, D]` (with `k`, `v` `[T, Hkv, D]`) -> `[T, Hq, D]`."""
        k_cache, v_cache = kv_cache
        self.backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale, k, v,
                                            sliding_window=self.sliding_window)
# --8<-- [end:attention_layer]


__all__ = ["Attention"]
