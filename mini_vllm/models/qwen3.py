"""Qwen3 (dense) over a flat batch of tokens from many sequences.

The model sees `T` tokens at once: no batch dimension, no padding. Which
sequence each token belongs to, and what it may attend to, is carried by
`positions` (for RoPE) and `AttentionMetadata` (for the paged KV cache), so
the same forward serves a prefill, a decode step or any mix of them.

Module and parameter names follow Hugging Face's `Qwen3ForCausalLM`, except
that the q/k/v projections are fused into `qkv_proj` and gate/up into
`gate_up_proj` (one matmul instead of three or two); `packed_modules_mapping`
tells the loader which checkpoint tensors fill which rows of a fused weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm import ops
from mini_vllm.attention import Attention, AttentionBackend, AttentionMetadata, KVCache
from mini_vllm.config import ModelConfig
from mini_vllm.ops import layer_ops
from mini_vllm.ops.gemv import gemm_wgmma, gemm_wgmma_pays, gemv, gemv_usable


# --8<-- [start:use_kernels]
def layer_kernels_usable(config: ModelConfig, device: torch.device | str | None,
                         dtype: torch.dtype | None) -> bool:
    """Whether the fused CUDA layer kernels (phase 9) can run this model."""
    return (torch.device(device or "cpu").type == "cuda" and ops.is_available()
            and dtype in layer_ops.LAYER_DTYPES and config.head_dim in (64, 128, 256)
            and config.hidden_size % 8 == 0 and config.intermediate_size % 8 == 0)
# --8<-- [end:use_kernels]


# --8<-- [start:linear]
class Linear(nn.Module):
    """`y = x @ W.T` without bias, whose output may be several projections stacked.

    `output_sizes` lists the row counts of the stacked projections: a fused
    q/k/v projection has `[q_size, kv_size, kv_size]`. The weight is left
    uninitialised: every parameter is filled by the loader, which fails
    loudly if one is missing.

    Args:
        input_size: features in.
        output_sizes: rows of each stacked projection.
        device: where to allocate the weight.
        dtype: the weight's dtype.
        use_kernels: multiply 1 to 16 rows (a decode step of up to 16
            sequences) with the skinny-GEMM kernel of `mini_vllm.ops.gemv`
            when it can run them, and the shapes where `gemm_wgmma` beats
            cuBLAS on Hopper (`gemm_wgmma_pays`: up to 128 rows, K up to
            3,072); cuBLAS (`F.linear`) does everything else. On those of
            our kernels, `silu_and_mul` runs the MLP's activation in the
            product's epilogue.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.use_kernels = use_kernels
        self.weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, device=device, dtype=dtype),
            requires_grad=False,
        )

    def _kernel(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """Our kernel for `x @ W.T`, or None for cuBLAS.

        Asked on every call (the weight of a tied lm_head is swapped in after
        construction, and the row count changes from step to step), so the
        test is attribute reads only.
        """
        if self.use_kernels:
            if gemv_usable(x, self.weight):
                return gemv
            if gemm_wgmma_pays(x, self.weight):
                return gemm_wgmma
        return None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T`, into `out` (`[rows, sum(output_sizes)]`, contiguous) when given."""
        kernel = self._kernel(x)
        if out is None:
            return kernel(x, self.weight) if kernel else F.linear(x, self.weight)
        want = (x.shape[0], self.weight.shape[0])
        if out.shape != want:
            raise ValueError(f"out: shape {tuple(out.shape)}, the product is {want}")
        if not out.is_contiguous():
            raise ValueError("out: must be contiguous (the product writes it row by row)")
        if kernel:
            return kernel(x, self.weight, out=out)
        return torch.matmul(x, self.weight.t(), out=out)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out += x @ W.T` in place, the sum rounded once: a sub-layer's output
        added into the residual stream by the matrix product itself."""
        kernel = self._kernel(x)
        if kernel:
            kernel(x, self.weight, out=out, accumulate=True)
        else:
            out.addmm_(x, self.weight.t())

    def silu_and_mul(self, x: torch.Tensor, eps: float) -> torch.Tensor | None:
        """`silu(s * gate) * (s * up)` for a `[gate; up]` weight, `s = 1 / rms(x)`
        per row: the product and the activation in one launch, where one of our
        kernels takes `x` (`silu_mul_product_ref` says what it computes); None
        where cuBLAS would multiply, and the caller runs the two apart."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"silu_and_mul: needs [gate; up] of equal halves, this layer "
                             f"stacks {self.output_sizes}")
        kernel = self._kernel(x)
        return kernel(x, self.weight, silu_eps=eps) if kernel else None
