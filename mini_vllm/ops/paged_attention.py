"""Paged decode attention: one new query token per sequence over its paged context.

The CUDA kernel (csrc/paged_attention/) comes in numbered versions, each a
step of chapter 8; `DEFAULT_DECODE_VERSION` is the one the engine uses.
Splitting long contexts over several CTAs (split-K) is decided here, on the
host, from the batch shape only, so a CUDA graph captured for a shape
replays correctly.
"""

from __future__ import annotations

import numpy as np
import torch

from mini_vllm.ops._checks import (
    ATTENTION_DTYPES,
    HEAD_DIMS,
    aligned_rows,
    check_kv_cache,
    check_same_device,
    check_tensor,
)
from mini_vllm.ops._extension import dtype_code, extension, num_sms

DECODE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
# Version 7 (tensor cores) where it applies, version 5 for the rest (head_dim
# 32, blocks of fewer than 16 tokens): measured on an H200, 7 is 1-3 % faster
# than 5 at every shape of chapter 8's table and 1.5x at Qwen3-8B's heads.
DEFAULT_DECODE_VERSION = 7
FALLBACK_DECODE_VERSION = 5
MIN_PARTITION_SIZE = 64
# More splits than this per sequence cost more in set-up and combine than the
# extra CTAs gain (measured: one 8k-token sequence is fastest at 32 x 256).
MAX_SPLITS_PER_SEQ = 32
MAX_PARTITION_SIZE = 4096
# Version 7 keeps an 8k context in one partition when the grid is full anyway:
# no split-K combine (measured on an H200, chapter 8: 64 x 8192 in 484 µs
# against 491 µs in two partitions of 4096).
V7_MAX_PARTITION_SIZE = 8192
# Split until the grid has this many CTAs per SM: measured on an H200, fewer
# and longer partitions win as soon as every SM has two (chapter 8).
_TARGET_CTAS_PER_SM = 2


# Versions 5 and 6 serve at most this many query heads per CTA: with 4
# (Qwen3-8B's 32/8 heads) a thread holds too many queries and accumulators,
# and two CTAs that read the same KV head (the second read mostly from L2)
# are faster.
_V5_MAX_HEADS_PER_CTA = 2
# Version 7 reads K/V in tiles of this many tokens (the N of its mma's): it
# needs block_size >= 16 and partitions that are multiples of 16 tokens.
V7_TILE_TOKENS = 16
V7_HEAD_DIMS = (64, 128)
# Version 7's wide ring, (warps, stages): what the launcher picks by itself
# for a grid of many waves, and what the engine asks for when a batch's
# contexts differ (gpu/attention.py, chapter 9).
V7_WIDE_RING = (4, 2)
# Version 8 runs version 7's tiles on a persistent grid of at most this many
# CTAs per SM (it launches as many as fit, 4 on an H200); its workspace holds
# two partial results per CTA.
V8_MAX_CTAS_PER_SM = 8
_v8_counters: dict[torch.device, torch.Tensor] = {}
_v8_retired: list[torch.Tensor] = []


def v8_counters(device: torch.device, size: int) -> torch.Tensor:
    """Version 8's per-pair arrival counters on `device`: zeros, at least `size` of them.

    The kernel leaves them zero after every launch, so one buffer serves every
    call (and every CUDA graph) on the device's streams in order. A larger
    request allocates a new buffer; the old one stays referenced, since a
    captured graph may still use it.
    """
    have = _v8_counters.get(device)
    if have is None or have.numel() < size:
        fresh = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        if have is not None:
            _v8_retired.append(have)
        _v8_counters[device] = have = fresh
    return have


# --8<-- [start:longest_first]
def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """The `seq_order` of a decode step: its sequences by context length, longest
    first (ties in batch order), as int32.

    A grid of several waves starts a CTA whenever one ends, so the CTAs it
    starts last decide how long the GPU waits on a few stragglers: with the
    longest first, they are the shortest ones (chapter 9).
    """
    return np.argsort(-np.asarray(context_lens, dtype=np.int64), kind="stable").astype(np.int32)
# --8<-- [end:longest_first]


