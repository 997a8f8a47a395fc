"""Skinny GEMM for decode steps: `y = x @ W.T` for 1 to 16 rows of x, and its torch reference.

At batch 1 to 16 a linear layer reads its whole weight matrix to use each
element at most 16 times: the product is bound by memory bandwidth, and
cuBLAS's GEMM tiles reach a third of it or less there. The kernel (`csrc/gemv.cu`)
streams the weight once with 16-byte loads. The model calls it through
`gemv_usable`, which is cheap enough to ask on every forward, and falls back
to `F.linear` (the reference) for everything else: more rows, float32, the CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mini_vllm.ops._checks import check_same_device, check_tensor
from mini_vllm.ops._extension import (
    BUILD_COMMAND,
    _import_extension,
    dtype_code,
    extension,
    num_sms,
)
from mini_vllm.ops.layer_ops import scale_rows_ref, silu_and_mul_ref

GEMV_DTYPES = (torch.float16, torch.bfloat16)
GEMV_MAX_ROWS = 16  # kGemvMaxRows in csrc/gemv_params.h
GEMV_SPLITS = (0, 1, 2, 4, 8, 16)  # 0: the kernel picks
GEMM_MAX_ROWS = 256  # kGemmMaxRows in csrc/gemv_params.h
GEMM_MAX_SPLITS = 16  # the largest thread-block cluster of sm_90
GEMM_ROWS_PER_CTA = (0, 128, 256)  # 0: the kernel picks
GEMM_TILE_N = (0, 64, 128)  # outputs per CTA; 0: the kernel picks


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`: what `gemv` computes, on any device and dtype."""
    return F.linear(x, weight)


# --8<-- [start:silu_mul_product_ref]
def silu_mul_product_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What `gemv` and `gemm_wgmma` compute with `silu_eps`, on any device and dtype.

    `weight` is gate_up_proj's `[gate; up]` with the post-attention norm's
    weight folded in and `x` the residual stream: the product's rows, scaled
    by `1 / rms(x)`, go through `silu(gate) * up`. The model's path without the
    fused epilogue, op for op (`gpu.fused_layers.FusedDecoderForward._mlp`).
    """
    return silu_and_mul_ref(scale_rows_ref(gemv_ref(x, weight), x, eps))
# --8<-- [end:silu_mul_product_ref]


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
         splits: int = 0, accumulate: bool = False,
         silu_eps: float | None = None) -> torch.Tensor:
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
        out: [rows, N] ([rows, N / 2] with `silu_eps`) contiguous tensor to write
            into (a new one when None).
        splits: warps that share a tile of 16 output rows, each summing part
            of K (1, 2, 4, 8 or 16); 0 lets the kernel choose (for tests and tuning).
        accumulate: `out += x @ weight.T` (the sum rounded once, as
            `out.addmm_` rounds it); `out` is then required. The model adds
            `o_proj` and `down_proj` into its residual stream this way.
        silu_eps: multiply and activate in one launch (`silu_mul_product_ref`):
            `weight` is gate_up_proj's `[gate; up]` (N a multiple of 16) with the
            norm's weight folded in, `x` the residual stream, and the result
            `[rows, N / 2]`; the norm's eps. Not with `accumulate`.

    Returns:
        `out`, or a new [rows, N] tensor ([rows, N / 2] with `silu_eps`).

    Raises:
        ValueError: on a wrong dtype, shape, layout or device, naming the argument.
    """
    if splits not in GEMV_SPLITS:
        raise ValueError(f"splits must be one of {GEMV_SPLITS}, got {splits}")
    out, device = _check_product(x, weight, out, accumulate, max_rows=GEMV_MAX_ROWS,
                                 k_multiple=8, n_multiple=16 if silu_eps is not None else 1,
                                 kernel="gemv", silu_eps=silu_eps)
    rows, k = x.shape
    n = weight.shape[0]
    extension().gemv(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, n, k, x.stride(0),
                     dtype_code(x.dtype), torch.cuda.current_stream(device).cuda_stream, splits,
                     accumulate, silu_eps is not None, silu_eps or 0.0)
    return out


