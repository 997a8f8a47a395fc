"""Model definitions (Qwen3, Qwen3-MoE, Llama, Mistral, Qwen2, GPT-2), the registry
that picks one from `config.json`, and the safetensors loader."""

from mini_vllm.models.loader import load_model, load_weights
from mini_vllm.models.qwen3 import Qwen3ForCausalLM
from mini_vllm.models.registry import get_model_class, supported_architectures

__all__ = ["Qwen3ForCausalLM", "get_model_class", "load_model", "load_weights",
           "supported_architectures"]