# --8<-- [end:linear]


class VocabEmbedding(nn.Module):
    """Token id -> row of a `[vocab_size, hidden_size]` table (left uninitialised)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype),
            requires_grad=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """Root-mean-square norm: `x / sqrt(mean(x^2) + eps) * weight`, over the last dim.

    Normalised in float32 and cast back before the weight is applied, as
    Hugging Face does, so bfloat16 runs match it. `F.rms_norm` does the
    float32 part in one fused kernel on a GPU: 5 us a call with the weight,
    against 19 us for six separate ops (256 tokens, H200), and a decode step
    of Qwen3-0.6B runs 113 norms.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.use_kernels = use_kernels
        self.weight = nn.Parameter(
            torch.ones(dim, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return layer_ops.rms_norm(x, self.weight, self.eps)[0]
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual = x + residual`, then normalise it: the step between two sub-layers.

        Returns:
            (normalised, new residual). With the CUDA kernels this is one
            launch and the residual is updated in place.
        """
        if self.use_kernels:
            return layer_ops.rms_norm(x, self.weight, self.eps, residual)
        return layer_ops.rms_norm_ref(x, self.weight, self.eps, residual)
# --8<-- [end:rmsnorm]


# --8<-- [start:rope]
class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "neox" style (rotate the two halves of a head).

    For head size `D`, pair `(x[i], x[i + D/2])` of a head at position `p`
    is rotated by angle `p * theta^(-2i/D)`:

        x[:D/2]' = x[:D/2] * cos - x[D/2:] * sin
        x[D/2:]' = x[D/2:] * cos + x[:D/2] * sin

    cos/sin are precomputed in float32 for every position once, so a step
    only gathers the rows of its `positions` (once, for all layers).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        )  # [D/2]
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, D]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the tokens' `positions [T]`, each `[T, 1, D/2]` (1 broadcasts over heads)."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).chunk(2, dim=-1)  # [T, D/2] each
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the heads `x [T, H, D]` by `cos, sin [T, 1, D/2]`."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
# --8<-- [end:rope]


# --8<-- [start:attention]
class Qwen3Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k.

    Data flow for `T` tokens (`Hq` query heads, `Hkv` KV heads, head size `D`):

        x [T, hidden] -> qkv_proj -> [T, (Hq + 2*Hkv) * D] -> split q | k | v
        q [T, Hq, D]  -> q_norm -> RoPE --+
        k [T, Hkv, D] -> k_norm -> RoPE --+--> Attention: write k, v to the cache,
        v [T, Hkv, D] --------------------+    attend over it -> [T, Hq, D]
        [T, Hq * D] -> o_proj -> [T, hidden]
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.use_kernels = use_kernels
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], device, dtype,
            use_kernels,
        )
        self.o_proj = Linear(self.q_size, [config.hidden_size], device, dtype, use_kernels)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device, dtype)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, backend
        )

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`rope` is `(cos, sin)` of the tokens, or with the CUDA kernels the
        model's `(cos_sin_cache, positions)`."""
        o = self._attend(rope, hidden_states, kv_cache, attn_metadata)
        return self.o_proj(o)

    def forward_folded(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        residual: torch.Tensor,
        norm_eps: float,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> None:
        """`residual += attention(norm(residual))`, the norm's weight folded into
        `qkv_proj` (see `Qwen3ForCausalLM.process_weights_after_loading`)."""
        o = self._attend(rope, residual, kv_cache, attn_metadata, (residual, norm_eps))
        self.o_proj.add_to(o, residual)

    def _attend(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        scale_by: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Attention's output before `o_proj`, `[T, q_size]`.

        `scale_by = (residual, eps)`: `x` is the raw residual stream, and the
        rows of `qkv` are scaled by its `1 / rms` before anything else.
        """
        t = x.shape[0]
        # Piecewise CUDA graphs give every layer the same buffer to write into.
        qkv_out = getattr(attn_metadata, "qkv_out", None)
        qkv = self.qkv_proj(x, None if qkv_out is None else qkv_out[:t])  # [T, q + 2 kv]
        kv_written = False
        if self.use_kernels:  # norms + RoPE of every q and k head: one launch, in place
            cos_sin_cache, positions = rope
            # When the backend would write the cache with reshape_and_cache, this
            # launch stores k and v there as well: the same bytes, one launch fewer.
            kv_written = getattr(self.attn.backend, "write_impl", None) == "kernel"
            cache_write = ({"kv_cache": kv_cache, "slot_mapping": attn_metadata.slot_mapping}
                           if kv_written else {})
            scale = ({"residual": scale_by[0], "residual_eps": scale_by[1]}
                     if scale_by is not None else {})
            layer_ops.qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, cos_sin_cache,
                                   positions, self.num_heads, self.num_kv_heads,
                                   self.head_dim, self.q_norm.eps, **cache_write, **scale)
        elif scale_by is not None:
            qkv = layer_ops.scale_rows_ref(qkv, *scale_by)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if not self.use_kernels:
            # The norms act on each head separately, before RoPE.
            q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rope
            q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        o = self.attn(q, k, v, kv_cache, attn_metadata, kv_written=kv_written)  # [T, Hq, D]
        return o.reshape(t, self.q_size)
# --8<-- [end:attention]


# --8<-- [start:mlp]
class Qwen3MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, with gate and up fused into one matmul."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.use_kernels = use_kernels
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], device, dtype,
                                   use_kernels)
        self.down_proj = Linear(inter, [config.hidden_size], device, dtype, use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter]: gate | up
        if self.use_kernels:
            return self.down_proj(layer_ops.silu_and_mul(gate_up))
        return self.down_proj(layer_ops.silu_and_mul_ref(gate_up))

    def forward_folded(self, residual: torch.Tensor, norm_eps: float) -> None:
        """`residual += mlp(norm(residual))`, the norm's weight folded into `gate_up_proj`."""
        # Where our products run (the GEMV to 16 rows, gemm_wgmma to 128 on Hopper),
        # they apply SiLU · mul in their epilogue; elsewhere this is None.
        act = self.gate_up_proj.silu_and_mul(residual, norm_eps)
        if act is None:
            gate_up = self.gate_up_proj(residual)  # rows still to be scaled by 1 / rms(residual)
            if self.use_kernels:
                act = layer_ops.silu_and_mul(gate_up, residual, norm_eps)
            else:
                act = layer_ops.silu_and_mul_ref(
                    layer_ops.scale_rows_ref(gate_up, residual, norm_eps))
        self.down_proj.add_to(act, residual)
# --8<-- [end:mlp]


# --8<-- [start:decoder_layer]
class Qwen3DecoderLayer(nn.Module):
    """Pre-norm transformer block: `h = x + attn(norm(x))`, then `h + mlp(norm(h))`.

    The residual stream is carried beside the sub-layer output rather than
    added at the end of the block, so that each "add, then normalise" is one
    step (`RMSNorm.add_norm`, one fused kernel on a GPU):

        residual ──────────┬──────────────(+)──┬─────────────(+)──► next layer
                           │                 ▲ │               ▲
        x ─(+ residual)─ norm ─► attention ──┘ norm ─► MLP ────┘
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, backend, device, dtype, use_kernels)
        self.mlp = Qwen3MLP(config, device, dtype, use_kernels)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype, use_kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype,
                                                use_kernels)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
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
            hidden_states, residual = self.input_layernorm.add_norm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm.add_norm(hidden_states, residual)
        return self.mlp(hidden_states), residual
# --8<-- [end:decoder_layer]

    # --8<-- [start:decoder_layer_folded]
    def forward_folded(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        residual: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> None:
        """The block with its two norms folded into the weights: `residual` in place.

            residual += o_proj(attention(scale(qkv_proj'(residual))))
            residual += down_proj(silu_and_mul(scale(gate_up_proj'(residual))))

        `qkv_proj'` and `gate_up_proj'` hold `W * diag(norm.weight)`; `scale`
        multiplies each row by its token's `1 / rms(residual)` inside the kernel
        after the product (q/k-norm + RoPE, SiLU), and `o_proj` and `down_proj`
        add into the residual stream themselves: no norm kernel is left.
        """
        self.self_attn.forward_folded(rope, residual, self.input_layernorm.eps, kv_cache,
                                      attn_metadata)
        self.mlp.forward_folded(residual, self.post_attention_layernorm.eps)

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """`W <- W * diag(norm.weight)` for the products after the two norms."""
        for linear, norm in ((self.self_attn.qkv_proj, self.input_layernorm),
                             (self.mlp.gate_up_proj, self.post_attention_layernorm)):
            w = linear.weight
            w.copy_((w.float() * norm.weight.float()).to(w.dtype))
    # --8<-- [end:decoder_layer_folded]


class Qwen3Model(nn.Module):
    """Embeddings, the decoder layers and the final norm (no LM head)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
        fold_norms: bool = False,
    ) -> None:
        super().__init__()
        self.use_kernels = use_kernels
        self.fold_norms = fold_norms
        self.norms_folded = False  # set by Qwen3ForCausalLM.process_weights_after_loading
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, device, dtype)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, backend, device, dtype, use_kernels)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype, use_kernels)
        # One cos/sin table shared by every layer.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, device
        )

    # --8<-- [start:model_forward]
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        if self.use_kernels:  # the kernel gathers cos/sin itself
            rope = (self.rotary_emb.cos_sin_cache, positions)
        else:
            rope = self.rotary_emb(positions, h.dtype)  # gathered once, used by every layer
        if self.fold_norms:
            if not self.norms_folded:
                raise RuntimeError("fold_norms: the norm weights are not folded into the "
                                   "weights yet; call process_weights_after_loading() after "
                                   "loading them (load_weights and init_dummy_weights do)")
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                layer.forward_folded(rope, h, kv_cache, attn_metadata)  # h: the residual
            return self.norm(h)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(rope, h, residual, kv_cache, attn_metadata)
        return self.norm.add_norm(h, residual)[0]
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
        use_kernels: run norms, RoPE and SiLU through the fused CUDA kernels
            of `mini_vllm.ops.layer_ops`, and the linear layers of steps of
            1 to 16 tokens through `mini_vllm.ops.gemv` (default: when they
            can run here).
        fold_norms: fold each decoder layer's two RMSNorm weights into the
            matrix product after it, and leave only their row scale, applied by
            the kernel after that product, so that a layer runs no norm kernel
            (chapter 9). Default: with `use_kernels`. The weights are folded
            by `process_weights_after_loading`, which the loaders call.
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
        use_kernels: bool | None = None,
        fold_norms: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        if use_kernels is None:
            use_kernels = layer_kernels_usable(config, device, dtype)
        if fold_norms is None:
            fold_norms = use_kernels
        self.model = Qwen3Model(config, attn_backend, device, dtype, use_kernels, fold_norms)
        tied = config.tie_word_embeddings
        self.lm_head = Linear(
            config.hidden_size, [config.vocab_size], "meta" if tied else device, dtype,
            use_kernels,
        )
        if tied:
            # One tensor under two names; `named_parameters()` lists it once,
            # as `model.embed_tokens.weight`, so the loader never asks for lm_head.
            self.lm_head.weight = self.model.embed_tokens.weight

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

    def process_weights_after_loading(self) -> None:
        """Fold the decoder layers' norm weights into their weights (with `fold_norms`).

        Called once, after every parameter holds its checkpoint value (the
        loaders do, and a model's weights are loaded once); folding twice would
        scale the weights twice, so a second call raises.
        """
        if not self.model.fold_norms:
            return
        if self.model.norms_folded:
            raise RuntimeError("process_weights_after_loading: the norms are already folded")
        for layer in self.model.layers:
            layer.fold_norm_weights()
        self.model.norms_folded = True

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project `[N, hidden_size]` hidden states to `[N, vocab_size]` float32 logits."""
        return self.lm_head(hidden_states).float()
# --8<-- [end:causal_lm]


__all__ = [
    "Linear",
    "Qwen3Attention",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3MLP",
    "Qwen3Model",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabEmbedding",
    "apply_rotary_emb",
]
