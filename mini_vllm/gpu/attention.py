"""Attention on the GPU: the phase 8 kernels behind the `AttentionBackend` interface.

A step's sequences are laid out with every decode (one new token) first,
then every prompt or prompt chunk, so that each half goes to the kernel made
for it:

    tokens   | d0 d1 d2 ... d(nd-1) | p0 p0 p0 p0 | p1 p1 | ...
    attend   |  paged decode kernel |  prefill attention  |
             |  (one query per seq) |  (FlashAttention varlen, causal)

- KV write: `ops.reshape_and_cache` (slot -1 = a padded token, skipped).
- Decode: `ops.paged_decode_attention`, reading only device tensors and a
  host-side bound of the context lengths, so a CUDA graph can replay it.
- Prefill: `ops.prefill_attention`, batched over all prompts; when no prompt
  continues a cached prefix it reads this step's K/V directly.

Where a kernel cannot run (the module is not built, float32, an unsupported
head size) the same operation runs in plain torch, still batched and still
free of host synchronisation, so CUDA graphs work on every path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from mini_vllm import ops
from mini_vllm.attention import AttentionMetadata
from mini_vllm.ops.paged_attention import V7_WIDE_RING, default_decode_version

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_HEAD_DIMS = (32, 64, 128)
# --8<-- [start:wide_ring]
# Decode batches of at least this many sequences run version 7's wide ring
# (4 warps a CTA) whatever the size of their grid. The kernel's own rule
# (the wide ring from 12 CTAs per SM) was tuned on batches whose contexts are
# all the same length; an engine's are not, and then the kernel ends when its
# longest sequence does, which 4 warps read twice as fast as 2. Measured on an
# H200 with contexts of 181-2,012 tokens, longest first (chapter 9): faster
# or level from 4 sequences to 256 (up to 8 % at 64), slower at 2, whose
# partitions of 64 tokens are too short for 4 warps.
DECODE_WIDE_RING_MIN_SEQS = 4
# --8<-- [end:wide_ring]


# --8<-- [start:metadata]
@dataclass
class CudaAttentionMetadata(AttentionMetadata):
    """`AttentionMetadata` of a step whose decodes come first.

    Attributes:
        num_decodes: the first `num_decodes` sequences have one new token
            each, so they are also the first `num_decodes` tokens.
        decode_max_context_len: a host-side upper bound of those sequences'
            `context_lens` (it sizes the decode kernel's split-K grid; under a
            CUDA graph it is the graph's context bound, fixed at capture).
        prefill_query_start_loc: `[P+1] int32`, `query_start_loc` of the other
            `P` sequences, starting at 0 (None when `P == 0`).
        prefill_query_start_loc_cpu: the same as host ints.
        prefill_context_lens_cpu: their `context_lens` as host ints.
        decode_order: `[num_decodes] int32`, the decodes longest context first
            (`ops.longest_first`): the order in which the decode kernel's
            grid takes them (None: in batch order).
        split: piecewise CUDA graphs (`cuda_graphs.PiecewiseGraphRunner`): when
            set, `paged_attention` hands its arguments to it instead of
            attending, and returns what it returns.
        qkv_out: piecewise CUDA graphs: `[T, (Hq + 2 * Hkv) * D]`, where every
            layer's QKV projection writes its output (None: a new tensor).
            Attention reads q, k and v between two pieces, so a tensor of
            each layer's own would stay allocated in the graphs' memory for
            every layer and every captured size; one buffer serves them all.
    """

    num_decodes: int = 0
    decode_max_context_len: int = 0
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_query_start_loc_cpu: list[int] = field(default_factory=list)
    prefill_context_lens_cpu: list[int] = field(default_factory=list)
    decode_order: torch.Tensor | None = None
    split: AttentionSplit | None = None
    qkv_out: torch.Tensor | None = None
# --8<-- [end:metadata]


class AttentionSplit(Protocol):
    """Where a piecewise graph's forward leaves the graph to attend (see `split`)."""

    def __call__(self, backend: CudaAttentionBackend, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, scale: float, key: torch.Tensor | None,
                 value: torch.Tensor | None) -> torch.Tensor: ...


# --8<-- [start:torch_fallbacks]
def write_kv_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`reshape_and_cache` in torch, without a host sync.

    NOTE: unlike the reference `attention.write_kv_cache`, a padded token
    (slot -1) is written to slot 0, inside block 0, which the block pool never
    hands out: a fixed-shape scatter needs a destination for every row, and
    dropping rows would need their count on the host.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.clamp(min=0)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its paged context, batched, in torch.

    Every sequence gathers all `W` blocks of its table row (the padding
    blocks too) and masks keys at or past its context length:

        q [S, Hq, D],  keys [S, W * block_size, Hkv, D],  mask [S, W * block_size]
    """
    num_seqs, width = block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    k = k_cache[block_tables.long()].view(num_seqs, width * block_size, num_kv_heads, head_dim)
    v = v_cache[block_tables.long()].view(num_seqs, width * block_size, num_kv_heads, head_dim)
    keep = torch.arange(width * block_size, device=q.device) < context_lens[:, None].long()
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [S, Hq, 1, D]
        k.transpose(1, 2),  # [S, Hkv, L, D]
        v.transpose(1, 2),
        attn_mask=keep[:, None, None, :],  # [S, 1, 1, L]
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)  # [S, Hq, D]
# --8<-- [end:torch_fallbacks]


# --8<-- [start:backend]
class CudaAttentionBackend:
    """`AttentionBackend` over `mini_vllm.ops`, with batched torch fallbacks.

    Args:
        dtype: the KV cache's dtype.
        head_dim: the model's head size.
        device: where the model runs (the prefill path is chosen for it).
        use_kernels: use `mini_vllm._C`; None means when `ops.is_available()`.
        group: query heads per KV head (our Hopper prefill kernel takes an even
            group); None: not known, prefill then leaves that kernel out.

    Attributes:
        write_impl / decode_impl: `"kernel"` or `"torch"`.
        prefill_impl: `"flash_wgmma"`, `"flash_varlen"` or `"sdpa"` (see
            `ops.prefill_backend`).
    """

    name = "cuda"

    def __init__(
        self,
        dtype: torch.dtype,
        head_dim: int,
        device: torch.device | str = "cuda",
        use_kernels: bool | None = None,
        group: int | None = None,
    ) -> None:
        kernels = ops.is_available() if use_kernels is None else use_kernels
        self.write_impl = "kernel" if kernels else "torch"
        decode_ok = kernels and dtype in _KERNEL_DTYPES and head_dim in _KERNEL_HEAD_DIMS
        self.decode_impl = "kernel" if decode_ok else "torch"
        self.prefill_impl = ops.prefill_backend(torch.device(device), dtype,
                                                head_dim if kernels else None, group)

    def describe(self) -> str:
        """One line naming the implementation of each operation."""
        return (f"KV write: {self.write_impl}, decode: {self.decode_impl}, "
                f"prefill: {self.prefill_impl}")

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.write_impl == "kernel":
            ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        else:
            write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)

    # --8<-- [start:split]
    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Decodes through the decode kernel, the rest through prefill attention.

        Raises:
            ValueError: for a `sliding_window` that a context of this step exceeds:
                the kernels attend to whole contexts (the GPU runner refuses such
                a model at start, see `check_sliding_window`).
        """
        if sliding_window is not None and meta.max_context_len > sliding_window:
            raise ValueError(f"sliding_window: a context of {meta.max_context_len} tokens "
                             f"exceeds the window of {sliding_window}, which the GPU "
                             "attention kernels do not apply")
        if isinstance(meta, CudaAttentionMetadata) and meta.split is not None:
            return meta.split(self, q, k_cache, v_cache, scale, key, value)
        if not isinstance(meta, CudaAttentionMetadata):  # plain metadata: one path for all
            if meta.is_decode_only:
                return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                    scale, meta.max_context_len)
            return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                 meta.context_lens, scale, meta.query_start_loc_cpu,
                                 meta.context_lens_cpu, key, value)
        nd, num_tokens = meta.num_decodes, q.shape[0]
        if nd == num_tokens:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                scale, meta.decode_max_context_len, meta.decode_order)
        if nd == 0:
            return self._prefill(q, k_cache, v_cache, meta.block_tables,
                                 meta.prefill_query_start_loc, meta.context_lens, scale,
                                 meta.prefill_query_start_loc_cpu, meta.prefill_context_lens_cpu,
                                 key, value)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                meta.context_lens[:nd], scale, meta.decode_max_context_len,
                                meta.decode_order)
        out[nd:] = self._prefill(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_query_start_loc,
            meta.context_lens[nd:], scale, meta.prefill_query_start_loc_cpu,
            meta.prefill_context_lens_cpu,
            None if key is None else key[nd:], None if value is None else value[nd:])
        return out
    # --8<-- [end:split]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                max_context_len: int, order: torch.Tensor | None = None) -> torch.Tensor:
        if self.decode_impl == "kernel":
            ring = {}
            if (q.shape[0] >= DECODE_WIDE_RING_MIN_SEQS
                    and default_decode_version(q.shape[2], k_cache.shape[1]) == 7):
                ring = {"unroll": V7_WIDE_RING[0], "stages": V7_WIDE_RING[1]}
            return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                              scale, max_context_len, seq_order=order, **ring)
        return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, query_start_loc_cpu: list[int],
                 context_lens_cpu: list[int], key: torch.Tensor | None,
                 value: torch.Tensor | None) -> torch.Tensor:
        return ops.prefill_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
            query_start_loc_cpu=query_start_loc_cpu, context_lens_cpu=context_lens_cpu,
            key=key, value=value, backend=self.prefill_impl)
