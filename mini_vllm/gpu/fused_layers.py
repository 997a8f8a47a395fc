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

Without the kernels (a CPU, in the tests) the same arithmetic runs on the
torch references, op for op, so the folding itself is tested anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.attention import AttentionMetadata, KVCache
from mini_vllm.config import ModelConfig
from mini_vllm.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from mini_vllm.layers._fast import kernels_run_on
from mini_vllm.ops import layer_ops


# --8<-- [start:fusable]
def layer_kernels_usable(config: ModelConfig, device: torch.device | str,
                         dtype: torch.dtype) -> bool:
    """Whether the fused CUDA layer kernels can run a model of this shape here."""
    return (kernels_run_on(torch.device(device), dtype) and config.head_dim in (64, 128, 256)
            and config.hidden_size % 8 == 0 and config.intermediate_size % 8 == 0)


def foldable(model: nn.Module) -> bool:
    """Whether every decoder layer has the shape `FusedDecoderForward` runs: an RMSNorm
    before q/k/v (no bias) with q/k RMSNorms and neox RoPE, and an RMSNorm before a
    SwiGLU MLP (no bias). Qwen3 has it; a family without q/k norms does not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not isinstance(getattr(inner, "norm", None), RMSNorm):
        return False
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = (getattr(layer, "input_layernorm", None),
                 getattr(layer, "post_attention_layernorm", None),
                 getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
        if not all(isinstance(p, RMSNorm) for p in parts):
            return False
        if not (isinstance(getattr(attn, "qkv_proj", None), Linear)
                and isinstance(getattr(attn, "rotary_emb", None), RotaryEmbedding)
                and isinstance(getattr(mlp, "gate_up_proj", None), Linear)
                and isinstance(getattr(mlp, "act_fn", None), SiluAndMul)):
            return False
        if attn.qkv_proj.bias is not None or mlp.gate_up_proj.bias is not None:
            return False
    return True
# --8<-- [end:fusable]


# --8<-- [start:fold]
@torch.no_grad()
def fold_norm_weights(layer: nn.Module) -> None:
    """`W <- W * diag(norm.weight)` for the products after the layer's two norms,
    then `norm.weight <- 1`: the model's own forward computes the same function,
    and the fused forward needs only the norms' row scale."""
    for linear, norm in ((layer.self_attn.qkv_proj, layer.input_layernorm),
                         (layer.mlp.gate_up_proj, layer.post_attention_layernorm)):
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
        o = backend.paged_attention(q, *kv_cache, meta, attn.attn.scale, k, v)  # [T, Hq, D]
        attn.o_proj.add_to(o.reshape(t, hq * d), residual)
    # --8<-- [end:attention]

    # --8<-- [start:mlp]
    def _mlp(self, layer: nn.Module, residual: torch.Tensor) -> None:
        """`residual += mlp(norm(residual))`, the norm folded into `gate_up_proj`."""
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


__all__ = ["FusedDecoderForward", "fold_norm_weights", "foldable", "layer_kernels_usable",
           "prepare_forward"]
