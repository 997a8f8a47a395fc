"""Fused element-wise kernels of a Qwen3 layer, and their torch references.

Each function has a `*_ref` twin in plain torch that performs the eager
model's operations in the same order (so both round alike); the model calls
the kernel on CUDA when the module is built and the reference otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_vllm.ops._checks import (
    check_16_byte_aligned,
    check_kv_cache,
    check_same_device,
    check_tensor,
)
from mini_vllm.ops._extension import dtype_code, extension

LAYER_DTYPES = (torch.float16, torch.bfloat16)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# --8<-- [start:references]
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`w * rms_norm(x)`; with `residual`: `residual = x + residual` first, normed instead.

    Returns:
        (normed, new residual or None).
    """
    if residual is not None:
        x = residual = x + residual
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps), residual


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, cos_sin_cache: torch.Tensor,
                     positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then neox RoPE of `q [T, Hq, D]` and `k [T, Hkv, D]`."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads

    def norm_rope(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = w * F.rms_norm(x, (x.shape[-1],), eps=eps)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return norm_rope(q, q_weight), norm_rope(k, k_weight)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def scale_rows_ref(x: torch.Tensor, residual: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * inv_rms` per row, `inv_rms = 1 / sqrt(mean(residual^2) + eps)` in float32.

    What is left of an RMSNorm whose weight was folded into the next matrix
    product (`gpu.fused_layers`): that product took the raw `residual`, so its
    output rows still need the norm's scale. The kernels do this on their
    inputs (`residual=` of `qk_norm_rope` and `silu_and_mul`).
    """
    inv_rms = torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * inv_rms).to(x.dtype)
# --8<-- [end:references]


def _residual_args(residual: torch.Tensor | None, eps: float, num_tokens: int,
                   dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> tuple[int, int, float]:
    """The kernels' (residual pointer, hidden, eps) arguments, `residual` checked and
    added to `tensors` (for the device check); (0, 0, eps) without one."""
    if residual is None:
        return 0, 0, eps
    check_tensor("residual", residual, ndim=2, dtypes=(dtype,))
    if residual.shape[0] != num_tokens:
        raise ValueError(f"residual has {residual.shape[0]} rows for {num_tokens} tokens")
    if residual.shape[1] % 8 or residual.data_ptr() % 16:
        raise ValueError(f"residual: width {residual.shape[1]} must be a multiple of 8 and "
                         "the tensor 16-byte aligned")
    tensors["residual"] = residual
    return residual.data_ptr(), residual.shape[1], eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CUDA kernel of `rms_norm_ref` (with `residual`: updated in place).

    Args:
        x: [T, hidden], float16 or bfloat16, rows dense (any row stride).
        weight: [hidden], same dtype.
        eps: the norm's epsilon.
        residual: [T, hidden] contiguous, or None.

    Returns:
        (a new [T, hidden] tensor, `residual` after `residual += x`).

    Raises:
        ValueError: on a wrong dtype, shape, layout or device.
    """
    check_tensor("x", x, ndim=2, dtypes=LAYER_DTYPES, contiguous=False)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,))
    num_tokens, hidden = x.shape
    if x.stride(1) != 1:
        raise ValueError("x: the hidden dimension must be dense")
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements for hidden size {hidden}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        tensors["residual"] = residual
    device = check_same_device(**tensors)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=device)
    extension().rms_norm(
        out.data_ptr(), 0 if residual is None else residual.data_ptr(), x.data_ptr(),
        weight.data_ptr(), num_tokens, hidden, x.stride(0), out.stride(0), eps,
        dtype_code(x.dtype), _stream(device))
    return out, residual


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos_sin_cache: torch.Tensor, positions: torch.Tensor, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float, *,
                 kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                 slot_mapping: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, residual_eps: float = 1e-6,
                 heads_per_warp: int = 0) -> None:
    """The CUDA kernel of `qk_norm_rope_ref`, in place on the q and k parts of `qkv`.

    With `kv_cache` and `slot_mapping`, the same launch also stores each
    token's k heads (as written back into `qkv`) and v heads in cache slot
    `slot_mapping[t]`, skipping slots < 0: the caches end up bit for bit as
    `ops.reshape_and_cache` would leave them, one kernel launch fewer.

    With `residual` (the decoder's input norm folded into `qkv_proj`), every
    token's q, k and v are first scaled as `scale_rows_ref(qkv, residual,
    residual_eps)` scales them, v in place too: the input norm needs no launch.

    Args:
        qkv: [T, (Hq + 2 * Hkv) * D] output of the fused projection (q, k, v).
        q_weight, k_weight: [D].
        cos_sin_cache: [max_position, D] float32, cos then sin.
        positions: [T] int64.
        kv_cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D],
            contiguous, qkv's dtype; or None.
        slot_mapping: [T] int64, `block * block_size + offset` (-1: padding,
            not stored); given exactly when `kv_cache` is.
        residual: [T, hidden] contiguous, qkv's dtype, hidden a multiple of 8; or None.
        residual_eps: the folded norm's epsilon.
        heads_per_warp: heads each warp of the kernel takes, 1, 2 or 4; 0 lets
            the kernel choose (2 for a prefill chunk of 1,024 tokens or more, else
            1). For tests and tuning: the output is the same, up to the order of
            the float32 sum of `residual`'s row where it has more than 8
            elements per thread of the block.

    Raises:
        ValueError: on a wrong dtype, shape, layout or device, or a bad `heads_per_warp`.
    """
    if type(heads_per_warp) is not int or heads_per_warp not in (0, 1, 2, 4):
        raise ValueError(f"heads_per_warp must be 0, 1, 2 or 4, got {heads_per_warp!r}")
    check_tensor("qkv", qkv, ndim=2, dtypes=LAYER_DTYPES, contiguous=False)
    check_tensor("q_weight", q_weight, ndim=1, dtypes=(qkv.dtype,))
    check_tensor("k_weight", k_weight, ndim=1, dtypes=(qkv.dtype,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,))
    if head_dim not in (64, 128, 256):
        raise ValueError(f"head_dim {head_dim} is not supported (64, 128, 256)")
    if qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv: shape {tuple(qkv.shape)} does not hold {num_q_heads} + 2 x "
                         f"{num_kv_heads} dense heads of {head_dim}")
    if q_weight.shape[0] != head_dim or k_weight.shape[0] != head_dim:
        raise ValueError("q_weight and k_weight must have head_dim elements")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache: width {cos_sin_cache.shape[1]} != head_dim {head_dim}")
    # The kernel moves each lane's run of a head (up to 16 bytes) in one access.
    check_16_byte_aligned("qkv", qkv, rows=True)
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight),
                    ("cos_sin_cache", cos_sin_cache)):
        check_16_byte_aligned(name, t)
    num_tokens = qkv.shape[0]
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    tensors = {"qkv": qkv, "q_weight": q_weight, "k_weight": k_weight,
               "cos_sin_cache": cos_sin_cache, "positions": positions}
    cache_ptrs = (0, 0, 0)  # k_cache, v_cache, slot_mapping: none, q and k in place only
    if (kv_cache is None) != (slot_mapping is None):
        raise ValueError("kv_cache and slot_mapping go together: pass both or neither")
    if kv_cache is not None and slot_mapping is not None:
        k_cache, v_cache = kv_cache
        _, _, cache_heads, cache_dim = check_kv_cache(k_cache, v_cache, (qkv.dtype,))
        if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
            raise ValueError(f"k_cache: {cache_heads} heads of {cache_dim} for {num_kv_heads} "
                             f"KV heads of {head_dim}")
        check_16_byte_aligned("k_cache", k_cache)
        check_16_byte_aligned("v_cache", v_cache)
        check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                             f"{num_tokens} tokens")
        tensors.update(k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
        cache_ptrs = (k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr())
    scale = _residual_args(residual, residual_eps, num_tokens, qkv.dtype, tensors)
    device = check_same_device(**tensors)
    extension().qk_norm_rope(
        qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), cos_sin_cache.data_ptr(),
        positions.data_ptr(), num_tokens, num_q_heads, num_kv_heads, head_dim,
        qkv.stride(0), eps, dtype_code(qkv.dtype), _stream(device), *cache_ptrs, *scale,
        heads_per_warp)


def silu_and_mul(x: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_eps: float = 1e-6) -> torch.Tensor:
    """The CUDA kernel of `silu_and_mul_ref`: [T, 2d] -> [T, d].

    With `residual` ([T, hidden], the post-attention norm folded into
    `gate_up_proj`), `x` is first scaled as `scale_rows_ref(x, residual,
    residual_eps)` scales it, in the same launch.

    Raises:
        ValueError: on a wrong dtype, shape, layout or device.
    """
    check_tensor("x", x, ndim=2, dtypes=LAYER_DTYPES)
    if x.shape[1] % 16:
        raise ValueError(f"x: width {x.shape[1]} must be a multiple of 16")
    tensors = {"x": x}
    scale = _residual_args(residual, residual_eps, x.shape[0], x.dtype, tensors)
    device = check_same_device(**tensors)
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=device)
    extension().silu_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], d,
                             dtype_code(x.dtype), _stream(device), *scale)
    return out


__all__ = [
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "rms_norm",
    "rms_norm_ref",
    "scale_rows_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]
