"""Attention for prefill and for prompts that continue a cached prefix.

Every new token of a sequence attends to the sequence's paged context up to
and including itself. With no cached prefix anywhere in the batch, the step's
own K/V are used directly. Otherwise, on an H100/H200 our Hopper kernel
(csrc/flash_prefill.cu, measured 1.5-2.1x PyTorch's FlashAttention-2 in
chapter 8) reads the contexts out of the paged cache through the block
tables; elsewhere PyTorch's FlashAttention-2 varlen kernel attends over K/V
gathered out of the cache by our gather kernel. Where FlashAttention is
missing (CPU, float32, older PyTorch) a torch-only path runs
scaled_dot_product_attention sequence by sequence.

    query rows:   | seq 0: q0 new tokens | seq 1: q1 | ...       (query_start_loc)
    gathered K/V: | seq 0: n0 context tokens | seq 1: n1 | ...  (cu_seqlens_k)
    causal, aligned at the end: row j of seq i sees keys 0 .. n_i - q_i + j
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mini_vllm.ops._checks import check_kv_cache, check_same_device, check_tensor
from mini_vllm.ops._extension import dtype_code, extension, is_available
from mini_vllm.ops.cache_ops import gather_kv_cache
from mini_vllm.ops.reference import gather_context_ref

PREFILL_BACKENDS = ("flash_wgmma", "flash_varlen", "sdpa")
# The backends that read each sequence's bounds from device memory (a CUDA
# graph can hold them: the lone-prompt graph of chapter 9); SDPA loops on the host.
CAPTURABLE_PREFILL_BACKENDS = ("flash_wgmma", "flash_varlen")
# Our Hopper kernel (csrc/flash_prefill.cu) takes head_dim 128 and an even
# number of query heads per KV head (a CTA serves two).
FLASH_WGMMA_HEAD_DIM = 128


# --8<-- [start:choose]
def flash_wgmma_supported(device: torch.device, dtype: torch.dtype, head_dim: int,
                          group: int) -> bool:
    """Whether our Hopper prefill kernel runs here, for these heads.

    Args:
        device: where attention runs.
        dtype: the query's dtype.
        head_dim: the head size.
        group: query heads per KV head.
    """
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_dim == FLASH_WGMMA_HEAD_DIM and group % 2 == 0 and is_available()
            and bool(extension().flash_prefill_supported()))


def prefill_backend(device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
                    group: int | None = None) -> str:
    """The fastest prefill path available for this device, dtype and heads.

    Our Hopper kernel where it runs (head_dim and group given), then PyTorch's
    FlashAttention-2, then SDPA sequence by sequence.
    """
    if (head_dim is not None and group is not None
            and flash_wgmma_supported(device, dtype, head_dim, group)):
        return "flash_wgmma"
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(device)[0] >= 8):
        return "flash_varlen"
    return "sdpa"
# --8<-- [end:choose]


def _check_token_rows(name: str, t: torch.Tensor) -> None:
    """[tokens, heads, 128] rows as the kernel's tensor maps read them: heads and
    dims dense, the row stride a multiple of 16 bytes and the start on 16 bytes."""
    check_tensor(name, t, ndim=3, dtypes=(torch.float16, torch.bfloat16), contiguous=False)
    if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) % 8:
        raise ValueError(f"{name}: heads and dims must be dense and the row stride a "
                         f"multiple of 8 elements, got strides {t.stride()}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: must start on 16 bytes")


def _check_flash_heads(query: torch.Tensor, num_kv_heads: int, kv_head_dim: int) -> None:
    """The heads our Hopper kernel takes: head_dim 128 on both sides, an even group."""
    _, num_q_heads, head_dim = query.shape
    if head_dim != FLASH_WGMMA_HEAD_DIM or kv_head_dim != head_dim:
        raise ValueError(f"head_dim must be {FLASH_WGMMA_HEAD_DIM} for query and keys, got "
                         f"{head_dim} and {kv_head_dim}")
    if num_q_heads % num_kv_heads or (num_q_heads // num_kv_heads) % 2:
        raise ValueError(f"query heads per KV head must be even, got {num_q_heads} / "
                         f"{num_kv_heads}")


def flash_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention of packed sequences by our Hopper kernel.

    Args:
        query: [total_q, num_q_heads, 128], heads and dims dense (rows may be strided).
        key: [total_k, num_kv_heads, 128], likewise.
        value: like `key`.
        cu_q: [num_seqs + 1] int32, query rows of each sequence (cumulative).
        cu_k: [num_seqs + 1] int32, key rows of each sequence; each sequence has
            at least as many keys as queries, and query j of a sequence with
            q_len queries and k_len keys sees keys 0 .. k_len - q_len + j.
        max_q: a bound of every sequence's query count (a host int; it sizes the grid).
        scale: softmax scale.
        out: optional [total_q, num_q_heads, 128] contiguous output.

    Returns:
        `out`, [total_q, num_q_heads, 128] in the query's dtype.

    Raises:
        ValueError: on shapes, dtypes or strides the kernel does not take (named).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_token_rows(name, t)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError("query, key and value must have one dtype")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    total_q, num_q_heads, head_dim = query.shape
    total_k, num_kv_heads, _ = key.shape
    _check_flash_heads(query, key.shape[1], key.shape[2])
    for name, t in (("cu_q", cu_q), ("cu_k", cu_k)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32,))
    check_same_device(query=query, key=key, value=value, cu_q=cu_q, cu_k=cu_k)
    if cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_q {tuple(cu_q.shape)} and cu_k {tuple(cu_k.shape)} must both "
                         "have num_seqs + 1 >= 2 entries")
    if out is None:
        out = torch.empty((total_q, num_q_heads, head_dim), dtype=query.dtype,
                          device=query.device)
    elif out.shape != query.shape or not out.is_contiguous() or out.dtype != query.dtype:
        raise ValueError(f"out must be contiguous {tuple(query.shape)} {query.dtype}")
    if total_q == 0 or max_q < 1:
        return out
    with torch.cuda.device(query.device):
        extension().flash_prefill(
            out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(),
            cu_q.data_ptr(), cu_k.data_ptr(), cu_q.shape[0] - 1, num_q_heads, num_kv_heads,
            head_dim, total_q, max(total_k, 1), query.stride(0), key.stride(0),
            value.stride(0), max_q, float(scale), dtype_code(query.dtype),
            torch.cuda.current_stream(query.device).cuda_stream)
    return out


def flash_prefill_paged(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, scale: float) -> torch.Tensor:
    """`flash_prefill` with K/V read straight out of the paged cache: no gather.

    Args:
        query: [total_q, num_q_heads, 128], heads and dims dense (rows may be strided).
        k_cache: [num_blocks, block_size, num_kv_heads, 128], contiguous, block_size a
            power of two from 16 to 256, holding every key (the new tokens' included).
        v_cache: like `k_cache`.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        cu_q: [num_seqs + 1] int32, query rows of each sequence (cumulative).
        cu_k: [num_seqs + 1] int32, cumulative key counts (each sequence's context
            length, at least its query count).
        max_q: a bound of every sequence's query count (a host int).
        scale: softmax scale.

    Returns:
        [total_q, num_q_heads, 128] in the query's dtype.

    Raises:
        ValueError: on shapes, dtypes or layouts the kernel does not take (named).
    """
    _check_token_rows("query", query)
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache,
                                                                    (query.dtype,))
    total_q, num_q_heads, _ = query.shape
    _check_flash_heads(query, num_kv_heads, head_dim)
    if not 16 <= block_size <= 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two from 16 to 256, got {block_size}")
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        raise ValueError("k_cache, v_cache: must start on 16 bytes (the TMA copies from them)")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    for name, t in (("cu_q", cu_q), ("cu_k", cu_k)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32,))
    check_same_device(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      cu_q=cu_q, cu_k=cu_k)
    num_seqs = cu_q.shape[0] - 1
    if cu_k.shape[0] - 1 != num_seqs or num_seqs < 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"cu_q {tuple(cu_q.shape)}, cu_k {tuple(cu_k.shape)} and "
                         f"block_tables {tuple(block_tables.shape)} must describe the same "
                         "num_seqs >= 1 sequences")
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if total_q == 0 or max_q < 1:
        return out
    with torch.cuda.device(query.device):
        extension().flash_prefill(
            out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            cu_q.data_ptr(), cu_k.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim,
            total_q, 1, query.stride(0), 0, 0, max_q, float(scale), dtype_code(query.dtype),
            torch.cuda.current_stream(query.device).cuda_stream, block_tables.data_ptr(),
            block_tables.shape[1], block_size, num_blocks)
    return out


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
        backend: "flash_wgmma", "flash_varlen" or "sdpa"; None picks the fastest
            available for these heads.

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
    backend = backend or prefill_backend(query.device, query.dtype, head_dim,
                                         query.shape[1] // num_kv_heads)
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
    elif max_k > block_tables.shape[1] * k_cache.shape[1]:  # the paths below read the tables
        raise ValueError(f"block_tables: {block_tables.shape[1]} blocks of {k_cache.shape[1]} "
                         f"tokens a sequence cannot hold a context of {max_k}")
    else:
        cu_k = F.pad(torch.cumsum(context_lens, 0, dtype=torch.int32), (1, 0))
        if backend == "flash_wgmma" and 16 <= k_cache.shape[1] <= 256:
            # Our kernel reads the contexts out of the cache through the block tables.
            return flash_prefill_paged(query, k_cache, v_cache, block_tables,
                                       query_start_loc, cu_k, max_q, scale)
        k, v = _gather_paged(k_cache, v_cache, block_tables, context_lens, cu_k,
                             sum(context_lens_cpu), max_k)
    if backend == "flash_wgmma":
        return flash_prefill(query, k, v, query_start_loc, cu_k, max_q, scale)
    # FlashAttention-2 aligns the causal mask at the bottom right when a
    # sequence has more keys than queries: exactly "new tokens at the end".
    out = torch.ops.aten._flash_attention_forward(
        query if query.stride(-1) == 1 else query.contiguous(), k, v, query_start_loc, cu_k,
        max_q, max_k, 0.0, True, False, scale=scale)[0]
    return out
# --8<-- [end:prefill]
