"""RMSNorm, and the "add the residual, then normalise" step between sub-layers;
LayerNorm (with a bias) for GPT-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.layers._fast import kernels_run_on
from mini_vllm.layers.custom_op import CustomOp
from mini_vllm.ops import layer_ops


# --8<-- [start:rmsnorm]
class RMSNorm(CustomOp):
    """Root-mean-square norm: `x / sqrt(mean(x^2) + eps) * weight`, over the last dim.

    Called with a `residual`, it first adds `x` into it and normalises the sum:
    the step between two sub-layers, which returns both (normalised, new
    residual). Normalised in float32 and cast back before the weight is
    applied, as Hugging Face does, so bfloat16 runs match it.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(dim, device=device, dtype=dtype), requires_grad=False
        )

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        x = residual = x + residual
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps), residual
# --8<-- [end:rmsnorm]

    def fast_supported(self, device: torch.device, dtype: torch.dtype) -> bool:
        return kernels_run_on(device, dtype) and self.weight.shape[0] % 8 == 0

    def forward_fast(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One launch; with `residual`, the residual is updated in place."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])  # [T, D], or per head [T * H, D]
        if residual is None:
            return layer_ops.rms_norm(rows, self.weight, self.eps)[0].view(shape)
        normed, residual = layer_ops.rms_norm(rows, self.weight, self.eps,
                                              residual.view(-1, shape[-1]))
        return normed.view(shape), residual.view(shape)


# --8<-- [start:layernorm]
class LayerNorm(CustomOp):
    """`(x - mean(x)) / sqrt(var(x) + eps) * weight + bias`, over the last dim (GPT-2).

    Unlike RMSNorm it centres the row and adds a bias. (PyTorch's kernel
    accumulates in float32 whatever the dtype, as Hugging Face's `nn.LayerNorm`.)
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype),
                                 requires_grad=False)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
# --8<-- [end:layernorm]


__all__ = ["LayerNorm", "RMSNorm"]
