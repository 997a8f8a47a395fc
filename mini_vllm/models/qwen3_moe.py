"""Qwen3-MoE: Qwen3's attention, and experts in place of the dense MLP.

Each decoder layer is Qwen3's (`Qwen3Attention`, with its q/k norms), except
that its MLP is a Mixture of Experts (`Qwen3MoeSparseMoeBlock`): a linear
router scores `num_experts` experts per token, the `num_experts_per_tok`
best run (`FusedMoE`), and their outputs are summed by the router's
probabilities. Layers listed in `mlp_only_layers` (or skipped by
`decoder_sparse_step`) keep a dense `Qwen3MLP`.

Qwen3-30B-A3B has 128 experts of width 768 and routes each token to 8:
about 3 B of its 30 B parameters run per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import nn

from mini_vllm.attention import AttentionBackend, AttentionMetadata, KVCache
from mini_vllm.layers import (
    FusedMoE,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    get_rope,
)
from mini_vllm.model_config import ModelConfig
from mini_vllm.models.qwen3 import Qwen3Attention, Qwen3MLP


# --8<-- [start:sparse_moe]
class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router (`gate`, `[hidden] -> [num_experts]` logits) and the experts."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {config.hidden_act!r} is not supported "
                             "for Qwen3-MoE (silu)")
        self.gate = Linear(config.hidden_size, [config.num_experts], device=device, dtype=dtype)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size,
                                renormalize=config.norm_topk_prob, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # router logits: [T, num_experts]
# --8<-- [end:sparse_moe]


class Qwen3MoeDecoderLayer(nn.Module):
    """`Qwen3DecoderLayer` with a sparse MoE block where the config puts one."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, backend, device, dtype)
        self.mlp: nn.Module = (Qwen3MoeSparseMoeBlock(config, device, dtype)
                               if config.is_moe_layer(layer) else Qwen3MLP(config, device, dtype))
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


class Qwen3MoeModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (no LM head)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, device, dtype)
        rotary_emb = get_rope(config.head_dim, config.max_position_embeddings,
                              config.rope_theta, config.rope_scaling, device)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, i, rotary_emb, backend, device, dtype)
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


class Qwen3MoeForCausalLM(nn.Module):
    """Qwen3-MoE with its language-model head.

    The experts' checkpoint tensors (`mlp.experts.{e}.gate_proj.weight` ...)
    go into `FusedMoE`'s stacked weights through its `checkpoint_targets`.
    """

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    })

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config, attn_backend, device, dtype)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size,
                              self.model.embed_tokens if config.tie_word_embeddings else None,
                              device, dtype)

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


__all__ = ["Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", "Qwen3MoeModel",
           "Qwen3MoeSparseMoeBlock"]
