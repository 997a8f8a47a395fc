"""Attention over a paged KV cache: the step's metadata and the torch reference.

One engine step runs a flat batch of `T` new tokens from `S` sequences. Each
new token's K/V is written to its cache slot (`write_kv_cache`), then each new
token attends to every cached token of its own sequence up to and including
itself (`paged_attention`). Prefills, chunked-prefill continuations and
decodes are the same operation with different query lengths, so they share
one batch.

The functions here are the reference: simple torch, one sequence at a time.
The model's attention layer (`mini_vllm.layers.attention.Attention`) goes
through an `AttentionBackend`, so a GPU backend (custom kernels for decode)
can replace either half without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]


# --8<-- [start:metadata]
@dataclass
class AttentionMetadata:
    """Where the step's new tokens go in the KV cache and what each may attend to.

    Tensors live on the model's device; `query_start_loc_cpu` and
    `context_lens_cpu` are host copies so the reference path can slice
    without a device-to-host sync.

    Attributes:
        slot_mapping: `[T] int64`, cache slot of each new token
            (`block_id * block_size + offset`); -1 marks a padding token that
            is not written.
        query_start_loc: `[S+1] int32`, cumulative new-token counts: sequence
            `i`'s new tokens are `q[query_start_loc[i]:query_start_loc[i+1]]`.
        context_lens: `[S] int32`, tokens each sequence has in the cache after
            this step, its new tokens included.
        block_tables: `[S, max_blocks] int32`, the blocks of each sequence in
            order, padded with 0 (block 0 is never handed out, so padding
            points at junk that nothing reads).
        max_query_len: the largest number of new tokens of one sequence.
        max_context_len: the largest `context_lens` entry.
        query_start_loc_cpu: `query_start_loc` as a python list.
        context_lens_cpu: `context_lens` as a python list.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    query_start_loc_cpu: list[int]
    context_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        """Number of sequences `S` in the step."""
        return len(self.context_lens_cpu)

    @property
    def num_actual_tokens(self) -> int:
        """New tokens that belong to a sequence (the batch may be padded past them)."""
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence computes exactly one new token."""
        return self.max_query_len == 1
# --8<-- [end:metadata]


# --8<-- [start:write_kv_cache]
def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K and V into their cache slots.

    Args:
        k: `[T, num_kv_heads, head_dim]` keys of the new tokens (after RoPE).
        v: `[T, num_kv_heads, head_dim]` values.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, written in place.
        v_cache: same shape as `k_cache`.
        slot_mapping: `[T] int64`; token `t` goes to slot `slot_mapping[t]`,
            and a slot of -1 is skipped.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # A slot is a row of the cache seen as one long list of token positions.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):  # padded tokens: drop them (a host sync; reference only)
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    k_flat[slot_mapping] = k.to(k_flat.dtype)
    v_flat[slot_mapping] = v.to(v_flat.dtype)
# --8<-- [end:write_kv_cache]


# --8<-- [start:paged_attention]
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context.

    NOTE: the cache already holds this step's K/V (`write_kv_cache` ran
    first), so sequence `i` has `ctx = context_lens[i]` cached tokens of which
    its `n` new tokens are the last `n`. New token `j` (0-based) sits at
    position `ctx - n + j` and sees cached tokens `0 .. ctx - n + j`:

        n = 3 new tokens, ctx = 7 cached tokens (4 from earlier steps)

                 cached:  0  1  2  3  4  5  6
        new token 0 (pos 4)  x  x  x  x  x  .  .
        new token 1 (pos 5)  x  x  x  x  x  x  .
        new token 2 (pos 6)  x  x  x  x  x  x  x

    A prefill has `n == ctx`, a decode `n == 1`; both are this same mask.

    With a `sliding_window` of `W` (Mistral), a token at position `p` sees
    only the last `W` positions, `p - W + 1 .. p` (W = 3 below):

                 cached:  0  1  2  3  4  5  6
        new token 0 (pos 4)  .  .  x  x  x  .  .
        new token 1 (pos 5)  .  .  .  x  x  x  .
        new token 2 (pos 6)  .  .  .  .  x  x  x

    Args:
        q: `[T, num_heads, head_dim]` queries of the new tokens (after RoPE).
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
        v_cache: same shape as `k_cache`.
        meta: the step's metadata.
        scale: softmax scale, usually `head_dim ** -0.5`.
        sliding_window: the number of positions a token sees, itself
            included; None for the whole context.

    Returns:
        `[T, num_heads, head_dim]`; rows of padding tokens (past
        `meta.num_actual_tokens`) are zero.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    qsl, ctx_lens = meta.query_start_loc_cpu, meta.context_lens_cpu
    for i, ctx in enumerate(ctx_lens):
        start, end = qsl[i], qsl[i + 1]
        n = end - start
        if n == 0:
            continue
        num_blocks = (ctx + block_size - 1) // block_size
        blocks = meta.block_tables[i, :num_blocks].long()
        # Gather the sequence's blocks, then drop the unused tail of the last one.
        k = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx]
        mask = None
        if n > 1 or (sliding_window is not None and ctx > sliding_window):
            key_pos = torch.arange(ctx, device=q.device)
            query_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, ctx], True = attend
            if sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, n, D]
            k.transpose(0, 1),  # [Hkv, ctx, D]
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,  # query head h reads KV head h // (Hq / Hkv)
        )
        out[start:end] = o.transpose(0, 1)  # [n, Hq, D]
    return out
# --8<-- [end:paged_attention]


# --8<-- [start:backend]
class AttentionBackend(Protocol):
    """The two operations attention needs from a device.

    The reference (`TorchAttentionBackend`) runs anywhere; a GPU backend can
    override either method (e.g. a paged-attention decode kernel when
    `meta.is_decode_only`) and defer to the reference for the rest.
    """

    name: str

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attend `q` over the cache (which already holds this step's K/V).

        `key` / `value` are this step's new K/V `[T, Hkv, D]`: a backend may
        read them directly rather than the cache (a prompt with no cached
        prefix has all its context right there). `sliding_window`: each token
        sees only that many positions, itself included (None: all).
        """
        ...


class TorchAttentionBackend:
    """The torch reference: `write_kv_cache` and `paged_attention` above."""

    name = "torch"

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)


# --8<-- [end:backend]


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "TorchAttentionBackend",
    "paged_attention",
    "write_kv_cache",
]