def default_decode_version(head_dim: int, block_size: int) -> int:
    """The version the engine uses for a cache of this head size and block size."""
    if head_dim in V7_HEAD_DIMS and block_size >= V7_TILE_TOKENS:
        return DEFAULT_DECODE_VERSION
    return FALLBACK_DECODE_VERSION


def heads_per_cta(num_q_heads: int, num_kv_heads: int, version: int = DEFAULT_DECODE_VERSION,
                  ) -> int:
    """Query heads one CTA serves: the largest of 8, 4, 2, 1 dividing the GQA group
    (at most 2 in versions 5 and 6; version 7 serves a group of up to 8 in one CTA)."""
    group = num_q_heads // num_kv_heads
    limit = _V5_MAX_HEADS_PER_CTA if version in (5, 6) else 8
    return next(g for g in (8, 4, 2, 1) if group % g == 0 and g <= limit)


# --8<-- [start:partition]
def decode_partition_size(num_seqs: int, num_q_heads: int, num_kv_heads: int,
                          max_context_len: int, num_sms: int,
                          group_per_cta: int | None = None,
                          max_partition_size: int = MAX_PARTITION_SIZE) -> int:
    """Tokens per split for split-K decode (a power of two).

    Start from one split for the longest context and halve the partition while
    the grid (CTAs per split x splits) has fewer than two CTAs per SM, down to
    64 tokens and up to 32 splits per sequence: a batch of 64 x 8 KV heads
    already fills an H200 (no split), a single sequence of 1k tokens gets 16
    partitions of 64, one of 8k tokens 32 partitions of 256.

    Args:
        num_seqs: sequences in the batch.
        num_q_heads: query heads.
        num_kv_heads: KV heads.
        max_context_len: the longest context (or a bound of it).
        num_sms: multiprocessors of the GPU.
        group_per_cta: query heads per CTA; None: `heads_per_cta(...)`.
        max_partition_size: the longest partition (a power of two).

    Returns:
        The partition size in tokens.
    """
    group_per_cta = group_per_cta or heads_per_cta(num_q_heads, num_kv_heads)
    ctas_per_split = num_seqs * (num_q_heads // group_per_cta)
    longest = max(max_context_len, 1)
    size = min(max_partition_size, 1 << (longest - 1).bit_length())
    target = _TARGET_CTAS_PER_SM * num_sms
    while (size > MIN_PARTITION_SIZE and ctas_per_split * -(-longest // size) < target
           and -(-longest // (size // 2)) <= MAX_SPLITS_PER_SEQ):
        size //= 2
    return max(size, 1)
# --8<-- [end:partition]


def decode_grid(num_seqs: int, num_q_heads: int, num_kv_heads: int, max_context_len: int,
                num_sms: int, version: int, group_per_cta: int | None = None,
                ) -> tuple[int, int]:
    """The split-K grid `paged_decode_attention` launches: `(partition_size, max_splits)`.

    Versions 1 and 2 do not split (one partition of the whole bound); versions
    3-7 and 9 split by `decode_partition_size`, versions 7 and 9 in partitions of
    at least one 16-token tile and at most `V7_MAX_PARTITION_SIZE` tokens.
    """
    if version < 3:
        return max(max_context_len, 1), 1
    group_per_cta = group_per_cta or heads_per_cta(num_q_heads, num_kv_heads, version)
    tiled = version in (7, 9)
    max_size = V7_MAX_PARTITION_SIZE if tiled else MAX_PARTITION_SIZE
    size = decode_partition_size(num_seqs, num_q_heads, num_kv_heads, max_context_len, num_sms,
                                 group_per_cta, max_size)
    if tiled:  # one split of fewer than 16 tokens: a tile still spans 16
        size = max(size, V7_TILE_TOKENS)
    return size, max(1, -(-max_context_len // size))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    version: int | None = None,
    partition_size: int | None = None,
    unroll: int = 0,
    cluster: int = 0,
    group_per_cta: int | None = None,
    stages: int = 0,
    seq_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache (GQA aware).

    Args:
        query: [num_seqs, num_q_heads, head_dim], float16 or bfloat16. The
            last two dims must be dense; the first may be strided (a slice of
            a fused QKV output).
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            same dtype; block_size a power of two; head_dim 32, 64 or 128
            (versions 7-9: block_size >= 16, head_dim 64 or 128). Version 7
            also reads other layouts of these dimensions with head_dim dense,
            e.g. a head-major cache [num_blocks, num_kv_heads, block_size,
            head_dim] passed as `.transpose(1, 2)`.
        v_cache: like `k_cache`.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        context_lens: [num_seqs] int32, tokens in the cache per sequence (the
            new one included; 0 gives a zero output, for padded batch slots).
        scale: softmax scale, usually head_dim ** -0.5.
        max_context_len: an upper bound of `context_lens` (a host int); it
            sizes the split-K grid. None reads it from `context_lens` (one
            device sync). Under CUDA graphs pass the same bound (e.g.
            max_model_len) at capture and replay.
        out: optional [num_seqs, num_q_heads, head_dim] contiguous output.
        version: kernel version 1-9 (see chapter 8); None: the one the
            engine uses, `default_decode_version(head_dim, block_size)`. Version 7 does Q·Kᵀ and P·V on the
            tensor cores, one CTA per KV head for its whole GQA group; version 8
            runs the same tiles stream-K over a persistent grid (slower than
            7 on an H200, kept for comparison; no unroll, stages or
            partition_size); version 9 is version 7 with its tiles copied by
            the TMA (sm_90 and newer; as fast as 7 on an H200, not faster).
        partition_size: tokens per split (power of two, >= 16) for versions
            3-7; None picks one from the batch shape (`decode_partition_size`).
        unroll: tokens per lane per step in versions 4-6 (0: default;
            version 4 also builds 2 and 8, version 5 both 2 and 4, version 6
            1, 2 and 4, for bfloat16 / head_dim 128 only: a tuning knob);
            in versions 7 and 9, warps per CTA (0: 2; see `stages`).
        cluster: version 5 on sm_90+: run the CTAs of neighbouring KV heads
            as thread-block clusters of this size (0: off; an experiment).
        group_per_cta: query heads per CTA (1, 2, 4 or 8 dividing the GQA
            group); None: `heads_per_cta(...)` for this version.
        stages: versions 6, 7 and 9: steps in the shared-memory ring (0: the
            default). Version 6: 3 at unroll 2; built besides: unroll/stages
            1/8, 2/4, 2/6, 4/2, 4/3, 4/4 for bfloat16 / head_dim 128 and at
            most 2 query heads per CTA. Version 7: 3 stages of 16 tokens per
            warp, 2 warps; built besides: warps/stages (`unroll`/`stages`)
            1/4, 2/2, 2/4, 4/2, 4/3 for bfloat16 / head_dim 128 and 2 or 4
            query heads per CTA. Version 9: the same defaults; built
            besides: 2/2, 2/4, 4/3. Tuning knobs.
        seq_order: optional [num_seqs] int32, a permutation of the sequences:
            the order in which version 7's (or 9's) CTAs take them when its
            grid does not fit on the GPU at once (`longest_first` gives the engine's).
            A scheduling hint: the output is the same with or without it,
            and the other versions ignore it. It must hold every index once
            (not checked: that would need a device sync).

    Returns:
        `out`, [num_seqs, num_q_heads, head_dim] in the query's dtype.

    Raises:
        ValueError: on a wrong dtype, shape, layout or device, or a
            combination the chosen version does not support (named).
        RuntimeError: when the CUDA kernels are not built.
    """
    check_tensor("query", query, ndim=3, dtypes=ATTENTION_DTYPES, contiguous=False)
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache, ATTENTION_DTYPES,
                                                           any_layout=True)
    num_seqs, num_q_heads, q_head_dim = query.shape
    if k_cache.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the KV cache is {k_cache.dtype}")
    if q_head_dim != head_dim:
        raise ValueError(f"query head_dim {q_head_dim} != KV cache head_dim {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported (one of {HEAD_DIMS})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must have num_seqs = {num_seqs} rows")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(query.dtype,))
        if out.shape != query.shape:
            raise ValueError(f"out: shape {tuple(out.shape)} != query {tuple(query.shape)}")
    if version is None:
        version = default_decode_version(head_dim, block_size)
    if version not in DECODE_VERSIONS:
        raise ValueError(f"version {version} is not one of {DECODE_VERSIONS}")
    if version != 7 and not k_cache.is_contiguous():
        raise ValueError(f"version {version} reads only a contiguous k_cache / v_cache "
                         "(version 7 reads any layout with head_dim dense)")
    if stages < 0:
        raise ValueError(f"stages must be >= 0, got {stages}")
    if stages and version not in (6, 7, 9):
        raise ValueError(f"stages applies to versions 6, 7 and 9 only, not to version {version}")
    if version in (7, 8, 9):
        if head_dim not in V7_HEAD_DIMS:
            raise ValueError(f"version {version} supports head_dim {V7_HEAD_DIMS}, "
                             f"not {head_dim}")
        if block_size < V7_TILE_TOKENS:
            raise ValueError(f"version {version} needs block_size >= {V7_TILE_TOKENS}, "
                             f"got {block_size}")
    if version == 8 and (unroll or stages or partition_size is not None):
        raise ValueError("version 8 takes no unroll, stages or partition_size: it cuts the "
                         "work itself")
    if partition_size is not None and (partition_size < 16
                                       or partition_size & (partition_size - 1)):
        raise ValueError(f"partition_size {partition_size} must be a power of two >= 16")
    tensors = {"query": query, "k_cache": k_cache, "v_cache": v_cache,
               "block_tables": block_tables, "context_lens": context_lens}
    if out is not None:
        tensors["out"] = out
    if seq_order is not None:
        check_tensor("seq_order", seq_order, ndim=1, dtypes=(torch.int32,))
        if seq_order.shape[0] != num_seqs:
            raise ValueError(f"seq_order has {seq_order.shape[0]} entries, not num_seqs = "
                             f"{num_seqs}")
        tensors["seq_order"] = seq_order
    device = check_same_device(**tensors)
    ext = extension()

    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if num_seqs else 0
    if max_context_len < 0:
        raise ValueError(f"max_context_len must be >= 0, got {max_context_len}")
    query = aligned_rows(query)
    if out is None:
        out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=query.dtype, device=device)
    if num_seqs == 0:
        return out

    group_per_cta = group_per_cta or heads_per_cta(num_q_heads, num_kv_heads, version)
    counters = None
    if version == 8:
        # A persistent grid: max_splits is the CTAs the workspace holds.
        partition_size, max_splits = V7_TILE_TOKENS, V8_MAX_CTAS_PER_SM * num_sms(device)
        part_out = torch.empty((2 * max_splits, group_per_cta, head_dim), dtype=torch.float32,
                               device=device)
        part_ml = torch.empty((2 * max_splits, group_per_cta, 2), dtype=torch.float32,
                              device=device)
        counters = v8_counters(device, num_seqs * (num_q_heads // group_per_cta))
    else:
        if partition_size is None or version < 3:
            partition_size, max_splits = decode_grid(num_seqs, num_q_heads, num_kv_heads,
                                                     max_context_len, num_sms(device), version,
                                                     group_per_cta)
        else:
            max_splits = max(1, -(-max_context_len // partition_size))
        part_out = part_ml = None
        if max_splits > 1:
            part_out = torch.empty((num_seqs, num_q_heads, max_splits, head_dim),
                                   dtype=torch.float32, device=device)
            part_ml = torch.empty((num_seqs, num_q_heads, max_splits, 2),
                                  dtype=torch.float32, device=device)
    with torch.cuda.device(device):
        ext.paged_attention_decode(
            version, out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), context_lens.data_ptr(),
            0 if part_out is None else part_out.data_ptr(),
            0 if part_ml is None else part_ml.data_ptr(),
            num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
            query.stride(0), max_context_len, partition_size, max_splits, float(scale),
            dtype_code(query.dtype), torch.cuda.current_stream(device).cuda_stream, unroll,
            cluster, group_per_cta, stages, 0 if counters is None else counters.data_ptr(),
            0 if seq_order is None or version not in (7, 9) else seq_order.data_ptr(),
            k_cache.shape[0], k_cache.stride(0), k_cache.stride(2), k_cache.stride(1))
    return out
