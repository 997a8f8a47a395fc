"""Finding the compiled module `mini_vllm._C` and saying why it is missing."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

BUILD_COMMAND = "bash scripts/build_kernels.sh"


@functools.lru_cache(maxsize=1)
def _import_extension() -> tuple[ModuleType | None, str | None]:
    """Import `mini_vllm._C` once; return (module, None) or (None, why not)."""
    try:
        from mini_vllm import _C  # type: ignore[attr-defined]
    except ImportError as e:
        return None, (
            f"the CUDA kernels are not built (import of mini_vllm._C failed: {e}); "
            f"build them from the repository root with `{BUILD_COMMAND}` "
            "(needs nvcc, CMake >= 3.24 and pybind11)"
        )
    return _C, None


def unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run here, or None when they can."""
    module, why = _import_extension()
    if module is None:
        return why
    if not torch.cuda.is_available():
        return "the CUDA kernels are built but PyTorch sees no CUDA GPU"
    return None


def is_available() -> bool:
    """True when `mini_vllm._C` is built and a CUDA GPU is visible."""
    return unavailable_reason() is None


def extension() -> ModuleType:
    """The compiled module.

    Raises:
        RuntimeError: naming the build command when the module is missing.
    """
    module, why = _import_extension()
    if module is None:
        raise RuntimeError(f"mini_vllm.ops: {why}")
    return module


def dtype_code(dtype: torch.dtype) -> int:
    """The module's element-type code (`DType` in csrc/params.h)."""
    return {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[dtype]


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def set_programmatic_launch(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for the kernels that use it.

    On sm_90 and newer those kernels may start while the kernel before them
    is finishing, and wait on the device for its results (csrc/pdl.cuh); it
    is on by default. A CUDA graph keeps the setting it was captured with.
    """
    extension().set_programmatic_launch(bool(enabled))


def programmatic_launch() -> bool:
    """Whether programmatic dependent launch is on (it applies on sm_90+ only)."""
    return bool(extension().programmatic_launch())
