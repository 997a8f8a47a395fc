"""Attention for prefill and for prompts that continue a cached prefix.

Every new token of a sequence attends to the sequence's paged context up to
and including itself. Measured on an H200 (chapter 8), the fastest way we
have is PyTorch's FlashAttention-2 varlen kernel over K/V gathered out of the
paged cache by our gather kernel; with no cached prefix anywhere in the
batch, the step's own K/V are used directly and nothing is gathered. Where
FlashAttention is missing (CPU, float32, older PyTorch) a torch-only path
runs scaled_dot_product_attention sequence by sequence.

    query rows:   | seq 0: q0 new tokens | seq 1: q1 | ...       (query_start_loc)
    gathered K/V: | seq 0: n0 context tokens | seq 1: n1 | ...  (cu_seqlens_k)
    causal, aligned at the end: row j of seq i sees keys 0 .. n_i - q_i + j
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mini_vllm.ops._checks import check_kv_cache, check_tensor
from mini_vllm.ops._extension import is_available
from mini_vllm.ops.cache_ops import gather_kv_cache
from mini_vllm.ops.reference import gather_context_ref

PREFILL_BACKENDS = ("flash_varlen", "sdpa")


def prefill_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The fastest prefill path available for this device and dtype."""
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(device)[0] >= 8):
        return "flash_varlen"
    return "sdpa"


def _gather_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, cu_k: torch.Tensor, total: int,
                  max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K/V of every sequence's context, by our kernel or by torch indexing."""
    if k_cache.is_cuda and is_available():
        return gather_kv_cache(k_cache, v_cache, block_tables, cu_k, total, max_k)
    block_size = k_cache.shape[1]
    seq = torch.repeat_interleave(
        torch.arange(len(context_lens), device=k_cache.device), context_lens.long(),
        output_size=total)  # [total] sequence of each row
    pos = torch.arange(total, device=k_cache.device) - cu_k[seq].long()  # position in its seq
    slots = block_tables[seq, pos // block_size].long() * block_size + pos % block_size
    flat = (-1, *k_cache.shape[2:])
    return k_cache.view(flat)[slots], v_cache.view(flat)[slots]


def _sdpa_per_sequence(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, starts: Sequence[int],
                       lens: Sequence[int], scale: float) -> torch.Tensor:
    """Torch-only path: SDPA over each sequence's gathered context."""
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        # [n, Hkv, D] -> [Hq, n, D]
        k = gather_context_ref(k_cache, block_tables[i], n).transpose(0, 1)
        v = gather_context_ref(v_cache, block_tables[i], n).transpose(0, 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = query[lo:hi].transpose(0, 1)  # [Hq, Lq, D]
        q_pos = torch.arange(n - (hi - lo), n, device=query.device)
        mask = torch.arange(n, device=query.device)[None, :] <= q_pos[:, None]  # [Lq, n]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[lo:hi] = o.transpose(0, 1)
    return out


# --8<-- [start:prefill]
def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    query_start_loc_cpu: Sequence[int],
    context_lens_cpu: Sequence[int],
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Call it after this step's K/V were written into the cache.

    Args:
        query: [num_tokens, num_q_heads, head_dim].
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        v_cache: like `k_cache`.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        query_start_loc: [num_seqs + 1] int32 cumulative new-token counts.
        context_lens: [num_seqs] int32 tokens in the cache per sequence,
            the new ones included.
        scale: softmax scale.
        query_start_loc_cpu: `query_start_loc` as host ints.
        context_lens_cpu: `context_lens` as host ints.
        key: this step's K [num_tokens, num_kv_heads, head_dim] (optional):
            when no sequence has a cached prefix, attention reads it directly
            instead of gathering the cache.
        value: this step's V, with `key`.
        backend: "flash_varlen" or "sdpa"; None picks the fastest available.

    Returns:
        [num_tokens, num_q_heads, head_dim] in the query's dtype.
    """
    check_tensor("query", query, ndim=3, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                 contiguous=False)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, (query.dtype,))
    num_seqs = len(context_lens_cpu)
    if len(query_start_loc_cpu) != num_seqs + 1 or query_start_loc_cpu[-1] != query.shape[0]:
        raise ValueError("query_start_loc_cpu must have num_seqs + 1 entries ending at "
                         f"num_tokens = {query.shape[0]}")
    q_lens = [query_start_loc_cpu[i + 1] - query_start_loc_cpu[i] for i in range(num_seqs)]
    if any(q > n for q, n in zip(q_lens, context_lens_cpu)):
        raise ValueError("each sequence's context_len must include its new tokens")
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit KV heads {num_kv_heads} "
                         f"x head_dim {head_dim}")
    backend = backend or prefill_backend(query.device, query.dtype)
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {PREFILL_BACKENDS}")
    if num_seqs == 0:
        return torch.empty_like(query)
    if backend == "sdpa":
        return _sdpa_per_sequence(query, k_cache, v_cache, block_tables, query_start_loc_cpu,
                                  context_lens_cpu, scale)

    max_q, max_k = max(q_lens), max(context_lens_cpu)
    if key is not None and value is not None and q_lens == list(context_lens_cpu):
        k, v, cu_k = key, value, query_start_loc  # no cached prefix: nothing to gather
    else:
        cu_k = F.pad(torch.cumsum(context_lens, 0, dtype=torch.int32), (1, 0))
        k, v = _gather_paged(k_cache, v_cache, block_tables, context_lens, cu_k,
                             sum(context_lens_cpu), max_k)
    # FlashAttention-2 aligns the causal mask at the bottom right when a
    # sequence has more keys than queries: exactly "new tokens at the end".
    out = torch.ops.aten._flash_attention_forward(
        query if query.stride(-1) == 1 else query.contiguous(), k, v, query_start_loc, cu_k,
        max_q, max_k, 0.0, True, False, scale=scale)[0]
    return out
# --8<-- [end:prefill]
