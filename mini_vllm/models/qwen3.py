"""Qwen3 (dense) over a flat batch of tokens from many sequences.

The model sees `T` tokens at once: no batch dimension, no padding. Which
sequence each token belongs to, and what it may attend to, is carried by
`positions` (for RoPE) and `AttentionMetadata` (for the paged KV cache), so
the same forward serves a prefill, a decode step or any mix of them.

The model only composes blocks of `mini_vllm.layers`; how each block runs
(plain PyTorch, or a CUDA kernel) is the block's business, and so is how it
is split over the ranks of a tensor-parallel group (`parallel`): the model
passes the group to its blocks and keeps each rank's head counts.

Module and parameter names follow Hugging Face's `Qwen3ForCausalLM`, except
that the q/k/v projections are fused into `qkv_proj` and gate/up into
`gate_up_proj` (one matmul instead of three or two); `packed_modules_mapping`
tells the loader which checkpoint tensors fill which rows of a fused weight.
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
class Qwen3Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k.

    Data flow for `T` tokens (`Hq` query heads, `Hkv` KV heads, head size `D`,
    each the count on this rank: the model's divided by the tensor-parallel
    size, the KV heads replicated when there are fewer than ranks):

        x [T, hidden] -> qkv_proj -> [T, (Hq + 2*Hkv) * D] -> split q | k | v
        q [T, Hq, D]  -> q_norm -> RoPE --+
        k [T, Hkv, D] -> k_norm -> RoPE --+--> Attention: write k, v to the cache,
        v [T, Hkv, D] --------------------+    attend over it -> [T, Hq, D]
        [T, Hq * D] -> o_proj -> [T, hidden]  (summed over the ranks)
    """

    def __init__(
        self,
        config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, parallel=parallel, device=device, dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, parallel=parallel, device=device,
                                        dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device, dtype)
        self.rotary_emb = rotary_emb  # one table, shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim**-0.5, backend)

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
        # The norms act on each head separately, before RoPE.
        q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        o = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))
# --8<-- [end:attention]


# --8<-- [start:mlp]
class Qwen3MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, with gate and up fused into one matmul."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], parallel=parallel, device=device, dtype=dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, parallel=parallel,
                                           device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up: [T, 2 * inter / N] on each of N ranks; down_proj sums the ranks'.
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
# --8<-- [end:mlp]


# --8<-- [start:decoder_layer]
class Qwen3DecoderLayer(nn.Module):
    """Pre-norm transformer block: `h = x + attn(norm(x))`, then `h + mlp(norm(h))`.

    The residual stream is carried beside the sub-layer output rather than
    added at the end of the block, so that each "add, then normalise" is one
    step (`RMSNorm(x, residual)`, one fused kernel on a GPU):

        residual ──────────┬──────────────(+)──┬─────────────(+)──► next layer
                           │                 ▲ │               ▲
        x ─(+ residual)─ norm ─► attention ──┘ norm ─► MLP ────┘
    """

    def __init__(
        self,
        config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, backend, device, dtype, parallel)
        self.mlp = Qwen3MLP(config, device, dtype, parallel)
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
        if residual is None:  # the first layer: the residual stream starts here
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual
# --8<-- [end:decoder_layer]


class Qwen3Model(nn.Module):
    """Embeddings, the decoder layers and the final norm (no LM head)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   parallel, device, dtype)
        # Plain RoPE, or YaRN where config.json asks for it (Qwen3's long contexts).
        rotary_emb = get_rope(config.head_dim, config.max_position_embeddings,
                              config.rope_theta, config.rope_scaling, device)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, rotary_emb, backend, device, dtype, parallel)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)

    # --8<-- [start:model_forward]
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
    # --8<-- [end:model_forward]


# --8<-- [start:causal_lm]
class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with its language-model head.

    Args:
        config: the checkpoint's shape.
        attn_backend: how attention reads and writes the KV cache (the torch
            reference when None).
        device: where to allocate the weights (uninitialised until loaded).
        dtype: the weights' dtype.
        parallel: the tensor-parallel group this rank belongs to (one rank
            when None): each block holds this rank's share of its weights.
    """

    # --8<-- [start:packed]
    # Fused module -> the checkpoint modules stacked in its rows, in order.
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    })
    # --8<-- [end:packed]

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
        self.model = Qwen3Model(config, attn_backend, device, dtype, parallel)
        self.lm_head = ParallelLMHead(
            config.hidden_size, config.vocab_size,
            self.model.embed_tokens if config.tie_word_embeddings else None,
            parallel, device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: `[T]` token ids of the step's new tokens, sequence after sequence.
            positions: `[T]` each token's position in its own sequence.
            kv_caches: per layer `(k_cache, v_cache)`, each
                `[num_blocks, block_size, num_kv_heads, head_dim]`.
            attn_metadata: where the new K/V go and what each token attends to.

        Returns:
            `[T, hidden_size]` final hidden states (after the last norm).
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project `[N, hidden_size]` hidden states to `[N, vocab_size]` float32 logits."""
        return self.lm_head(hidden_states).float()
# --8<-- [end:causal_lm]


__all__ = [
    "Qwen3Attention",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3MLP",
    "Qwen3Model",
]
