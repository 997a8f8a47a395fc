"""GPT-2 over a flat batch of tokens: the 2019 shape of a decoder.

What differs from the Llama-shaped families:

- positions are learned: a second embedding table `wpe [n_positions, hidden]`
  is added to the token embedding, and there is no RoPE;
- LayerNorm (centred, with a bias) instead of RMSNorm, and biases on every
  projection;
- the MLP is `c_proj(gelu_tanh(c_fc(x)))`, two matrices and no gate;
- every head has its own K/V (no grouped-query attention);
- the checkpoint stores its projections as `Conv1D` weights, `[in, out]`,
  the transpose of a `Linear`'s `[out, in]`: the loader transposes the
  names in `transposed_weights`. Its q/k/v are already one matrix, `c_attn`.

Names follow Hugging Face's `GPT2LMHeadModel` (`transformer.h.{i}.attn.c_attn`
...); checkpoints that store them without the `transformer.` prefix (the
original `gpt2` upload) load too (`base_model_prefix`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from mini_vllm.attention import AttentionBackend, AttentionMetadata, KVCache
from mini_vllm.layers import Attention, LayerNorm, Linear, LMHead, VocabEmbedding, get_act_fn
from mini_vllm.model_config import ModelConfig


# --8<-- [start:block]
class GPT2Attention(nn.Module):
    """Multi-head attention: `c_attn` (q | k | v, with biases), attention, `c_proj`."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.c_attn = Linear(hidden, [hidden, hidden, hidden], bias=True, device=device,
                             dtype=dtype)
        self.c_proj = Linear(hidden, [hidden], bias=True, device=device, dtype=dtype)
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale, backend)

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        t = hidden_states.shape[0]
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)  # [T, hidden] each
        shape = (t, self.num_heads, self.head_dim)
        o = self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape), kv_cache,
                      attn_metadata)  # [T, H, D]
        return self.c_proj(o.reshape(t, -1))


class GPT2MLP(nn.Module):
    """`c_proj(gelu(c_fc(x)))`: no gate."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.c_fc = Linear(config.hidden_size, [config.intermediate_size], bias=True,
                           device=device, dtype=dtype)
        self.act = get_act_fn(config.hidden_act)
        self.c_proj = Linear(config.intermediate_size, [config.hidden_size], bias=True,
                             device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """`x + attn(ln_1(x))`, then `h + mlp(ln_2(h))`."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps, device, dtype)
        self.attn = GPT2Attention(config, layer, backend, device, dtype)
        self.ln_2 = LayerNorm(config.hidden_size, eps, device, dtype)
        self.mlp = GPT2MLP(config, device, dtype)

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), kv_cache,
                                                  attn_metadata)
        return hidden_states + self.mlp(self.ln_2(hidden_states))
# --8<-- [end:block]


class GPT2Model(nn.Module):
    """Token and position embeddings, the blocks and the final LayerNorm."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size, device, dtype)
        self.wpe = VocabEmbedding(config.max_position_embeddings, config.hidden_size, device,
                                  dtype)
        self.h = nn.ModuleList(GPT2Block(config, i, backend, device, dtype)
                               for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon, device, dtype)

    # --8<-- [start:forward]
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # A token's position is a learned vector added to it, once, here.
        hidden_states = self.wte(input_ids) + self.wpe(positions)  # [T, hidden]
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden_states = block(hidden_states, kv_cache, attn_metadata)
        return self.ln_f(hidden_states)
    # --8<-- [end:forward]


# --8<-- [start:causal_lm]
class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its language-model head (tied to `wte` unless the config says not).

    Args:
        config: the checkpoint's shape.
        attn_backend: how attention reads and writes the KV cache.
        device: where to allocate the weights (uninitialised until loaded).
        dtype: the weights' dtype.
    """

    # Conv1D weights, stored [in, out]: transposed at load into our [out, in].
    transposed_weights: ClassVar[tuple[str, ...]] = (
        "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    # Checkpoints written by GPT2Model (the original upload) lack this prefix.
    base_model_prefix: ClassVar[str] = "transformer"
    # The causal-mask buffers older checkpoints carry: nothing to load.
    ignored_suffixes: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")
# --8<-- [end:causal_lm]

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config, attn_backend, device, dtype)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size,
                              self.transformer.wte if config.tie_word_embeddings else None,
                              device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`[T]` ids and positions of a flat batch -> `[T, hidden_size]` final hidden states."""
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project `[N, hidden_size]` hidden states to `[N, vocab_size]` float32 logits."""
        return self.lm_head(hidden_states).float()


__all__ = ["GPT2MLP", "GPT2Attention", "GPT2Block", "GPT2LMHeadModel", "GPT2Model"]
