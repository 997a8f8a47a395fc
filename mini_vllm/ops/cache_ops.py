"""KV-cache kernels: write new K/V into their slots; gather paged K/V back out."""

from __future__ import annotations

import torch

from mini_vllm.ops._checks import aligned_rows, check_kv_cache, check_same_device, check_tensor
from mini_vllm.ops._extension import dtype_code, extension

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K and V into cache slot `slot_mapping[token]`.

    Args:
        key: [num_tokens, num_kv_heads, head_dim]; the last two dims dense,
            the first may be strided (a slice of a fused QKV output).
        value: like `key`.
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            same dtype (float16, bfloat16 or float32).
        v_cache: like `k_cache`.
        slot_mapping: [num_tokens] int64, `block * block_size + offset`;
            -1 marks a padding token, which is skipped.

    Raises:
        ValueError: on a wrong dtype, shape, layout or device.
        RuntimeError: when the CUDA kernels are not built.
    """
    check_tensor("key", key, ndim=3, dtypes=CACHE_DTYPES, contiguous=False)
    check_tensor("value", value, ndim=3, dtypes=CACHE_DTYPES, contiguous=False)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, CACHE_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    num_tokens = key.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.shape != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != (num_tokens, num_kv_heads, "
                             f"head_dim) = {(num_tokens, num_kv_heads, head_dim)}")
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} is {t.dtype} but the KV cache is {k_cache.dtype}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{num_tokens} tokens")
    device = check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                               slot_mapping=slot_mapping)
    ext = extension()
    if num_tokens == 0:
        return
    key, value = aligned_rows(key), aligned_rows(value)
    with torch.cuda.device(device):
        ext.reshape_and_cache(
            key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim, key.stride(0),
            value.stride(0), dtype_code(key.dtype), torch.cuda.current_stream(device).cuda_stream)


def gather_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens: torch.Tensor, total_tokens: int,
                    max_context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each sequence's context out of the paged cache into contiguous rows.

    Sequence i's tokens 0 .. n_i - 1 (n_i = cu_seqlens[i+1] - cu_seqlens[i])
    land in rows cu_seqlens[i] .. cu_seqlens[i+1] - 1 of the outputs.

    Args:
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        v_cache: like `k_cache`.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        cu_seqlens: [num_seqs + 1] int32 prefix sums of the context lengths.
        total_tokens: cu_seqlens[-1] (a host int: it sizes the outputs).
        max_context_len: the longest context (a host int: it sizes the grid).

    Returns:
        (k, v), each [total_tokens, num_kv_heads, head_dim].
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, CACHE_DTYPES)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,))
    num_seqs = block_tables.shape[0]
    if cu_seqlens.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} entries for {num_seqs} sequences"
                         " (expected num_seqs + 1)")
    device = check_same_device(k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                               cu_seqlens=cu_seqlens)
    ext = extension()
    k = torch.empty((total_tokens, num_kv_heads, head_dim), dtype=k_cache.dtype, device=device)
    v = torch.empty_like(k)
    with torch.cuda.device(device):
        ext.gather_kv_cache(
            k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), cu_seqlens.data_ptr(), num_seqs, num_kv_heads, head_dim,
            block_size, block_tables.shape[1], max_context_len, dtype_code(k_cache.dtype),
            torch.cuda.current_stream(device).cuda_stream)
    return k, v
