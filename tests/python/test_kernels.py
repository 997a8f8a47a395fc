"""Phase 8: CUDA kernels against their torch references.

GPU tests (marker `gpu`) run each kernel on fresh random inputs and compare
with `mini_vllm.ops.reference`; they skip, with the reason, when there is no
GPU or the module `mini_vllm._C` is not built (`bash scripts/build_kernels.sh`).
Outputs are filled with NaN before each run so unwritten elements show, and
the cache is poisoned with NaN wherever a kernel must not read (block 0, the
padding of the block tables, and the slots past each context in its last
block). The CPU tests check the wrappers' validation, the unavailability
message and the references themselves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mini_vllm import ops
from mini_vllm.ops.paged_attention import V7_HEAD_DIMS, decode_grid, heads_per_cta, v8_counters
from mini_vllm.ops.prefill import flash_prefill, flash_prefill_paged, flash_wgmma_supported
from mini_vllm.ops.reference import (
    gather_context_ref,
    paged_decode_attention_ref,
    prefill_attention_ref,
    reshape_and_cache_ref,
)

pytestmark = pytest.mark.phase8

gpu = pytest.mark.skipif(not ops.is_available(), reason=ops.unavailable_reason() or "")

BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
# (num_q_heads, num_kv_heads, head_dim): Qwen3-0.6B, Qwen3-8B, the tiny test
# model, a group of 8 at head_dim 64, a group of 5 (served one head per CTA),
# and plain multi-head attention.
HEAD_SHAPES = ((16, 8, 128), (32, 8, 128), (4, 2, 32), (16, 2, 64), (40, 8, 128), (8, 8, 64))
# The versions an engine would pick (the default among them): each is held to
# every shape, dtype and block size below.
# Version 9 copies with the TMA, which sm_90 introduced (on older GPUs
# `test_decode_every_version` checks that it says so).
HAS_TMA = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
FAST_VERSIONS = (5, 6, 7, 8, 9) if HAS_TMA else (5, 6, 7, 8)
# The versions that run v7's 16-token tensor-core tiles on a grid of CTAs per
# (KV head, split, sequence): the cp.async copy (7) and the TMA copy (9).
TILED_VERSIONS = (7, 9) if HAS_TMA else (7,)
# Our Hopper prefill kernel (csrc/flash_prefill.cu): an sm_90 GPU and a build for sm_90a.
FLASH_WGMMA = ops.is_available() and flash_wgmma_supported(
    torch.device("cuda"), torch.bfloat16, 128, 2)


def _unsupported(version: int, heads: tuple[int, int, int]) -> str | None:
    """What the wrapper says when `version` cannot serve these heads (None: it can)."""
    if version in (7, 8, 9) and heads[2] not in V7_HEAD_DIMS:
        return f"version {version} supports head_dim .* not {heads[2]}"
    if version == 9 and not HAS_TMA:
        return "version 9 needs the TMA of an sm_90 GPU"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    return 1.6e-2 if dtype == torch.bfloat16 else 4e-3


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements are NaN"
    tol = _tolerance(out.dtype)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()
    assert rel < tol / 2, f"relative error {rel:.2e}"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _paged_batch(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, gen: torch.Generator,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random paged cache holding `context_lens` tokens per sequence.

    Blocks are handed out in a random order (block 0 never), tables are padded
    with 0 plus a few extra columns, and every slot no sequence owns is NaN.
    """
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    max_blocks = max(needed, default=0) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    tables = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, (n, nb) in enumerate(zip(context_lens, needed)):
        blocks = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        for t in range(0, n, block_size):
            b = blocks[t // block_size]
            owned[b * block_size : b * block_size + min(block_size, n - t)] = True
    unowned = (~owned).to(device)
    k_cache.view(-1, num_kv_heads, head_dim)[unowned] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[unowned] = float("nan")
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables.to(device), lens


def _context_lens(batch: int, max_ctx: int, block_size: int, gen: torch.Generator) -> list[int]:
    """Random lengths in [1, max_ctx], with the edge cases around a block boundary."""
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device="cuda").tolist()
    edges = [1, block_size - 1, block_size, block_size + 1, max_ctx]
    for i, e in enumerate(edges[: batch]):
        lens[i] = max(1, min(e, max_ctx))
    return lens


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """`cache` stored head-major ([block][head][token][dim]), seen as [block, token, head, dim]."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def _run_decode(context_lens: list[int], block_size: int, heads: tuple[int, int, int],
                dtype: torch.dtype, gen: torch.Generator, head_major: bool = False,
                **kwargs: object) -> None:
    num_q_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, tables, lens = _paged_batch(context_lens, block_size, num_kv_heads,
                                                  head_dim, dtype, "cuda", gen)
    k_read, v_read = ((_head_major(k_cache), _head_major(v_cache)) if head_major
                      else (k_cache, v_cache))
    q_scale = 1.0 + 3.0 * torch.rand((), generator=gen, device="cuda").item()  # peaky and flat softmaxes
    query = (q_scale * torch.randn((len(context_lens), num_q_heads, head_dim), generator=gen,
                                   device="cuda")).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    ops.paged_decode_attention(query, k_read, v_read, tables, lens, scale,
                               max(context_lens), out=out, **kwargs)
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens, scale)
    _assert_close(out, ref)


def _gen(*key: object) -> torch.Generator:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(hash(key) % (2**31))
    return gen


# ----------------------------------------------------------------------------
# GPU: decode attention
# ----------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", FAST_VERSIONS)
@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype: torch.dtype, block_size: int,
                                  heads: tuple[int, int, int], version: int) -> None:
    gen = _gen("decode", str(dtype), block_size, heads, version)
    if why := _unsupported(version, heads):
        with pytest.raises(ValueError, match=why):
            _run_decode([5], block_size, heads, dtype, gen, version=version)
        return
    _run_decode(_context_lens(7, 3 * block_size + 5, block_size, gen), block_size, heads,
                dtype, gen, version=version)
    _run_decode(_context_lens(3, 2000, block_size, gen), block_size, heads, dtype, gen,
                version=version)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", FAST_VERSIONS)
@pytest.mark.parametrize(("batch", "max_ctx"), [(1, 1), (1, 8192), (8, 8192), (64, 1024),
                                                 (256, 2048), (256, 37)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batches_and_long_contexts(dtype: torch.dtype, batch: int, max_ctx: int,
                                          version: int) -> None:
    gen = _gen("batches", str(dtype), batch, max_ctx, version)
    lens = _context_lens(batch, max_ctx, 16, gen)
    if batch == 1:
        lens = [max_ctx]
    _run_decode(lens, 16, (16, 8, 128), dtype, gen, version=version)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", [3, 4, 5, 6, 7])
@pytest.mark.parametrize("partition_size", [16, 32, 64, 512])
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_split_k_partitions(block_size: int, partition_size: int, version: int) -> None:
    """Many splits, partitions smaller than a block, and sequences of one split."""
    gen = _gen("splits", block_size, partition_size, version)
    lens = _context_lens(9, 1500, block_size, gen)
    _run_decode(lens, block_size, (32, 8, 128), torch.bfloat16, gen,
                partition_size=partition_size, version=version)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", ops.DECODE_VERSIONS)
@pytest.mark.parametrize("heads", [(16, 8, 128), (4, 2, 32), (40, 8, 128)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_every_version(version: int, heads: tuple[int, int, int],
                              dtype: torch.dtype) -> None:
    gen = _gen("versions", version, heads, str(dtype))
    if why := _unsupported(version, heads):
        with pytest.raises(ValueError, match=why):
            _run_decode([5], 16, heads, dtype, gen, version=version)
        return
    for block_size in (16, 128):
        _run_decode(_context_lens(6, 3000, block_size, gen), block_size, heads, dtype, gen,
                    version=version)


# (version, unroll, stages): every depth built besides the defaults (version 7:
# unroll = warps per CTA).
TUNING_DEPTHS = [(4, 2, 0), (4, 8, 0), (5, 2, 0), (5, 4, 0), (6, 1, 8), (6, 2, 4), (6, 2, 6),
                 (6, 4, 2), (6, 4, 3), (6, 4, 4), (6, 4, 0), (6, 0, 4), (6, 1, 0),
                 (7, 1, 2), (7, 1, 3), (7, 1, 4), (7, 2, 2), (7, 2, 4), (7, 4, 2), (7, 4, 3),
                 (7, 2, 3), (7, 0, 2), (7, 2, 0)] + ([(9, 2, 2), (9, 2, 4), (9, 4, 2), (9, 4, 3), (9, 0, 2)] if HAS_TMA
                               else [])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("version", "unroll", "stages"), TUNING_DEPTHS)
@pytest.mark.parametrize("heads", [(16, 8, 128), (32, 8, 128)], ids=str)
def test_decode_tuning_unrolls(version: int, unroll: int, stages: int,
                               heads: tuple[int, int, int]) -> None:
    gen = _gen("unroll", version, unroll, stages, heads)
    kw = {"stages": stages} if stages else {}
    for block_size, partition_size in ((32, None), (16, 64), (256, 32), (16, 16)):
        _run_decode(_context_lens(5, 2500, block_size, gen), block_size, heads,
                    torch.bfloat16, gen, version=version, unroll=unroll,
                    partition_size=partition_size, **kw)


@pytest.mark.gpu
@gpu
def test_decode_depth_not_built_says_so() -> None:
    k_cache, v_cache, tables, lens = _paged_batch([40], 16, 8, 128, torch.bfloat16, "cuda",
                                                  _gen("not built"))
    query = torch.randn((1, 16, 128), device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="not built"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, 40, version=6,
                                   unroll=4, stages=7)
    for unroll, stages in ((3, 0), (0, 5), (8, 3)):
        with pytest.raises(ValueError, match="version 7 with .* not built"):
            ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, 40,
                                       version=7, unroll=unroll, stages=stages)
    # The tuning depths are built for bfloat16 only (the default and wide ones for both).
    with pytest.raises(ValueError, match="version 7 with 4 warps and 3 stages is not built"):
        ops.paged_decode_attention(query.half(), k_cache.half(), v_cache.half(), tables, lens,
                                   0.1, 40, version=7, unroll=4, stages=3)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="thread-block clusters need sm_90")
@pytest.mark.parametrize("cluster", [2, 8])
def test_decode_cluster_launch(cluster: int) -> None:
    gen = _gen("cluster", cluster)
    _run_decode(_context_lens(6, 3000, 16, gen), 16, (16, 8, 128), torch.bfloat16, gen,
                cluster=cluster)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", [3, 4, 5, 6, 7])
@pytest.mark.parametrize("group_per_cta", [1, 2, 4, 8])
def test_decode_heads_per_cta(group_per_cta: int, version: int) -> None:
    """Any tiling of a GQA group of 8 over CTAs gives the same result."""
    gen = _gen("group", group_per_cta, version)
    _run_decode(_context_lens(4, 1200, 16, gen), 16, (64, 8, 128), torch.bfloat16, gen,
                version=version, group_per_cta=group_per_cta)


# Version 7 serves a whole GQA group (1, 2, 4 or 8 heads) in one CTA, at both head dims.
V7_HEADS = [(8, 8, 128), (16, 8, 128), (32, 8, 128), (64, 8, 128),
            (8, 8, 64), (16, 8, 64), (32, 8, 64), (64, 8, 64)]
# Around its 16-token tiles and the blocks; the last one ends mid-block at every block size.
V7_CONTEXTS = [1, 15, 16, 17, 63, 64, 65, 1000, 8189]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", TILED_VERSIONS)
@pytest.mark.parametrize("heads", V7_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_v7_groups_and_tile_edges(dtype: torch.dtype, block_size: int,
                                         heads: tuple[int, int, int], version: int) -> None:
    """Every group and head dim; contexts that end on and around tile and block edges,
    with the partitions the wrapper picks (several splits for 8189 tokens) and with
    partitions of 32 tokens (many splits, shorter than a block from 64 up); the same
    with the pipeline a grid of many waves gets (4 warps, 2 stages)."""
    gen = _gen("v7", str(dtype), block_size, heads, version)
    assert heads_per_cta(heads[0], heads[1], version) == heads[0] // heads[1]
    _run_decode(V7_CONTEXTS, block_size, heads, dtype, gen, version=version)
    _run_decode(V7_CONTEXTS[:-1], block_size, heads, dtype, gen, version=version,
                partition_size=32)
    _run_decode(V7_CONTEXTS, block_size, heads, dtype, gen, version=version, unroll=4, stages=2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", V7_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_v7_head_major_cache(block_size: int, heads: tuple[int, int, int]) -> None:
    """Version 7 over a head-major cache (one head's rows of a block contiguous),
    passed as a [block, token, head, dim] view: tile and block edges, split-K, the
    wide ring and 256 sequences; the unowned slots stay NaN there too."""
    gen = _gen("v7 head-major", block_size, heads)
    _run_decode(V7_CONTEXTS, block_size, heads, torch.bfloat16, gen, head_major=True,
                version=7)
    _run_decode(V7_CONTEXTS[:-1], block_size, heads, torch.float16, gen, head_major=True,
                version=7, partition_size=32)
    _run_decode(V7_CONTEXTS, block_size, heads, torch.bfloat16, gen, head_major=True,
                version=7, unroll=4, stages=2)
    _run_decode(_context_lens(256, 600, block_size, gen), block_size, heads, torch.bfloat16,
                gen, head_major=True, version=7)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("batch", "max_ctx"),
                         [(1, 8192), (3, 8189), (64, 1024), (128, 8192), (256, 300)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64)], ids=str)
@pytest.mark.parametrize("version", TILED_VERSIONS)
def test_decode_v7_batches(batch: int, max_ctx: int, heads: tuple[int, int, int],
                           version: int) -> None:
    """Groups of 4 and 8 at batches of 1 to 256, one split or many; 128 x 8192 in one
    partition of 8,192 tokens, 256 sequences in a grid of many waves (the wide pipeline)."""
    gen = _gen("v7 batches", batch, max_ctx, heads, version)
    lens = ([max_ctx - 7 * i for i in range(batch)] if batch <= 3
            else _context_lens(batch, max_ctx, 32, gen))
    _run_decode(lens, 32, heads, torch.bfloat16, gen, version=version)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("version", "unroll", "stages"),
                         [(7, 0, 0), (7, 2, 4), (7, 4, 2), (8, 0, 0)]
                         + ([(9, 0, 0), (9, 2, 4), (9, 4, 2)] if HAS_TMA else []), ids=str)
def test_decode_v7_sees_the_kv_written_just_before(version: int, unroll: int,
                                                   stages: int) -> None:
    """Under programmatic launch v7 (and v8, for its first segment) fills the stages of
    its ring whose tiles end before the newest position while the kernel before it
    still runs. Here that kernel is a
    long `reshape_and_cache` (64k tokens into spare blocks) whose last blocks store
    each sequence's newest K/V into a slot that held NaN until then: attention must
    see the new values, at contexts on and around the edges of tiles and blocks, call
    after call."""
    num_q_heads, num_kv_heads, head_dim = 16, 8, 128
    block_size, dtype, spare_blocks = 16, torch.bfloat16, 4096
    gen = _gen("v7 newest", version, unroll, stages)
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 96, 97, 127, 128, 129,
            200, 1000, 4097]
    k_cache, v_cache, tables, lens_t = _paged_batch(lens, block_size, num_kv_heads, head_dim,
                                                    dtype, "cuda", gen)
    num_blocks = k_cache.shape[0]
    spare = torch.zeros((spare_blocks, *k_cache.shape[1:]), dtype=dtype, device="cuda")
    k_cache, v_cache = torch.cat([k_cache, spare]), torch.cat([v_cache, spare])
    newest = torch.tensor([n - 1 for n in lens], device="cuda")
    rows = torch.arange(len(lens), device="cuda")
    newest_slots = tables[rows, newest // block_size].long() * block_size + newest % block_size
    spare_slots = torch.arange(num_blocks * block_size, (num_blocks + spare_blocks) * block_size,
                               device="cuda")
    slots = torch.cat([spare_slots, newest_slots])  # the newest last: the last blocks store them
    kv_shape = (len(slots), num_kv_heads, head_dim)
    new_k = torch.randn(kv_shape, generator=gen, device="cuda").to(dtype)
    new_v = torch.randn(kv_shape, generator=gen, device="cuda").to(dtype)
    query = torch.randn((len(lens), num_q_heads, head_dim), generator=gen,
                        device="cuda").to(dtype)
    scale = head_dim ** -0.5
    outs = [torch.empty_like(query) for _ in range(20)]  # no kernel between the two calls
    for out in outs:
        k_cache.view(-1, num_kv_heads, head_dim)[newest_slots] = float("nan")
        v_cache.view(-1, num_kv_heads, head_dim)[newest_slots] = float("nan")
        ops.reshape_and_cache(new_k, new_v, k_cache, v_cache, slots)
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens_t, scale, max(lens),
                                   out=out, version=version, unroll=unroll, stages=stages)
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens_t, scale)
    for out in outs:
        _assert_close(out, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("batch", "max_ctx", "zeros"),
                         [(1, 8192, 0), (2, 100, 0), (5, 3000, 2), (64, 1024, 0),
                          (128, 4096, 0), (200, 2048, 17), (256, 600, 0), (700, 64, 9)])
@pytest.mark.parametrize("heads", [(16, 8, 128), (32, 8, 128), (64, 8, 64)], ids=str)
@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_decode_v8_stream_k(batch: int, max_ctx: int, zeros: int,
                            heads: tuple[int, int, int], block_size: int) -> None:
    """Version 8 cuts the batch's tiles evenly over a persistent grid, so pairs are cut
    at arbitrary tiles and merged by whichever CTA finishes last: one long sequence cut
    in many pieces, short ones wholly inside a CTA, padded slots (context 0) anywhere,
    more sequences than CTAs. Three calls in a row: the arrival counters must be back
    at zero after each."""
    gen = _gen("v8", batch, max_ctx, zeros, heads, block_size)
    lens = ([max_ctx] if batch == 1 else _context_lens(batch, max_ctx, block_size, gen))
    idle = torch.randperm(batch, generator=torch.Generator().manual_seed(batch))[:zeros]
    for i in idle.tolist():
        lens[i] = 0
    num_q_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, tables, ctx = _paged_batch([max(n, 1) for n in lens], block_size,
                                                 num_kv_heads, head_dim, torch.bfloat16,
                                                 "cuda", gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    for _ in range(3):
        query = (2 * torch.randn((batch, num_q_heads, head_dim), generator=gen,
                                 device="cuda")).to(torch.bfloat16)
        out = torch.full_like(query, float("nan"))
        ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, max(lens),
                                   out=out, version=8)
        _assert_close(out, paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx,
                                                      scale))
    counters = v8_counters(query.device, 1)
    assert int(counters.abs().sum()) == 0, "the arrival counters were not reset"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("batch", "max_ctx", "partition_size"),
                         [(3, 500, None), (40, 2000, None), (200, 2000, None), (700, 300, None),
                          (300, 1000, 128)])
@pytest.mark.parametrize("version", TILED_VERSIONS)
def test_decode_v7_seq_order(batch: int, max_ctx: int, partition_size: int | None,
                             version: int) -> None:
    """`seq_order` only changes which CTAs start first: with it (longest first, or any
    permutation), version 7's output is bit-identical to the output without it, on grids
    that fit at once (where the launcher ignores it) and on grids of several waves (200
    or 700 sequences of 8 KV heads, with or without split-K), and in a CUDA graph that
    replays with new lengths and a new order."""
    gen = _gen("order", batch, max_ctx, partition_size, version)
    lens = _context_lens(batch, max_ctx, 16, gen)
    k_cache, v_cache, tables, ctx = _paged_batch(lens, 16, 8, 128, torch.bfloat16, "cuda", gen)
    query = (2 * torch.randn((batch, 16, 128), generator=gen, device="cuda")).to(torch.bfloat16)
    kw = {"version": version, "partition_size": partition_size}

    def run(order: torch.Tensor | None) -> torch.Tensor:
        out = torch.full_like(query, float("nan"))
        ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.09, max_ctx, out=out,
                                   seq_order=order, **kw)
        return out

    plain = run(None)
    _assert_close(plain, paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, 0.09))
    longest = torch.from_numpy(ops.longest_first(ctx.cpu().numpy())).cuda()
    shuffled = torch.randperm(batch, generator=gen, device="cuda").int()
    for order in (longest, shuffled):
        assert torch.equal(run(order), plain)

    order = longest.clone()
    out = torch.empty_like(query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.09, max_ctx, out=out,
                                   seq_order=order, **kw)
    for _ in range(2):
        shorter = [int(torch.randint(1, n + 1, (), generator=gen, device="cuda")) for n in lens]
        ctx.copy_(torch.tensor(shorter, dtype=torch.int32))  # within the cache's blocks
        order.copy_(torch.from_numpy(ops.longest_first(ctx.cpu().numpy())))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, run(None))


def test_longest_first() -> None:
    """The engine's order: longest context first, ties in batch order, int32."""
    order = ops.longest_first(np.array([5, 900, 5, 17, 900, 1]))
    assert order.dtype == np.int32
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
    assert ops.longest_first(np.array([], dtype=np.int32)).tolist() == []


@pytest.mark.gpu
@gpu
def test_decode_v7_unsupported_says_so() -> None:
    gen = _gen("v7 unsupported")
    k_cache, v_cache, tables, lens = _paged_batch([40], 16, 2, 32, torch.bfloat16, "cuda", gen)
    query = torch.randn((1, 4, 32), device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="version 7 supports head_dim"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, 40, version=7)
    k_cache, v_cache, tables, lens = _paged_batch([40], 8, 8, 128, torch.bfloat16, "cuda", gen)
    query = torch.randn((1, 16, 128), device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="version 7 needs block_size >= 16, got 8"):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, 40, version=7)


