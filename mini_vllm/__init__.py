"""mini-vllm: a vLLM-style inference engine for Qwen3, built phase by phase."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mini_vllm.llm import LLM
    from mini_vllm.outputs import CompletionOutput, RequestOutput
    from mini_vllm.sampling_params import SamplingParams
    from mini_vllm.structured_output.params import StructuredOutputsParams

_LAZY = {
    "LLM": "mini_vllm.llm",
    "SamplingParams": "mini_vllm.sampling_params",
    "StructuredOutputsParams": "mini_vllm.structured_output.params",
    "RequestOutput": "mini_vllm.outputs",
    "CompletionOutput": "mini_vllm.outputs",
}


def __getattr__(name: str) -> Any:
    # Lazy imports keep `import mini_vllm` (and the CLI's start) light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mini_vllm' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "__version__"]
