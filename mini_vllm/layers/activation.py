"""Activations: the gated SiLU of a SwiGLU MLP, and GELU for GPT-2's MLP."""

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


# --8<-- [start:gelu]
class GELU(CustomOp):
    """`x * Phi(x)`, `Phi` the normal CDF; GPT-2 uses the tanh approximation:

        gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))

    Args:
        approximate: `"tanh"` (GPT-2's `gelu_new`) or `"none"` (the exact erf form).
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)
# --8<-- [end:gelu]


# A checkpoint's `hidden_act` / `activation_function` -> the activation block.
_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
                "gelu": "none"}


def get_act_fn(name: str) -> GELU:
    """The (ungated) activation a config names (`"gelu_new"`, `"gelu"`, ...).

    Raises:
        ValueError: naming an activation no model here implements.
    """
    if name not in _ACTIVATIONS:
        raise ValueError(f"config.json: activation {name!r} is not supported "
                         f"({', '.join(sorted(_ACTIVATIONS))})")
    return GELU(_ACTIVATIONS[name])


__all__ = ["GELU", "SiluAndMul", "get_act_fn"]
