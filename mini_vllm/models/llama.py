"""Llama (Llama 2, Llama 3.x) and Mistral over a flat batch of tokens.

Llama's decoder layer is Qwen3's without the per-head q/k norms: RMSNorm,
grouped-query attention with RoPE, RMSNorm, SwiGLU. What differs between the
checkpoints of this shape is configuration, read from `config.json`:

- the RoPE table (`get_rope`): Llama 3.1's `llama3` scaling, or plain;
- biases (`attention_bias`, `mlp_bias`; Qwen2's q/k/v biases, `models/qwen2.py`);
- a sliding attention window (Mistral 7B v0.1's 4,096 tokens);
- tied or separate input and output embeddings (Llama 3.2 1B/3B tie them).

Like `qwen3.py`, the model only composes blocks of `mini_vllm.layers`; names
follow Hugging Face's `LlamaForCausalLM`, with q/k/v fused into `qkv_proj`
and gate/up into `gate_up_proj` (`packed_modules_mapping`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import nn

from mini_vllm.attention import AttentionBackend, AttentionMetadata, KVCache
from mini_vllm.distributed.parallel_state import ParallelContext
from mini_vllm.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope,
)
from mini_vllm.model_config import ModelConfig


# --8<-- [start:attention]
class LlamaAttention(nn.Module):
    """Grouped-query attention with RoPE (no q/k norms):

        x [T, hidden] -> qkv_proj (+ bias) -> q [T, Hq, D], k, v [T, Hkv, D]
        q, k -> RoPE -> Attention (window: `sliding_window`) -> [T, Hq * D] -> o_proj

    Args:
        config: the checkpoint's shape.
        layer: this layer's index (it decides the attention window).
        rotary_emb: the RoPE table every layer shares.
        qkv_bias: biases on q, k and v.
        o_bias: a bias on the output projection.
        backend, device, dtype, parallel: as for the model.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=qkv_bias, parallel=parallel, device=device,
            dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=o_bias, parallel=parallel,
                                        device=device, dtype=dtype)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim**-0.5, backend,
                              sliding_window=config.layer_sliding_window(layer))

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        t = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))
# --8<-- [end:attention]


class LlamaMLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, gate and up fused into one matmul."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {config.hidden_act!r} is not supported "
                             "for this family (silu)")
        inter, bias = config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=bias, parallel=parallel, device=device,
            dtype=dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias,
                                           parallel=parallel, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # gate_up: [T, 2 * inter]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block, the residual carried beside the output (as in `Qwen3DecoderLayer`)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary_emb: RotaryEmbedding,
        biases: tuple[bool, bool],
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, rotary_emb, *biases, backend, device,
                                        dtype, parallel)
        self.mlp = LlamaMLP(config, device, dtype, parallel)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp output, residual)`; their sum is the block's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (no LM head)."""

    def __init__(
        self,
        config: ModelConfig,
        biases: tuple[bool, bool],
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   parallel, device, dtype)
        rotary_emb = get_rope(config.head_dim, config.max_position_embeddings,
                              config.rope_theta, config.rope_scaling, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, biases, backend, device, dtype, parallel)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache,
                                            attn_metadata)
        return self.norm(hidden_states, residual)[0]


# --8<-- [start:causal_lm]
class LlamaForCausalLM(nn.Module):
    """Llama with its language-model head (tied to the embedding where the config says).

    Args:
        config: the checkpoint's shape.
        attn_backend: how attention reads and writes the KV cache (the torch
            reference when None).
        device: where to allocate the weights (uninitialised until loaded).
        dtype: the weights' dtype.
        parallel: the tensor-parallel group this rank belongs to (one rank when None).
    """

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    })

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): Llama's `attention_bias` sets both."""
        return config.attention_bias, config.attention_bias

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_biases(config), attn_backend, device,
                                dtype, parallel)
        self.lm_head = ParallelLMHead(
            config.hidden_size, config.vocab_size,
            self.model.embed_tokens if config.tie_word_embeddings else None, parallel, device,
            dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`[T]` ids and positions of a flat batch -> `[T, hidden_size]` final hidden states."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project `[N, hidden_size]` hidden states to `[N, vocab_size]` float32 logits."""
        return self.lm_head(hidden_states).float()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers; where `sliding_window` is set, every layer's attention
    sees only that many positions (read from the config by `LlamaAttention`)."""
# --8<-- [end:causal_lm]


__all__ = [
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "MistralForCausalLM",
]
