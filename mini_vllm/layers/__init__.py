"""The blocks every model is made of, each with a reference and, where a kernel
applies, a fast implementation (`CustomOp`)."""

from mini_vllm.layers.activation import SiluAndMul
from mini_vllm.layers.attention import Attention
from mini_vllm.layers.custom_op import CustomOp, select_implementations
from mini_vllm.layers.layernorm import RMSNorm
from mini_vllm.layers.linear import Linear
from mini_vllm.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mini_vllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb
from mini_vllm.layers.vocab_embedding import LMHead, VocabEmbedding
from mini_vllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "CustomOp",
    "LMHead",
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
    "select_implementations",
]
