"""The gated activation of a SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_vllm.layers._fast import kernels_run_on
from mini_vllm.layers.custom_op import CustomOp
from mini_vllm.ops import layer_ops


# --8<-- [start:silu_and_mul]
class SiluAndMul(CustomOp):
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension: [T, 2d] -> [T, d]."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
# --8<-- [end:silu_and_mul]

    def fast_supported(self, device: torch.device, dtype: torch.dtype) -> bool:
        return kernels_run_on(device, dtype)

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] % 16:
            return self.forward_native(x)  # the kernel takes rows of a multiple of 16
        return layer_ops.silu_and_mul(x)


__all__ = ["SiluAndMul"]
