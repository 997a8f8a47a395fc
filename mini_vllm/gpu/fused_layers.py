"""A decoder layer as the GPU runs it: norms folded into weights, kernels fused.

The model's own forward (`models/qwen3.py`) is the reference: each block does
one thing. On a GPU, a decode step of Qwen3-0.6B is hundreds of small
launches, so the GPU runner prepares the model once (`prepare_forward`) and
runs each decoder layer as fewer, fused launches over the same weights:

    residual += o_proj(attention(qk_norm_rope(scale(qkv_proj'(residual)))))
    residual += down_proj(silu_and_mul(scale(gate_up_proj'(residual))))

- The two RMSNorms are folded into the products after them: `qkv_proj'` and
  `gate_up_proj'` hold `W * diag(norm.weight)`, and the norm weights become
  1, so the model's own forward still computes the same function. What is
  left of a norm is its per-row scale `1 / rms(residual)`, applied by the
  kernel after the product (`scale_rows_ref` says what it computes).
- One kernel does q/k-norm + RoPE of every head, in place, and stores k and v
  in the KV cache (`layer_ops.qk_norm_rope`): no separate cache write.
- `o_proj` and `down_proj` add into the residual stream themselves
  (`Linear.add_to`), and where our GEMV or GEMM runs `gate_up_proj`, SiLU · mul
  runs in its epilogue (`Linear.silu_and_mul`).
- Every layer's QKV projection writes into one buffer when the piecewise CUDA
  graphs hand one over (`CudaAttentionMetadata.qkv_out`).

Other families of the same outline run the parts that apply to them:

- no q/k norms (Llama, Mistral, Qwen2): the input norm stays a norm (its own
  kernel; Qwen2's q/k/v biases must not be scaled with the rows, so nothing
  is folded into `qkv_proj`), RoPE rotates q and k in place in the QKV
  buffer, the KV write is the backend's; the MLP half is Qwen3's;
- experts instead of a dense MLP (Qwen3-MoE): the attention half is Qwen3's,
  the post-attention norm stays a norm and the MoE block runs as it is.

Without the kernels (a CPU, in the tests) the same arithmetic runs on the
torch references, op for op, so the folding itself is tested anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.attention import AttentionMetadata, KVCache
from mini_vllm.layers import FusedMoE, Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from mini_vllm.layers._fast import kernels_run_on
from mini_vllm.model_config import ModelConfig
from mini_vllm.ops import layer_ops


# --8<-- [start:fusable]
def layer_kernels_usable(config: ModelConfig, device: torch.device | str,
                         dtype: torch.dtype) -> bool:
    """Whether the fused CUDA layer kernels can run a model of this shape here."""
    return (kernels_run_on(torch.device(device), dtype) and config.head_dim in (64, 128, 256)
            and config.hidden_size % 8 == 0 and config.intermediate_size % 8 == 0)


def attention_kind(layer: nn.Module) -> str | None:
    """How `FusedDecoderForward` runs a layer's attention half: `"qk_norm"` (Qwen3: an
    RMSNorm, q/k/v without bias, q/k RMSNorms, neox RoPE), `"rope"` (Llama, Mistral,
    Qwen2: an RMSNorm, q/k/v with or without bias, RoPE), or None (another shape)."""
    attn = getattr(layer, "self_attn", None)
    if not (isinstance(getattr(layer, "input_layernorm", None), RMSNorm)
            and isinstance(getattr(attn, "qkv_proj", None), Linear)
            and isinstance(getattr(attn, "o_proj", None), Linear) and attn.o_proj.bias is None
            and isinstance(getattr(attn, "rotary_emb", None), RotaryEmbedding)):
        return None
    norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    if all(isinstance(n, RMSNorm) for n in norms):
        return "qk_norm" if attn.qkv_proj.bias is None else None
    return "rope" if norms == (None, None) else None


def mlp_kind(layer: nn.Module) -> str | None:
    """How `FusedDecoderForward` runs a layer's MLP half: `"swiglu"` (an RMSNorm before
    a SwiGLU MLP without biases), `"moe"` (an RMSNorm before experts), or None."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(getattr(layer, "post_attention_layernorm", None), RMSNorm):
        return None
    if isinstance(getattr(mlp, "experts", None), FusedMoE):
        return "moe"
    if (isinstance(getattr(mlp, "gate_up_proj", None), Linear)
            and isinstance(getattr(mlp, "act_fn", None), SiluAndMul)
            and isinstance(getattr(mlp, "down_proj", None), Linear)
            and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None):
        return "swiglu"
    return None


