"""Linear layers whose output may be several projections stacked.

A transformer layer multiplies the same input by several weights: q, k and v,
or gate and up. Stacking their rows into one weight turns three (or two)
matrix products into one. `output_sizes` remembers where each projection's
rows start, so the loader can copy each checkpoint tensor into its slice
(`packed_modules_mapping` in the model) and the model can split the output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.layers._fast import kernels_run_on
from mini_vllm.layers.custom_op import CustomOp
from mini_vllm.ops.gemv import gemm_wgmma, gemm_wgmma_pays, gemv, gemv_usable


# --8<-- [start:linear]
class Linear(CustomOp):
    """`y = x @ W.T (+ b)`, where `W` may be several projections stacked by rows.

    The weight is left uninitialised: every parameter is filled by the loader,
    which fails loudly if one is missing.

    Args:
        input_size: features in.
        output_sizes: rows of each stacked projection (`[q, kv, kv]` for a
            fused q/k/v projection, `[n]` for a plain one).
        bias: whether the layer adds a bias (Qwen2's q/k/v projections do).
        device: where to allocate the weight.
        dtype: the weight's dtype.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, device=device, dtype=dtype),
            requires_grad=False,
        )
        self.bias = (nn.Parameter(torch.empty(sum(output_sizes), device=device, dtype=dtype),
                                  requires_grad=False) if bias else None)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, sum(output_sizes)]
# --8<-- [end:linear]

    # --8<-- [start:linear_fast]
    def fast_supported(self, device: torch.device, dtype: torch.dtype) -> bool:
        return kernels_run_on(device, dtype)

    def _kernel(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """Our kernel for `x @ W.T`, or None for cuBLAS.

        Asked on every call (the weight of a tied lm_head is swapped in after
        construction, and the row count changes from step to step), so the test
        is attribute reads only: the skinny-GEMM kernel for 1 to 16 rows (a
        decode step of up to 16 sequences), `gemm_wgmma` where it beats cuBLAS
        on Hopper (`gemm_wgmma_pays`: up to 128 rows, K up to 3,072).
        """
        if self.use_fast:
            if gemv_usable(x, self.weight):
                return gemv
            if gemm_wgmma_pays(x, self.weight):
                return gemm_wgmma
        return None

    def forward_fast(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T (+ b)`, into `out` (`[rows, sum(output_sizes)]`, contiguous) when given."""
        if out is None and self._kernel(x) is None:
            return F.linear(x, self.weight, self.bias)
        y = self._product(x, out)
        return y if self.bias is None else y.add_(self.bias)

    def _product(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T` (no bias) on the fastest product, into `out` when given."""
        kernel = self._kernel(x)
        if out is None:
            return kernel(x, self.weight) if kernel else torch.matmul(x, self.weight.t())
        want = (x.shape[0], self.weight.shape[0])
        if out.shape != want:
            raise ValueError(f"out: shape {tuple(out.shape)}, the product is {want}")
        if not out.is_contiguous():
            raise ValueError("out: must be contiguous (the product writes it row by row)")
        return kernel(x, self.weight, out=out) if kernel else torch.matmul(
            x, self.weight.t(), out=out)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out += x @ W.T` in place, the sum rounded once: a sub-layer's output
        added into the residual stream by the matrix product itself."""
        if self.bias is not None:
            raise ValueError("add_to: a layer with a bias is not supported")
        kernel = self._kernel(x)
        if kernel:
            kernel(x, self.weight, out=out, accumulate=True)
        else:
            out.addmm_(x, self.weight.t())

    def silu_and_mul(self, x: torch.Tensor, eps: float) -> torch.Tensor | None:
        """`silu(s * gate) * (s * up)` for a `[gate; up]` weight, `s = 1 / rms(x)`
        per row: the product and the activation in one launch, where one of our
        kernels takes `x` (`silu_mul_product_ref` says what it computes); None
        where cuBLAS would multiply, and the caller runs the two apart."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"silu_and_mul: needs [gate; up] of equal halves, this layer "
                             f"stacks {self.output_sizes}")
        kernel = self._kernel(x) if self.bias is None else None
        return kernel(x, self.weight, silu_eps=eps) if kernel else None
    # --8<-- [end:linear_fast]

    # --8<-- [start:weight_loader]
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor into `param` (this layer's weight or bias).

        Args:
            param: `self.weight` or `self.bias`.
            loaded: the checkpoint's tensor.
            shard_id: which stacked projection it is (its index in
                `output_sizes`), or None for the whole parameter.

        Raises:
            ValueError: `loaded` has the wrong shape (the message gives both).
        """
        if shard_id is None:
            copy_checked(param.data, loaded)
            return
        start = sum(self.output_sizes[:shard_id])
        copy_checked(param.data.narrow(0, start, self.output_sizes[shard_id]), loaded)
    # --8<-- [end:weight_loader]


def copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target.copy_(source)` (converting dtype and device) after checking the shapes."""
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"has shape {tuple(source.shape)}, the model expects "
                         f"{tuple(target.shape)}")
    target.copy_(source)


__all__ = ["Linear", "copy_checked"]
