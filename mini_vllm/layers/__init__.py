"""The blocks every model is made of, each with a reference and, where a kernel
applies, a fast implementation (`CustomOp`)."""

from mini_vllm.layers.activation import GELU, SiluAndMul, get_act_fn
from mini_vllm.layers.attention import Attention
from mini_vllm.layers.custom_op import CustomOp, select_implementations
from mini_vllm.layers.fused_moe import FusedMoE, select_experts
from mini_vllm.layers.layernorm import LayerNorm, RMSNorm
from mini_vllm.layers.linear import Linear
from mini_vllm.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mini_vllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, get_rope
from mini_vllm.layers.vocab_embedding import LMHead, VocabEmbedding
from mini_vllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "GELU",
    "Attention",
    "ColumnParallelLinear",
    "CustomOp",
    "FusedMoE",
    "LMHead",
    "LayerNorm",
    "Linear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabEmbedding",
    "VocabParallelEmbedding",
    "apply_rotary_emb",
    "get_act_fn",
    "get_rope",
    "select_experts",
    "select_implementations",
]