# --8<-- [end:backend]


# --8<-- [start:check_window]
def check_sliding_window(sliding_window: int | None, max_model_len: int) -> None:
    """Refuse a model whose attention window could bind on the GPU.

    The decode and prefill kernels attend to a sequence's whole context. A
    window that no sequence can outgrow (`max_model_len <= sliding_window`)
    changes nothing, so such a model runs on them exactly; a wider context
    would need the window in every kernel, which they do not have yet.

    Raises:
        ValueError: naming both lengths and the two ways around it.
    """
    if sliding_window is not None and max_model_len > sliding_window:
        raise ValueError(
            f"sliding_window: the model attends to a window of {sliding_window} tokens, "
            "which the GPU attention kernels do not apply; pass max_model_len <= "
            f"{sliding_window} (got {max_model_len}), where the window never binds, or run "
            "on the CPU")
# --8<-- [end:check_window]


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int | None = None
) -> CudaAttentionBackend | None:
    """The backend for a model on `device`: the CUDA one on a GPU, None (the reference) elsewhere.

    Logs once which implementation each operation uses, and why the kernels
    are not used when they are not.
    """
    if device.type != "cuda":
        return None
    backend = CudaAttentionBackend(dtype, head_dim, device, group=group)
    why = ops.unavailable_reason()
    if why is not None:
        logger.warning("CUDA kernels not used, torch fallbacks instead: %s", why)
    elif backend.decode_impl == "torch":
        logger.info("the decode kernel supports float16/bfloat16 and head_dim %s; "
                    "%s with head_dim %d decodes in torch", _KERNEL_HEAD_DIMS,
                    str(dtype).removeprefix("torch."), head_dim)
    logger.info("attention backend %s (%s)", backend.name, backend.describe())
    return backend


__all__ = [
    "AttentionSplit",
    "CudaAttentionBackend",
    "CudaAttentionMetadata",
    "check_sliding_window",
    "decode_attention_torch",
    "select_attention_backend",
    "write_kv_cache_torch",
]