def foldable(model: nn.Module) -> bool:
    """Whether every decoder layer has a shape `FusedDecoderForward` runs (see
    `attention_kind` and `mlp_kind`) and the model ends on an RMSNorm: Qwen3, Llama,
    Mistral, Qwen2 and Qwen3-MoE do; GPT-2 (LayerNorm, GELU) does not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not isinstance(getattr(inner, "norm", None), RMSNorm):
        return False
    return all(attention_kind(layer) and mlp_kind(layer) for layer in layers)
# --8<-- [end:fusable]


# --8<-- [start:fold]
@torch.no_grad()
def fold_norm_weights(layer: nn.Module) -> None:
    """`W <- W * diag(norm.weight)` for the products after the layer's norms that
    `FusedDecoderForward` folds (Qwen3's q/k/v, every dense SwiGLU's gate/up), then
    `norm.weight <- 1`: the model's own forward computes the same function, and the
    fused forward needs only the norms' row scale."""
    pairs = []
    if attention_kind(layer) == "qk_norm":
        pairs.append((layer.self_attn.qkv_proj, layer.input_layernorm))
    if mlp_kind(layer) == "swiglu":
        pairs.append((layer.mlp.gate_up_proj, layer.post_attention_layernorm))
    for linear, norm in pairs:
        # In place, no float32 copy: a bf16 product is computed in float32 and
        # rounded once, as `(w.float() * g.float()).to(bf16)` would be.
        linear.weight.mul_(norm.weight)  # [N, K] * [K]: column k scaled by g[k]
        norm.weight.fill_(1.0)
# --8<-- [end:fold]


