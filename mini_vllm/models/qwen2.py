"""Qwen2 and Qwen2.5: Llama's decoder layer with biases on q, k and v.

A Qwen2 checkpoint stores `q_proj.bias`, `k_proj.bias` and `v_proj.bias`
(not `o_proj.bias`) whatever `config.json` says, so only the biases differ
from `LlamaForCausalLM`; the fused `qkv_proj` stacks the three biases as it
stacks the weights. Windows (`use_sliding_window`) come from the config as
for Mistral, from layer `max_window_layers` on.
"""

from __future__ import annotations

from mini_vllm.model_config import ModelConfig
from mini_vllm.models.llama import LlamaForCausalLM


# --8<-- [start:qwen2]
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 (see the module docstring)."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): always (True, False) in Qwen2."""
        return True, False
# --8<-- [end:qwen2]


__all__ = ["Qwen2ForCausalLM"]