@pytest.mark.gpu
@gpu
def test_decode_zero_context_and_strided_query() -> None:
    """Padded batch slots (context 0) give zeros; q may be a slice of a QKV output."""
    gen = _gen("strided")
    lens = [5, 0, 700, 0, 33]
    k_cache, v_cache, tables, ctx = _paged_batch([max(n, 1) for n in lens], 16, 8, 128,
                                                 torch.bfloat16, "cuda", gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qkv = torch.randn((5, (16 + 2 * 8) * 128), generator=gen, device="cuda").to(torch.bfloat16)
    query = qkv[:, : 16 * 128].view(5, 16, 128)  # row stride 32 * 128
    assert not query.is_contiguous()
    for version in ops.DECODE_VERSIONS:
        if version == 9 and not HAS_TMA:
            continue  # test_decode_every_version checks that it says why
        out = torch.full_like(query, float("nan"))
        ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.1, 700, out=out,
                                   version=version)
        ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, 0.1)
        _assert_close(out, ref)
        assert out[1].abs().max() == 0 and out[3].abs().max() == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", FAST_VERSIONS)
def test_decode_replays_in_a_cuda_graph(version: int) -> None:
    """Captured once with a bound on the context, replayed with other lengths."""
    gen = _gen("graph", version)
    bound = 2048
    k_cache, v_cache, tables, _ = _paged_batch([bound] * 4, 16, 8, 128, torch.bfloat16,
                                               "cuda", gen)
    query = torch.randn((4, 16, 128), generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.09, bound, out=out,
                               version=version)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.09, bound, out=out,
                                   version=version)
    for new_lens in ([2048, 1, 1000, 17], [5, 1500, 2000, 64]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        query.copy_(torch.randn((4, 16, 128), generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        _assert_close(out, paged_decode_attention_ref(query, k_cache, v_cache, tables, lens,
                                                      0.09))


# ----------------------------------------------------------------------------
# GPU: KV-cache write and gather, prefill
# ----------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [(8, 128), (2, 32), (1, 64)], ids=str)
@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32), ids=str)
def test_reshape_and_cache(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    gen = _gen("cache", str(dtype), heads)
    num_kv_heads, head_dim = heads
    num_tokens, num_blocks, block_size = 300, 40, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen, device="cuda") < 0.2] = -1
    # K and V as slices of one fused projection output, as a model makes them.
    kv = torch.randn((num_tokens, 3 * num_kv_heads * head_dim), generator=gen,
                     device="cuda").to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gather_kv_cache(block_size: int) -> None:
    gen = _gen("gather", block_size)
    lens = _context_lens(6, 1000, block_size, gen)
    k_cache, v_cache, tables, _ = _paged_batch(lens, block_size, 8, 128, torch.bfloat16,
                                                 "cuda", gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    k, v = ops.gather_kv_cache(k_cache, v_cache, tables, cu, sum(lens), max(lens))
    for i, n in enumerate(lens):
        assert torch.equal(k[cu[i] : cu[i + 1]], gather_context_ref(k_cache, tables[i], n))
        assert torch.equal(v[cu[i] : cu[i + 1]], gather_context_ref(v_cache, tables[i], n))


# (cached prefix, new tokens) per sequence.
PREFILL_BATCHES = {
    "prompts": [(0, 17), (0, 1), (0, 300), (0, 64)],
    "prefix": [(32, 17), (100, 1), (15, 300), (0, 64), (1000, 3)],
    "mixed": [(511, 1), (0, 250), (64, 64), (2047, 1)],
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ops.PREFILL_BACKENDS)
@pytest.mark.parametrize("batch", PREFILL_BATCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_attention(dtype: torch.dtype, batch: str, backend: str) -> None:
    if backend == "flash_wgmma" and not FLASH_WGMMA:
        pytest.skip("our prefill kernel needs an sm_90 GPU and a build for sm_90a")
    gen = _gen("prefill", str(dtype), batch, backend)
    seqs = PREFILL_BATCHES[batch]
    lens = [p + n for p, n in seqs]
    num_q_heads, num_kv_heads, head_dim = 16, 8, 128
    k_cache, v_cache, tables, ctx = _paged_batch(lens, 16, num_kv_heads, head_dim, dtype,
                                                 "cuda", gen)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    query = torch.randn((starts[-1], num_q_heads, head_dim), generator=gen,
                        device="cuda").to(dtype)
    # This step's K/V are the cache rows of the new positions.
    key = torch.cat([gather_context_ref(k_cache, tables[i], lens[i])[p:]
                     for i, (p, _) in enumerate(seqs)])
    value = torch.cat([gather_context_ref(v_cache, tables[i], lens[i])[p:]
                       for i, (p, _) in enumerate(seqs)])
    ref = prefill_attention_ref(query, k_cache, v_cache, tables, qsl, ctx, 0.088)
    for kv in ((None, None), (key, value)):
        out = ops.prefill_attention(query, k_cache, v_cache, tables, qsl, ctx, 0.088,
                                    query_start_loc_cpu=starts, context_lens_cpu=lens,
                                    key=kv[0], value=kv[1], backend=backend)
        _assert_close(out, ref)


# (cached prefix, new tokens) per sequence, for the Hopper kernel on its own:
# a token, a tile of 64 and one more, odd lengths, prefixes that end mid-tile,
# and sequences of thousands of tokens (many tiles of keys, the longest blocks
# of queries first).
FLASH_PREFILL_BATCHES = {
    "one token": [(0, 1)],
    "one tile": [(0, 64)],
    "a tile and one": [(0, 65)],
    "odd prompts": [(0, 5), (0, 130), (0, 1), (0, 77), (0, 300)],
    "after a prefix": [(260, 40), (0, 17), (999, 1), (63, 65)],
    "long": [(0, 2500)],
    "long after a prefix": [(3000, 700), (0, 129)],
}


def _causal_varlen_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       seqs: list[tuple[int, int]], scale: float) -> torch.Tensor:
    """Float32 attention of each sequence's new tokens over its keys, the new
    ones at the end (query j of n sees keys 0 .. prefix + j)."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    group = query.shape[1] // key.shape[1]
    q0 = k0 = 0
    for prefix, n in seqs:
        m = prefix + n
        q = query[q0 : q0 + n].float().transpose(0, 1)  # [Hq, n, D]
        k = key[k0 : k0 + m].float().repeat_interleave(group, 1).transpose(0, 1)
        v = value[k0 : k0 + m].float().repeat_interleave(group, 1).transpose(0, 1)
        seen = torch.arange(m, device=query.device)[None, :] <= (
            torch.arange(n, device=query.device) + prefix)[:, None]
        out[q0 : q0 + n] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=seen, scale=scale).transpose(0, 1)
        q0, k0 = q0 + n, k0 + m
    return out


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not FLASH_WGMMA, reason="needs an sm_90 GPU and a build for sm_90a")
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (4, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("batch", FLASH_PREFILL_BATCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_prefill(dtype: torch.dtype, batch: str, heads: tuple[int, int]) -> None:
    """Our Hopper kernel against float32 attention: every row written (the
    output starts as NaN), with a bound of the query count above the largest."""
    gen = _gen("flash_prefill", str(dtype), batch, heads)
    seqs = FLASH_PREFILL_BATCHES[batch]
    hq, hkv = heads
    total_q, total_k = sum(n for _, n in seqs), sum(p + n for p, n in seqs)
    query = torch.randn((total_q, hq, 128), generator=gen, device="cuda").to(dtype)
    key = torch.randn((total_k, hkv, 128), generator=gen, device="cuda").to(dtype)
    value = torch.randn((total_k, hkv, 128), generator=gen, device="cuda").to(dtype)
    cu_q = torch.tensor(np.cumsum([0] + [n for _, n in seqs]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + [p + n for p, n in seqs]), dtype=torch.int32,
                        device="cuda")
    max_q = max(n for _, n in seqs)
    ref = _causal_varlen_ref(query, key, value, seqs, 0.088)
    for bound in (max_q, max_q + 100):
        out = torch.full_like(query, float("nan"))
        flash_prefill(query, key, value, cu_q, cu_k, bound, 0.088, out=out)
        _assert_close(out, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not FLASH_WGMMA, reason="needs an sm_90 GPU and a build for sm_90a")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", ["after a prefix", "long after a prefix", "odd prompts"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_prefill_reads_the_paged_cache(dtype: torch.dtype, batch: str,
                                             block_size: int) -> None:
    """Our kernel over K/V read out of the cache through the block tables (the
    path of every step with a cached prefix): blocks in random order, NaN in
    every slot no sequence owns and past each context in its last block, which
    must not reach the output."""
    gen = _gen("flash_prefill_paged", str(dtype), batch, block_size)
    seqs = FLASH_PREFILL_BATCHES[batch]
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, tables, ctx = _paged_batch(lens, block_size, 8, 128, dtype, "cuda", gen)
    starts = np.cumsum([0] + [n for _, n in seqs]).tolist()
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    query = torch.randn((starts[-1], 16, 128), generator=gen, device="cuda").to(dtype)
    ref = prefill_attention_ref(query, k_cache, v_cache, tables, qsl, ctx, 0.088)
    out = ops.prefill_attention(query, k_cache, v_cache, tables, qsl, ctx, 0.088,
                                query_start_loc_cpu=starts, context_lens_cpu=lens,
                                backend="flash_wgmma")
    _assert_close(out, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not FLASH_WGMMA, reason="needs an sm_90 GPU and a build for sm_90a")
def test_flash_prefill_reads_q_k_v_out_of_one_qkv_buffer() -> None:
    """The engine's case: q, k and v are column slices of the QKV product's rows."""
    gen = _gen("flash_prefill_qkv")
    seqs = [(0, 300), (0, 5), (0, 1000)]
    total = sum(n for _, n in seqs)
    qkv = torch.randn((total, (16 + 2 * 8) * 128), generator=gen, device="cuda").to(
        torch.bfloat16)
    query = qkv[:, : 16 * 128].view(total, 16, 128)
    key = qkv[:, 16 * 128 : 24 * 128].view(total, 8, 128)
    value = qkv[:, 24 * 128 :].view(total, 8, 128)
    cu = torch.tensor(np.cumsum([0] + [n for _, n in seqs]), dtype=torch.int32, device="cuda")
    out = flash_prefill(query, key, value, cu, cu, 1000, 0.088)
    _assert_close(out, _causal_varlen_ref(query, key, value, seqs, 0.088))


# ----------------------------------------------------------------------------
# CPU: availability, validation, references
# ----------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU machine")
def test_unavailable_without_gpu_says_why() -> None:
    assert not ops.is_available()
    reason = ops.unavailable_reason()
    assert reason
    try:
        from mini_vllm import _C  # noqa: F401
    except ImportError:
        assert ops.BUILD_COMMAND in reason and "nvcc" in reason
        with pytest.raises(RuntimeError, match="scripts/build_kernels.sh"):
            ops._extension.extension()
    else:
        assert "no CUDA GPU" in reason


def _cpu_decode_args(**over: object) -> dict[str, object]:
    args: dict[str, object] = {
        "query": torch.randn(2, 16, 128, dtype=torch.bfloat16),
        "k_cache": torch.randn(4, 16, 8, 128, dtype=torch.bfloat16),
        "v_cache": torch.randn(4, 16, 8, 128, dtype=torch.bfloat16),
        "block_tables": torch.ones(2, 3, dtype=torch.int32),
        "context_lens": torch.tensor([5, 9], dtype=torch.int32),
        "scale": 0.1,
        "max_context_len": 9,
    }
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "match"), [
    ({"query": torch.randn(2, 16, 128)}, "query: dtype float32 is not supported"),
    ({"query": torch.randn(2, 128, dtype=torch.bfloat16)}, "query: expected 3 dimensions"),
    ({"query": torch.randn(2, 16, 128, dtype=torch.float16)}, "KV cache is torch.bfloat16"),
    ({"query": torch.randn(2, 16, 64, dtype=torch.bfloat16)}, "head_dim 64 != KV cache"),
    ({"query": torch.randn(2, 12, 128, dtype=torch.bfloat16)}, "multiple of num_kv_heads"),
    ({"k_cache": torch.randn(4, 16, 8, 96, dtype=torch.bfloat16),
      "v_cache": torch.randn(4, 16, 8, 96, dtype=torch.bfloat16),
      "query": torch.randn(2, 16, 96, dtype=torch.bfloat16)}, "head_dim 96 is not supported"),
    ({"k_cache": torch.randn(4, 24, 8, 128, dtype=torch.bfloat16),
      "v_cache": torch.randn(4, 24, 8, 128, dtype=torch.bfloat16)}, "power of two"),
    ({"v_cache": torch.randn(4, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2)},
     r"k_cache strides \(16384, 1024, 128, 1\) and v_cache strides .* must match"),
    ({"k_cache": torch.randn(4, 16, 128, 8, dtype=torch.bfloat16).transpose(2, 3),
      "v_cache": torch.randn(4, 16, 128, 8, dtype=torch.bfloat16).transpose(2, 3)},
     "head_dim must be the dense"),
    ({"version": 5, "k_cache": torch.randn(4, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2),
      "v_cache": torch.randn(4, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2)},
     "version 5 reads only a contiguous k_cache"),
    ({"v_cache": torch.randn(5, 16, 8, 128, dtype=torch.bfloat16)}, "must match"),
    ({"block_tables": torch.ones(2, 3, dtype=torch.int64)}, "block_tables: dtype int64"),
    ({"context_lens": torch.tensor([5], dtype=torch.int32)}, "num_seqs = 2 rows"),
    ({"out": torch.empty(2, 16, 64, dtype=torch.bfloat16)}, "out: shape"),
    ({"version": 10}, "version 10 is not one of"),
    ({"version": 9, "k_cache": torch.randn(4, 16, 2, 32, dtype=torch.bfloat16),
      "v_cache": torch.randn(4, 16, 2, 32, dtype=torch.bfloat16),
      "query": torch.randn(2, 4, 32, dtype=torch.bfloat16)}, "version 9 supports head_dim"),
    ({"version": 8, "partition_size": 64}, "version 8 takes no unroll, stages or partition_size"),
    ({"version": 8, "k_cache": torch.randn(4, 16, 2, 32, dtype=torch.bfloat16),
      "v_cache": torch.randn(4, 16, 2, 32, dtype=torch.bfloat16),
      "query": torch.randn(2, 4, 32, dtype=torch.bfloat16)}, "version 8 supports head_dim"),
    ({"version": 5, "stages": 3}, "stages applies to versions 6, 7 and 9 only"),
    ({"version": 7, "k_cache": torch.randn(4, 16, 2, 32, dtype=torch.bfloat16),
      "v_cache": torch.randn(4, 16, 2, 32, dtype=torch.bfloat16),
      "query": torch.randn(2, 4, 32, dtype=torch.bfloat16)}, "version 7 supports head_dim"),
    ({"version": 7, "k_cache": torch.randn(4, 8, 8, 128, dtype=torch.bfloat16),
      "v_cache": torch.randn(4, 8, 8, 128, dtype=torch.bfloat16)},
     "version 7 needs block_size >= 16, got 8"),
    ({"version": 7, "stages": 2}, "must be on a CUDA device"),
    ({"version": 6, "stages": -1}, "stages must be >= 0"),
    ({"partition_size": 48}, "partition_size 48 must be a power of two"),
    ({"seq_order": torch.tensor([1, 0])}, "seq_order: dtype int64"),
    ({"seq_order": torch.tensor([0], dtype=torch.int32)}, "seq_order has 1 entries, not num_seqs = 2"),
    ({}, "must be on a CUDA device"),
])
def test_decode_wrapper_validation(over: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ops.paged_decode_attention(**_cpu_decode_args(**over))


def test_cache_wrapper_validation() -> None:
    key = torch.randn(3, 8, 128, dtype=torch.bfloat16)
    cache = torch.randn(4, 16, 8, 128, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, -1])
    with pytest.raises(ValueError, match="slot_mapping: dtype int32"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="value: shape"):
        ops.reshape_and_cache(key, key[:, :4], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="KV cache is torch.bfloat16"):
        ops.reshape_and_cache(key.half(), key.half(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="2 entries for 3 tokens"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), slots)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        ops.reshape_and_cache(key.tolist(), key, cache, cache.clone(), slots)


def test_heads_per_cta_by_version() -> None:
    """Versions 5 and 6 serve at most 2 heads per CTA; 7 (and 1-4) the whole group up to 8."""
    for version, expect in ((5, (2, 2, 2, 1, 1)), (6, (2, 2, 2, 1, 1)),
                            (7, (2, 4, 8, 1, 1)), (3, (2, 4, 8, 1, 1))):
        got = tuple(heads_per_cta(q, kv, version)
                    for q, kv in ((16, 8), (32, 8), (64, 8), (40, 8), (8, 8)))
        assert got == expect, (version, got)


def test_partition_size_heuristic() -> None:
    for seqs, ctx in [(1, 1), (1, 128), (1, 8192), (64, 1024), (256, 8192), (3, 40000)]:
        size = ops.decode_partition_size(seqs, 16, 8, ctx, 132)
        assert size & (size - 1) == 0 and size <= 4096
        splits = math.ceil(ctx / size)
        grid = seqs * 8 * splits
        # The grid has two CTAs per SM, or the partitions are as small as allowed, or one
        # more halving would give a sequence more than 32 splits.
        assert grid >= 2 * 132 or size <= 64 or math.ceil(ctx / (size // 2)) > 32
        assert splits <= 32 or size == 4096
    assert ops.decode_partition_size(256, 16, 8, 8192, 132) == 4096  # no split needed
    assert ops.decode_partition_size(64, 16, 8, 1024, 132) == 1024
    assert ops.decode_partition_size(1, 16, 8, 8192, 132) == 256
    assert ops.decode_partition_size(1, 16, 8, 1024, 132) == 64
    # Version 7 keeps a full grid's 8k contexts in one partition; the others split in two.
    assert decode_grid(64, 16, 8, 8192, 132, 7) == (8192, 1)
    assert decode_grid(64, 16, 8, 8192, 132, 5) == (4096, 2)
    assert decode_grid(16, 16, 8, 8192, 132, 7) == (2048, 4)  # 128 CTAs a split: split
    assert decode_grid(1, 16, 8, 8, 132, 7) == (16, 1)  # at least one 16-token tile


def _cpu_paged(lens: list[int], block_size: int, heads: tuple[int, int, int],
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_kv_heads, head_dim = heads[1], heads[2]
    needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(needed) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros((len(lens), max(needed)), dtype=torch.int32)
    for i, nb in enumerate(needed):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def test_decode_reference_is_dense_softmax_attention() -> None:
    lens = [1, 7, 33]
    heads = (4, 2, 32)
    k_cache, v_cache, tables, ctx = _cpu_paged(lens, 4, heads)
    query = torch.randn(3, 4, 32)
    out = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, 0.3)
    for i, n in enumerate(lens):
        k = gather_context_ref(k_cache, tables[i], n)  # [n, Hkv, D]
        v = gather_context_ref(v_cache, tables[i], n)
        for h in range(4):
            w = torch.softmax(k[:, h // 2] @ query[i, h] * 0.3, dim=0)  # [n]
            torch.testing.assert_close(out[i, h], w @ v[:, h // 2])


@pytest.mark.parametrize(("shapes", "match"), [
    (((8, 3, 128), (8, 1, 128)), "query heads per KV head must be even"),
    (((8, 4, 64), (8, 2, 64)), "head_dim must be 128"),
    (((8, 4, 128), (8, 2, 64)), "differ|head_dim"),
])
def test_flash_prefill_names_what_it_does_not_take(shapes: tuple, match: str) -> None:
    """Shapes the Hopper prefill kernel does not take are refused before any launch."""
    q_shape, kv_shape = shapes
    query = torch.zeros(q_shape, dtype=torch.bfloat16)
    key = torch.zeros(kv_shape, dtype=torch.bfloat16)
    value = torch.zeros((kv_shape[0], kv_shape[1], q_shape[2]), dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        flash_prefill(query, key, value, cu, cu, 8, 0.1)
    with pytest.raises(ValueError, match="dtype float32"):
        flash_prefill(query.float(), key, value, cu, cu, 8, 0.1)
    assert ops.prefill_backend(torch.device("cpu"), torch.bfloat16, 128, 2) == "sdpa"


def test_flash_prefill_paged_names_what_it_does_not_take() -> None:
    """The paged read takes blocks of 16 to 256 tokens and tables of int32, or says so."""
    query = torch.zeros((8, 4, 128), dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    tables = torch.zeros((1, 2), dtype=torch.int32)
    small = torch.zeros((4, 8, 2, 128), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_size must be a power of two from 16 to 256"):
        flash_prefill_paged(query, small, small, tables, cu, cu, 8, 0.1)
    cache = torch.zeros((2, 16, 2, 128), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_tables: dtype int64"):
        flash_prefill_paged(query, cache, cache, tables.long(), cu, cu, 8, 0.1)
    with pytest.raises(ValueError, match="query heads per KV head must be even"):
        flash_prefill_paged(query[:, :3], cache, cache, tables, cu, cu, 8, 0.1)


@pytest.mark.parametrize("backend", ["flash_wgmma", "flash_varlen"])
def test_prefill_attention_refuses_tables_too_narrow(backend: str) -> None:
    """A path that reads the block tables refuses tables too narrow for the
    contexts, before any launch (here one block of 16 tokens for a context of 40)."""
    cache = torch.zeros((4, 16, 2, 128), dtype=torch.bfloat16)
    query = torch.zeros((4, 4, 128), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot hold a context of 40"):
        ops.prefill_attention(query, cache, cache, torch.tensor([[1]], dtype=torch.int32),
                              torch.tensor([0, 4], dtype=torch.int32),
                              torch.tensor([40], dtype=torch.int32), 0.1,
                              query_start_loc_cpu=[0, 4], context_lens_cpu=[40],
                              backend=backend)


def test_prefill_paths_agree_on_cpu() -> None:
    """The torch-only prefill path, the reference and the engine's reference agree."""
    attention = pytest.importorskip("mini_vllm.attention")
    seqs = [(0, 5), (6, 3), (9, 1)]  # (cached prefix, new tokens)
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, tables, ctx = _cpu_paged(lens, 4, (4, 2, 32))
    starts = [0, 5, 8, 9]
    qsl = torch.tensor(starts, dtype=torch.int32)
    query = torch.randn(9, 4, 32)
    ref = prefill_attention_ref(query, k_cache, v_cache, tables, qsl, ctx, 0.2)
    out = ops.prefill_attention(query, k_cache, v_cache, tables, qsl, ctx, 0.2,
                                query_start_loc_cpu=starts, context_lens_cpu=lens)
    torch.testing.assert_close(out, ref)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(9, dtype=torch.int64), query_start_loc=qsl, context_lens=ctx,
        block_tables=tables, max_query_len=5, max_context_len=max(lens),
        query_start_loc_cpu=starts, context_lens_cpu=lens)
    torch.testing.assert_close(attention.paged_attention(query, k_cache, v_cache, meta, 0.2),
                               ref, atol=1e-5, rtol=1e-5)
    # Decode rows (one new token) match the decode reference.
    last = paged_decode_attention_ref(query[[4, 7, 8]], k_cache, v_cache, tables, ctx, 0.2)
    torch.testing.assert_close(last, ref[[4, 7, 8]])


def test_cache_write_reference_skips_padding() -> None:
    attention = pytest.importorskip("mini_vllm.attention")
    key, value = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    k_cache, v_cache = torch.randn(3, 4, 2, 32), torch.randn(3, 4, 2, 32)
    k_eng, v_eng = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()
    slots = torch.tensor([5, -1, 11, 4])
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    attention.write_kv_cache(key, value, k_eng, v_eng, slots)
    assert torch.equal(k_cache, k_eng) and torch.equal(v_cache, v_eng)
    flat = k_cache.view(-1, 2, 32)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[11], key[2])
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[[4, 5, 11]] = False
    assert torch.equal(flat[untouched], before.view(-1, 2, 32)[untouched])