class FusedDecoderForward:
    """The model's forward (no LM head) with its decoder layers fused and folded.

    Building it folds the norm weights into the model's weights, once.

    Args:
        model: a `foldable` model, weights loaded.
        kernels: run the fused CUDA kernels (`layer_kernels_usable`); False runs
            the same arithmetic on the torch references.
    """

    def __init__(self, model: nn.Module, kernels: bool) -> None:
        if not foldable(model):
            raise ValueError(f"{type(model).__name__}: its decoder layers do not have the shape "
                             "the fused forward runs (see foldable())")
        self.model = model
        self.kernels = kernels
        # Each layer's (attention kind, MLP kind), looked up per step by the layer's id.
        self._kinds = {id(layer): (attention_kind(layer), mlp_kind(layer))
                       for layer in model.model.layers}
        for layer in model.model.layers:
            fold_norm_weights(layer)

    # --8<-- [start:forward]
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        inner = self.model.model
        residual = inner.embed_tokens(input_ids)  # [T, hidden]: updated in place from here
        for layer, kv_cache in zip(inner.layers, kv_caches, strict=True):
            self._attention(layer, positions, residual, kv_cache, attn_metadata)
            self._mlp(layer, residual)
        return inner.norm(residual)
    # --8<-- [end:forward]

    # --8<-- [start:attention]
    def _attention(self, layer: nn.Module, positions: torch.Tensor, residual: torch.Tensor,
                   kv_cache: KVCache, meta: AttentionMetadata) -> None:
        """`residual += attention(norm(residual))`, the norm folded into `qkv_proj`."""
        if self._kinds[id(layer)][0] == "rope":
            return self._attention_rope(layer, positions, residual, kv_cache, meta)
        attn = layer.self_attn
        eps = layer.input_layernorm.eps
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        t = residual.shape[0]
        # Piecewise CUDA graphs give every layer the same buffer to write into.
        qkv_out = getattr(meta, "qkv_out", None)
        qkv = attn.qkv_proj.forward_fast(residual, None if qkv_out is None else qkv_out[:t])
        backend = attn.attn.backend
        kv_written = False
        if self.kernels:  # the row scale, norms + RoPE of every q and k head: one launch
            # When the backend would write the cache with reshape_and_cache, this
            # launch stores k and v there as well: the same bytes, one launch fewer.
            kv_written = getattr(backend, "write_impl", None) == "kernel"
            cache_write = ({"kv_cache": kv_cache, "slot_mapping": meta.slot_mapping}
                           if kv_written else {})
            layer_ops.qk_norm_rope(qkv, attn.q_norm.weight, attn.k_norm.weight,
                                   attn.rotary_emb.cos_sin_cache, positions, hq, hkv, d,
                                   attn.q_norm.eps, residual=residual, residual_eps=eps,
                                   **cache_write)
        else:
            qkv = layer_ops.scale_rows_ref(qkv, residual, eps)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if not self.kernels:
            q, k = attn.rotary_emb(positions, attn.q_norm(q), attn.k_norm(k))
        if not kv_written:
            backend.write_kv_cache(k, v, *kv_cache, meta.slot_mapping)
        o = backend.paged_attention(q, *kv_cache, meta, attn.attn.scale, k, v,
                                    sliding_window=attn.attn.sliding_window)  # [T, Hq, D]
        attn.o_proj.add_to(o.reshape(t, hq * d), residual)
        return None
    # --8<-- [end:attention]

    # --8<-- [start:attention_rope]
    def _attention_rope(self, layer: nn.Module, positions: torch.Tensor,
                        residual: torch.Tensor, kv_cache: KVCache,
                        meta: AttentionMetadata) -> None:
        """`residual += attention(norm(residual))` for a layer without q/k norms.

        The norm runs as itself (one kernel on a GPU) and `qkv_proj` adds its
        bias to the normed rows; q and k are rotated in place, so attention
        reads q, k and v out of the one QKV buffer.
        """
        attn = layer.self_attn
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        t = residual.shape[0]
        qkv_out = getattr(meta, "qkv_out", None)
        qkv = attn.qkv_proj.forward_fast(layer.input_layernorm(residual),
                                         None if qkv_out is None else qkv_out[:t])
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        q_rot, k_rot = attn.rotary_emb(positions, q, k)
        q.copy_(q_rot)
        k.copy_(k_rot)
        backend = attn.attn.backend
        backend.write_kv_cache(k, v, *kv_cache, meta.slot_mapping)
        o = backend.paged_attention(q, *kv_cache, meta, attn.attn.scale, k, v,
                                    sliding_window=attn.attn.sliding_window)  # [T, Hq, D]
        attn.o_proj.add_to(o.reshape(t, hq * d), residual)
    # --8<-- [end:attention_rope]

    # --8<-- [start:mlp]
    def _mlp(self, layer: nn.Module, residual: torch.Tensor) -> None:
        """`residual += mlp(norm(residual))`, the norm folded into `gate_up_proj`."""
        if self._kinds[id(layer)][1] == "moe":  # the experts run as the block runs them
            residual.add_(layer.mlp(layer.post_attention_layernorm(residual)))
            return
        mlp, eps = layer.mlp, layer.post_attention_layernorm.eps
        # Where our products run (the GEMV to 16 rows, gemm_wgmma to 128 on Hopper),
        # they apply SiLU · mul in their epilogue; elsewhere this is None.
        act = mlp.gate_up_proj.silu_and_mul(residual, eps)
        if act is None:
            gate_up = mlp.gate_up_proj.forward_fast(residual)  # rows still to be scaled
            if self.kernels:
                act = layer_ops.silu_and_mul(gate_up, residual, eps)
            else:
                act = layer_ops.silu_and_mul_ref(layer_ops.scale_rows_ref(gate_up, residual, eps))
        mlp.down_proj.add_to(act, residual)
    # --8<-- [end:mlp]


def prepare_forward(model: nn.Module, device: torch.device, dtype: torch.dtype
                    ) -> nn.Module | FusedDecoderForward:
    """The forward the GPU runner calls: the fused one where the layer kernels run
    and the model has its shape, else the model itself (its blocks already on
    their fast implementations where those run)."""
    config = getattr(model, "config", None)
    if (config is not None and layer_kernels_usable(config, device, dtype)
            and foldable(model)):
        return FusedDecoderForward(model, kernels=True)
    return model


__all__ = ["FusedDecoderForward", "attention_kind", "fold_norm_weights", "foldable",
           "layer_kernels_usable", "mlp_kind", "prepare_forward"]
