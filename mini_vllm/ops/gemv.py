"""Skinny GEMM for decode steps: `y = x @ W.T` for 1 to 16 rows of x, and its torch reference.

At batch 1 to 16 a linear layer reads its whole weight matrix to use each
element at most 16 times: the product is bound by memory bandwidth, and
cuBLAS's GEMM tiles reach a third of it or less there. The kernel (`csrc/gemv.cu`)
streams the weight once with 16-byte loads. The model calls it through
`gemv_usable`, which is cheap enough to ask on every forward, and falls back
to `F.linear` (the reference) for everything else: more rows, float32, the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_vllm.ops._checks import check_same_device, check_tensor
from mini_vllm.ops._extension import _import_extension, dtype_code, extension

GEMV_DTYPES = (torch.float16, torch.bfloat16)
GEMV_MAX_ROWS = 16  # kGemvMaxRows in csrc/gemv_params.h
GEMV_SPLITS = (0, 1, 2, 4, 8, 16)  # 0: the kernel picks


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`: what `gemv` computes, on any device and dtype."""
    return F.linear(x, weight)


# --8<-- [start:gemv_usable]
def gemv_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv(x, weight)` can run: a handful of attribute reads, no tensor ops.

    True for a CUDA `x [rows, K]` with 1 <= rows <= GEMV_MAX_ROWS, float16 or bfloat16,
    K a multiple of 8, rows dense and 16-byte aligned (any row stride that
    keeps them so), and a contiguous, aligned `weight [N, K]` of the same
    dtype and device, with the kernels built.
    """
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and x.shape[1] % 8 == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and weight.device == x.device and _import_extension()[0] is not None)
# --8<-- [end:gemv_usable]


def gemv(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
         splits: int = 0, accumulate: bool = False) -> torch.Tensor:
    """The CUDA kernel of `gemv_ref` for 1 to 16 rows: `[rows, K] @ [N, K].T -> [rows, N]`.

    Products are summed in float32 and each output is rounded once to the
    dtype, as cuBLAS does; only the order of the additions differs.

    Under programmatic launch (sm_90+) the kernel may read `weight` before the
    kernel launched just before it has finished (`csrc/gemv.cu`), so that
    kernel must not be the one that writes `weight`: model weights, written
    once at load, never are.

    Args:
        x: [rows, K], 1 <= rows <= GEMV_MAX_ROWS (16), float16 or bfloat16, rows dense (any row
            stride that is a multiple of 8 elements), 16-byte aligned.
        weight: [N, K] contiguous (nn.Linear's layout), same dtype; K a multiple of 8.
        out: [rows, N] contiguous tensor to write into (a new one when None).
        splits: warps that share a tile of 16 output rows, each summing part
            of K (1, 2, 4, 8 or 16); 0 lets the kernel choose (for tests and tuning).
        accumulate: `out += x @ weight.T` (the sum rounded once, as
            `out.addmm_` rounds it); `out` is then required. The model adds
            `o_proj` and `down_proj` into its residual stream this way.

    Returns:
        `out`, or a new [rows, N] tensor.

    Raises:
        ValueError: on a wrong dtype, shape, layout or device, naming the argument.
    """
    check_tensor("x", x, ndim=2, dtypes=GEMV_DTYPES, contiguous=False)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,))
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"x: {rows} rows; the kernel takes 1 to {GEMV_MAX_ROWS} "
                         "(use gemv_ref / F.linear for more)")
    if k == 0 or k % 8:
        raise ValueError(f"x: K = {k} must be a positive multiple of 8 (16-byte loads)")
    if weight.shape[1] != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not take x's K = {k}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(f"x: rows must be dense and 16-byte aligned (strides {x.stride()})")
    if weight.data_ptr() % 16:
        raise ValueError("weight: must be 16-byte aligned")
    if splits not in GEMV_SPLITS:
        raise ValueError(f"splits must be one of {GEMV_SPLITS}, got {splits}")
    tensors = {"x": x, "weight": weight}
    if accumulate and out is None:
        raise ValueError("out: accumulate=True adds into out, which must be given")
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,))
        if tuple(out.shape) != (rows, n):
            raise ValueError(f"out: shape {tuple(out.shape)} != {(rows, n)}")
        tensors["out"] = out
    device = check_same_device(**tensors)
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=device)
    extension().gemv(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, n, k, x.stride(0),
                     dtype_code(x.dtype), torch.cuda.current_stream(device).cuda_stream, splits,
                     accumulate)
    return out


__all__ = ["GEMV_DTYPES", "GEMV_MAX_ROWS", "gemv", "gemv_ref", "gemv_usable"]
