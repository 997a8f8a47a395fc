"""Argument checks shared by the kernel wrappers: clear ValueErrors, never asserts."""

from __future__ import annotations

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 128)


def check_tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...],
                 contiguous: bool = True) -> torch.Tensor:
    """Check that `t` is a tensor of `ndim` dims with one of `dtypes`.

    Raises:
        TypeError: when `t` is not a tensor.
        ValueError: naming the argument and what is wrong with it.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not "
                         f"supported ({names})")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous())")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device; return it.

    Raises:
        ValueError: when a tensor is on the CPU or on another device.
    """
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, d in devices.items():
        if d.type != "cuda":
            raise ValueError(f"{name}: must be on a CUDA device, got {d} "
                             "(the torch reference in mini_vllm.ops.reference runs anywhere)")
        if d != device:
            raise ValueError(f"{name} is on {d} but {first_name} is on {device}")
    return device


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor,
                   dtypes: tuple[torch.dtype, ...], *,
                   any_layout: bool = False) -> tuple[int, int, int, int]:
    """Check a layer's caches; return (num_blocks, block_size, num_kv_heads, head_dim).

    The caches are [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
    with `any_layout`, any strides that keep head_dim dense and every row on 16
    bytes (e.g. a head-major cache seen through `.transpose(1, 2)`), the same
    for K and V.

    Raises:
        ValueError: on a wrong rank, dtype, layout or block size.
    """
    check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes, contiguous=not any_layout)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=dtypes, contiguous=not any_layout)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} must match")
    if any_layout:
        if k_cache.stride() != v_cache.stride():
            raise ValueError(f"k_cache strides {k_cache.stride()} and v_cache strides "
                             f"{v_cache.stride()} must match")
        if k_cache.stride(3) != 1:
            raise ValueError("k_cache: head_dim must be the dense (last) dimension")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:3]):
                raise ValueError(f"{name}: every row must start on 16 bytes")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"k_cache: block_size {block_size} must be a power of two")
    return num_blocks, block_size, num_kv_heads, head_dim


def rows_on_16_bytes(t: torch.Tensor) -> bool:
    """Whether `t` and each of its rows (along dim 0) start on 16 bytes."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def check_16_byte_aligned(name: str, t: torch.Tensor, *, rows: bool = False) -> None:
    """Raise a ValueError naming `t` unless it starts on 16 bytes (with `rows`, each row
    too): what a kernel that moves 16 bytes at a time needs."""
    if rows and not rows_on_16_bytes(t):
        raise ValueError(f"{name}: rows must start on 16 bytes (data pointer and row stride)")
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: must start on 16 bytes")


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` [N, H, D] with rows the kernels can load 16 bytes at a time.

    The last two dimensions must be dense; the first may have any stride that
    keeps 16-byte alignment (e.g. a slice of a fused QKV projection). Anything
    else is copied into a contiguous tensor.
    """
    d = t.shape[2]
    ok = t.stride(2) == 1 and t.stride(1) == d and rows_on_16_bytes(t)
    return t if ok else t.contiguous()
