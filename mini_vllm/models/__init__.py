"""Model definitions (our own Qwen3) and the safetensors loader."""

from mini_vllm.models.loader import load_model, load_weights
from mini_vllm.models.qwen3 import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM", "load_model", "load_weights"]
