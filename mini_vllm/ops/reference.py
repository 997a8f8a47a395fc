"""Compact torch references of every kernel, written for clarity, not speed.

The tests compare each CUDA kernel against these on random inputs. They use
the same KV-cache layout as the engine:

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      [num_seqs, max_blocks_per_seq] int32 (padding: block 0)
    context_lens      [num_seqs] int32, tokens in the cache (the new one included)
    slot_mapping      [num_tokens] int64, block * block_size + offset, -1 = skip

Attention is computed in float32 and returned in the query's dtype.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key` / `value` [num_tokens, num_kv_heads, head_dim] into their slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # [num_blocks, block_size, H, D] -> [num_slots, H, D]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_context_ref(cache: torch.Tensor, block_table: torch.Tensor,
                       context_len: int) -> torch.Tensor:
    """The first `context_len` tokens of one sequence: [context_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    # [n, block_size, H, D] -> [n * block_size, H, D]
    return cache[blocks].flatten(0, 1)[:context_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """q [Lq, Hq, D] over k, v [Lk, Hkv, D] in float32; mask [Lq, Lk] True = keep."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    qf = q.float().view(q.shape[0], num_kv_heads, group, q.shape[2])  # [Lq, Hkv, G, D]
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale  # [Hkv, G, Lq, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())  # [Lq, Hkv, G, D]
    return out.reshape(q.shape[0], num_q_heads, q.shape[2])


def paged_decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its whole paged context.

    Args:
        query: [num_seqs, num_q_heads, head_dim].
        context_lens: tokens to attend to; 0 gives a zero output.

    Returns:
        [num_seqs, num_q_heads, head_dim] in the query's dtype.
    """
    out = torch.zeros_like(query, dtype=torch.float32)
    for i, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        k = gather_context_ref(k_cache, block_tables[i], n)
        v = gather_context_ref(v_cache, block_tables[i], n)
        out[i] = _attend(query[i : i + 1], k, v, scale, None)[0]
    return out.to(query.dtype)


def prefill_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """New tokens of each sequence over its paged context, causally.

    Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`; they
    are its last q_len tokens, so query row j sits at position
    `context_len - q_len + j` and sees the cache up to and including itself:

        context:  [ cached prefix ........ | new tokens  ]
        row j:    attends to positions 0 .. context_len - q_len + j

    Args:
        query: [num_tokens, num_q_heads, head_dim].
        query_start_loc: [num_seqs + 1] cumulative new-token counts.
        context_lens: [num_seqs] tokens in the cache after this step's write.

    Returns:
        [num_tokens, num_q_heads, head_dim] in the query's dtype.
    """
    out = torch.empty_like(query, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for i, n in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k = gather_context_ref(k_cache, block_tables[i], n)
        v = gather_context_ref(v_cache, block_tables[i], n)
        q_pos = torch.arange(n - (hi - lo), n, device=query.device)
        mask = torch.arange(n, device=query.device)[None, :] <= q_pos[:, None]  # [Lq, Lk]
        out[lo:hi] = _attend(query[lo:hi], k, v, scale, mask)
    return out.to(query.dtype)
