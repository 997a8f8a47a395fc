"""Which model class runs a checkpoint: `config.json`'s `architectures`, looked up.

A Hugging Face checkpoint names its model class in `config.json`
(`"architectures": ["LlamaForCausalLM"]`). The registry maps each name we
support to the module and class that implement it, imported only when a
checkpoint asks for it (vLLM's `ModelRegistry` does the same):

    config.json                       registry                      model class
    "Qwen3ForCausalLM"     ───────►  models/qwen3.py      ───────►  Qwen3ForCausalLM
    "Qwen3MoeForCausalLM"  ───────►  models/qwen3_moe.py  ───────►  Qwen3MoeForCausalLM
    "LlamaForCausalLM"     ───────►  models/llama.py      ───────►  LlamaForCausalLM
    "MistralForCausalLM"   ───────►  models/llama.py      ───────►  MistralForCausalLM
    "Qwen2ForCausalLM"     ───────►  models/qwen2.py      ───────►  Qwen2ForCausalLM
    "GPT2LMHeadModel"      ───────►  models/gpt2.py       ───────►  GPT2LMHeadModel

This module imports no model, so `mini_vllm.config` can ask it which names
exist before any model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import MappingProxyType

from torch import nn

# --8<-- [start:registry]
# Architecture name (config.json) -> (module under mini_vllm.models, class name).
_MODELS = MappingProxyType({
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
})


# The architectures whose models are built from the tensor-parallel blocks. GPT-2
# (its q/k/v stored as one tensor) and Qwen3-MoE (experts not split) run on one GPU.
_TENSOR_PARALLEL = frozenset({"Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                              "Qwen2ForCausalLM"})


def supports_tensor_parallel(architecture: str) -> bool:
    """Whether `architecture`'s model can be split over several ranks."""
    return architecture in _TENSOR_PARALLEL


def supported_architectures() -> list[str]:
    """Every architecture name a checkpoint may declare, sorted."""
    return sorted(_MODELS)


def resolve_architecture(architectures: Sequence[str]) -> str:
    """The first of a checkpoint's `architectures` that the registry knows.

    Raises:
        ValueError: one line naming what the checkpoint declares and what is supported.
    """
    for name in architectures:
        if name in _MODELS:
            return name
    raise ValueError(f"config.json: architectures {list(architectures)} are not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class that implements `architecture` (its module imported on first use).

    Raises:
        ValueError: for a name the registry does not know.
    """
    module_name, class_name = _MODELS[resolve_architecture([architecture])]
    module = importlib.import_module(f"mini_vllm.models.{module_name}")
    return getattr(module, class_name)
# --8<-- [end:registry]


__all__ = ["get_model_class", "resolve_architecture", "supported_architectures",
           "supports_tensor_parallel"]
