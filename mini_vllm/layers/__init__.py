"""The blocks every model is made of, each with a reference and, where a kernel
applies, a fast implementation (`CustomOp`)."""

from mini_vllm.layers.activation import SiluAndMul
from mini_vllm.layers.attention import Attention
from mini_vllm.layers.custom_op import CustomOp, select_implementations
from mini_vllm.layers.layernorm import RMSNorm
from mini_vllm.layers.linear import Linear
from mini_vllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb
from mini_vllm.layers.vocab_embedding import LMHead, VocabEmbedding

__all__ = [
    "Attention",
    "CustomOp",
    "LMHead",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary_emb",
    "select_implementations",
]
