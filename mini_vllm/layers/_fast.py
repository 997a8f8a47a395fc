"""What the fast implementations of the blocks need to run (shared by the blocks)."""

from __future__ import annotations

import torch

from mini_vllm import ops
from mini_vllm.ops.layer_ops import LAYER_DTYPES


def kernels_run_on(device: torch.device, dtype: torch.dtype) -> bool:
    """True on a CUDA device, in float16 / bfloat16, with `mini_vllm._C` built."""
    return device.type == "cuda" and dtype in LAYER_DTYPES and ops.is_available()