# --8<-- [start:gemm_wgmma_usable]
@functools.lru_cache(maxsize=8)
def _wgmma_tiles_limit(device: torch.device) -> int:
    """Tiles of 128 outputs `gemm_wgmma` takes on `device`: one per SM (0 when it
    cannot run there: no sm_90 GPU, or a module built without sm_90a)."""
    module = _import_extension()[0]
    if module is None:
        return 0
    with torch.cuda.device(device):
        return num_sms(device) if module.wgmma_gemm_supported() else 0


def gemm_wgmma_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemm_wgmma(x, weight)` can run, on at most one tile of outputs per SM.

    True on an H100/H200 (with the module built for sm_90a) for `x [rows, K]`
    with 1 <= rows <= GEMM_MAX_ROWS and `weight [N, K]` with N a multiple of
    128, at most 128 x the SM count (one tile of 128 outputs per SM, times the
    blocks of 128 rows: the lm_head's 151,936 rows are a GEMM of many waves,
    cuBLAS's ground), and
    K a multiple of 64; the layout rules are `gemv_usable`'s. Attribute reads
    and one cached lookup: cheap enough to ask on every forward.
    """
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMM_MAX_ROWS
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and x.shape[1] % 64 == 0
            and weight.shape[0] % 128 == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and weight.device == x.device
            and weight.shape[0] <= 128 * _wgmma_tiles_limit(x.device))
# --8<-- [end:gemm_wgmma_usable]


# --8<-- [start:gemm_wgmma_pays]
# Where gemm_wgmma makes a decode step faster than cuBLAS on an H200
# (benchmarks/step_profile.py, chapter 9): every product of Qwen3-0.6B's
# layers (K of at most 3,072) at up to one tile of 128 rows. Within the
# step's CUDA graph it starts under the kernel before it (programmatic
# launch), which cuBLAS's kernels do not; the larger products of Qwen3-8B
# stay with cuBLAS, which is faster per call at most of them.
GEMM_WGMMA_PAYS_MAX_ROWS = 128
GEMM_WGMMA_PAYS_MAX_K = 3072


def gemm_wgmma_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the model should multiply with `gemm_wgmma` rather than cuBLAS:
    it can run (`gemm_wgmma_usable`), x has at most 128 rows and K is at most
    3,072 (every layer of Qwen3-0.6B but the lm_head)."""
    return (x.dim() == 2 and x.shape[0] <= GEMM_WGMMA_PAYS_MAX_ROWS
            and x.shape[1] <= GEMM_WGMMA_PAYS_MAX_K
            and gemm_wgmma_usable(x, weight))
# --8<-- [end:gemm_wgmma_pays]


def gemm_wgmma(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
               splits: int = 0, accumulate: bool = False, rows_per_cta: int = 0,
               tile_n: int = 0, silu_eps: float | None = None) -> torch.Tensor:
    """`x @ weight.T` for 1 to 256 rows on Hopper (TMA + wgmma): decode steps of 17 to 256.

    A CTA computes 128 or 64 outputs for 128 rows (or for all 256 in one CTA);
    the CTAs of a cluster split K and add their partial sums in a fixed
    order, and each output is rounded once (`csrc/gemm_wgmma.cu`). Needs an
    sm_90 GPU and a module built for sm_90a (`gemm_wgmma_usable`). Like
    `gemv`, the kernel may read `weight` before the kernel launched just
    before it has finished, so that kernel must not write `weight`.

    Args:
        x: [rows, K], 1 <= rows <= GEMM_MAX_ROWS (256), float16 or bfloat16,
            rows dense and 16-byte aligned; K a multiple of 64.
        weight: [N, K] contiguous, same dtype; N a multiple of 128.
        out: [rows, N] ([rows, N / 2] with `silu_eps`) contiguous tensor to write
            into (a new one when None).
        splits: CTAs of a cluster that share a tile of outputs, each
            summing a slice of K (1 to 16); 0 lets the kernel choose (at most 8).
        accumulate: `out += x @ weight.T`, the sum rounded once; `out` is then required.
        rows_per_cta: rows of x a CTA takes, 128 or 256; 0 lets the kernel
            choose (with `splits`, for tests and tuning).
        tile_n: outputs a CTA takes, 64 or 128; 0 lets the kernel choose.
        silu_eps: multiply and activate in one launch, as `gemv`'s
            `silu_eps` does (the result is `[rows, N / 2]`). Not with
            `accumulate`, nor with `rows_per_cta=256`.

    Returns:
        `out`, or a new [rows, N] tensor ([rows, N / 2] with `silu_eps`).

    Raises:
        ValueError: on a wrong dtype, shape, layout or device, naming the argument.
        RuntimeError: where the kernel cannot run (no sm_90 GPU, or no sm_90a build).
    """
    if not 0 <= splits <= GEMM_MAX_SPLITS:
        raise ValueError(f"splits must be 0 to {GEMM_MAX_SPLITS}, got {splits}")
    if rows_per_cta not in GEMM_ROWS_PER_CTA:
        raise ValueError(f"rows_per_cta must be one of {GEMM_ROWS_PER_CTA}, got {rows_per_cta}")
    if tile_n not in GEMM_TILE_N:
        raise ValueError(f"tile_n must be one of {GEMM_TILE_N}, got {tile_n}")
    if silu_eps is not None and rows_per_cta == 256:
        raise ValueError("rows_per_cta: with silu_eps a CTA takes 128 rows (its registers "
                         "hold x x^T beside the product)")
    out, device = _check_product(x, weight, out, accumulate, max_rows=GEMM_MAX_ROWS,
                                 k_multiple=64, n_multiple=128, kernel="gemm_wgmma",
                                 silu_eps=silu_eps)
    if _wgmma_tiles_limit(device) == 0:
        raise RuntimeError("gemm_wgmma needs an sm_90 GPU (H100/H200) and the kernels "
                           f"built for sm_90a (`{BUILD_COMMAND}` does so for CUDA_ARCHS 90)")
    rows, k = x.shape
    extension().gemm_wgmma(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows,
                           weight.shape[0], k, x.stride(0), dtype_code(x.dtype),
                           torch.cuda.current_stream(device).cuda_stream, splits, accumulate,
                           rows_per_cta, tile_n, silu_eps is not None, silu_eps or 0.0)
    return out


def _check_product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None,
                   accumulate: bool, *, max_rows: int, k_multiple: int, n_multiple: int,
                   kernel: str, silu_eps: float | None = None
                   ) -> tuple[torch.Tensor, torch.device]:
    """The checks `gemv` and `gemm_wgmma` share; return (out or a new tensor, device)."""
    check_tensor("x", x, ndim=2, dtypes=GEMV_DTYPES, contiguous=False)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,))
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= max_rows:
        raise ValueError(f"x: {rows} rows; {kernel} takes 1 to {max_rows} "
                         "(use F.linear for more)")
    if k == 0 or k % k_multiple:
        raise ValueError(f"x: K = {k} must be a positive multiple of {k_multiple}")
    if n == 0 or n % n_multiple:
        what = " (with silu_eps, [gate; up] of equal halves)" if silu_eps is not None else ""
        raise ValueError(f"weight: N = {n} must be a positive multiple of {n_multiple}{what}")
    if weight.shape[1] != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not take x's K = {k}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(f"x: rows must be dense and 16-byte aligned (strides {x.stride()})")
    if weight.data_ptr() % 16:
        raise ValueError("weight: must be 16-byte aligned")
    tensors = {"x": x, "weight": weight}
    if silu_eps is not None:
        if accumulate:
            raise ValueError("accumulate: silu_eps writes SiLU · mul into a new output, "
                             "it cannot add into out")
        if not silu_eps > 0:
            raise ValueError(f"silu_eps: must be positive, got {silu_eps}")
        n //= 2  # [gate; up] -> one output per pair
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
    return out, device


__all__ = ["GEMM_MAX_ROWS", "GEMV_DTYPES", "GEMV_MAX_ROWS", "gemm_wgmma", "gemm_wgmma_pays",
           "gemm_wgmma_usable", "gemv", "gemv_ref", "gemv_usable", "silu_mul_product_ref"]
