"""Blocks with two implementations: a reference in plain PyTorch and a fast one.

Every block a model is built from (`Linear`, `RMSNorm`, `SiluAndMul`, …) is a
`CustomOp`. Its `forward_native` is the reference: plain PyTorch, what
chapter 2 teaches, correct on any device. Where a CUDA kernel of phases 8–9
computes the same function faster, the block also has a `forward_fast`, and
`fast_supported` says whether that kernel can run for this device and dtype.

Which of the two `forward` runs is chosen once, when the model is built
(`select_implementations`, called by the loader), never per call and never by
the model: a model file composes blocks and knows nothing of devices. This is
the shape of vLLM's `CustomOp` (`forward_native` / `forward_cuda`), made
smaller.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn


# --8<-- [start:custom_op]
class CustomOp(nn.Module):
    """A block whose `forward` is its reference or its fast implementation."""

    def __init__(self) -> None:
        super().__init__()
        self.use_fast = False  # set once by `select_implementations`

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.use_fast:
            return self.forward_fast(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The reference: plain PyTorch, on any device."""
        raise NotImplementedError

    def forward_fast(self, *args: Any, **kwargs: Any) -> Any:
        """The same function through a kernel of `mini_vllm.ops` (see `fast_supported`)."""
        return self.forward_native(*args, **kwargs)

    def fast_supported(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether `forward_fast` can run for weights on `device` in `dtype`."""
        return False


def select_implementations(model: nn.Module, device: torch.device | str,
                           dtype: torch.dtype) -> Counter[str]:
    """Choose each block's implementation, once: the fast one wherever it can run.

    Returns:
        How many blocks of each kind run fast (`"Linear"`, `"RMSNorm"`, …).
    """
    device = torch.device(device)
    fast: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.use_fast = module.fast_supported(device, dtype)
            if module.use_fast:
                fast[type(module).__name__] += 1
    return fast
# --8<-- [end:custom_op]


__all__ = ["CustomOp", "select_implementations"]
