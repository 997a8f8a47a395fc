"""Phase 3: the paged KV cache.

Block-pool and manager tests are stories on tiny pools with exact block ids
(block 0 is reserved, so a pool of `num_blocks=N` hands out ids 1..N-1, in
order at first). The attention tests check that reading K/V through scattered
block tables gives what plain causal attention over contiguous tensors gives.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mini_vllm.attention import AttentionMetadata, paged_attention, write_kv_cache
from mini_vllm.kv_cache import (
    ROOT_HASH,
    BlockPool,
    KVCacheManager,
    compute_slot_mapping,
    extend_block_hashes,
    hash_block_tokens,
)
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.sequence import Request

pytestmark = pytest.mark.phase3


def make_request(request_id: str, tokens: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def compute(manager: KVCacheManager, request: Request, num_new: int) -> list[int] | None:
    """What the scheduler does for a running request: allocate, then advance."""
    table = manager.allocate_slots(request, num_new)
    if table is not None:
        request.num_computed_tokens += num_new
    return None if table is None else table.tolist()


def admit(manager: KVCacheManager, request: Request) -> tuple[list[int] | None, int]:
    """What the scheduler does for a new request: look up its prefix, allocate the rest."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    table = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks)
    if table is not None:
        request.num_computed_tokens = request.num_tokens
    return None if table is None else table.tolist(), num_hit


def free_ids(manager_or_pool: KVCacheManager | BlockPool) -> list[int]:
    pool = getattr(manager_or_pool, "block_pool", manager_or_pool)
    return list(pool.free_block_queue)


def ref_counts(manager: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in manager.block_pool.blocks if b.ref_cnt}


# ---------------------------------------------------------------- block pool


def test_block_pool_hands_out_blocks_in_order_and_frees_to_the_tail() -> None:
    pool = BlockPool(num_blocks=5)  # ids 1..4; 0 is padding
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(1)
    assert [x.block_id for x in a] == [1, 2] and [x.block_id for x in b] == [3]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.usage == pytest.approx(0.75)

    pool.free_blocks(reversed(a))  # last block first
    assert free_ids(pool) == [4, 2, 1]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [4, 2]
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block 0 is reserved"):
        BlockPool(num_blocks=1)


def test_touch_takes_a_free_cached_block_off_the_free_list() -> None:
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h1"], 0, 1)
    pool.free_blocks([block])
    assert free_ids(pool) == [2, 3, 1] and block.ref_cnt == 0
    assert pool.get_cached_block(b"h1") is block  # freed, still cached
    pool.touch([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and 1 not in free_ids(pool)


# ------------------------------------------------------------- block tables


def test_block_table_grows_across_block_boundaries() -> None:
    # Block size 4, ids 1..5. Request A: a prompt of 5 tokens, then decodes.
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, max_model_len=32)
    a = make_request("A", [10, 11, 12, 13, 14])
    assert compute(manager, a, 5) == [1, 2]  # positions 0-3 in block 1, 4 in block 2
    for token, expected in [(15, [1, 2]), (16, [1, 2]), (17, [1, 2]), (18, [1, 2, 3])]:
        a.append_output_token(token)
        assert compute(manager, a, 1) == expected
    # Position 8 (the 9th token) is the first slot of block 3.
    assert compute_slot_mapping(manager.get_block_table("A"), 8, 1, 4) == [3 * 4 + 0]

    b = make_request("B", [20, 21, 22])
    assert compute(manager, b, 3) == [4]
    assert manager.usage == pytest.approx(4 / 5)
    assert manager.get_block_table("B") == [4] and manager.get_block_table("nobody") == []

    manager.free(a)
    assert free_ids(manager) == [5, 3, 2, 1]  # A's blocks joined the tail last-first
    assert manager.get_block_table("A") == []
    assert manager.usage == pytest.approx(1 / 5)


def test_allocate_slots_hands_out_a_read_only_view_that_later_steps_leave_alone() -> None:
    """The table a step gets is an int32 array (the runner joins them as arrays); the
    next allocations append past it, so what a step was given stays what it was."""
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, max_model_len=8)
    a = make_request("A", [10, 11, 12, 13, 14])
    table = manager.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    assert table.dtype == np.int32 and not table.flags.writeable and table.tolist() == [1, 2]
    with pytest.raises(ValueError):
        table[0] = 3
    for token in range(15, 24):  # past max_model_len's two blocks: the array grows
        a.append_output_token(token)
        assert compute(manager, a, 1) is not None
    assert table.tolist() == [1, 2] and manager.get_block_table("A") == [1, 2, 3, 4]


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)  # ids 1..3
    a = make_request("A", list(range(9)))  # 3 blocks
    assert compute(manager, a, 9) == [1, 2, 3]
    b = make_request("B", [1])
    assert manager.allocate_slots(b, 1) is None
    assert manager.get_block_table("B") == [] and manager.num_free_blocks == 0
    manager.free(a)
    assert manager.allocate_slots(b, 1).tolist() == [3]  # A's last block is at the head now


def test_slot_mapping_of_a_chunk_spanning_three_blocks() -> None:
    # The docstring's picture: block table [7, 2, 5], tokens at positions 3..8.
    assert compute_slot_mapping([7, 2, 5], 3, 6, 4) == [31, 8, 9, 10, 11, 20]
    whole = [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert compute_slot_mapping([7, 2, 5], 0, 12, 4) == whole
    assert compute_slot_mapping([7], 2, 0, 4) == []
    with pytest.raises(ValueError, match="holds 12 tokens"):
        compute_slot_mapping([7, 2, 5], 10, 3, 4)


def test_manager_reports_its_size_and_maximum_concurrency() -> None:
    manager = KVCacheManager(num_blocks=101, block_size=16, max_model_len=400)
    assert manager.num_blocks == 100  # block 0 is not counted
    assert manager.max_concurrency == pytest.approx(100 * 16 / 400)  # 4 full-length requests
    assert manager.num_blocks_for(16) == 1 and manager.num_blocks_for(17) == 2


# ------------------------------------------------------------ prefix caching


def test_block_hashes_are_a_sha256_chain_over_full_blocks_only() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full blocks of 4 and one token
    hashes = extend_block_hashes([], tokens, 4)
    assert len(hashes) == 2
    want0 = hashlib.sha256(bytes(32) + struct.pack("<4q", 5, 6, 7, 8)).digest()
    want1 = hashlib.sha256(want0 + struct.pack("<4q", 9, 10, 11, 12)).digest()
    assert hashes == [want0, want1]
    assert hash_block_tokens(ROOT_HASH, [5, 6, 7, 8]) == want0
    # The same tokens after a different prefix are a different block.
    other = extend_block_hashes([], [0, 6, 7, 8, 9, 10, 11, 12], 4)
    assert other[1] != want1
    # Extending hashes only the newly full blocks and keeps the old ones.
    longer = extend_block_hashes(list(hashes), tokens + [14, 15, 16], 4)
    assert longer[:2] == hashes and len(longer) == 3


def test_prefix_hit_partial_hit_and_shared_reference_counts() -> None:
    # Block size 4, ids 1..7.
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    # A: 10 tokens -> blocks 1, 2 full (cached), block 3 holds 2 tokens.
    a = make_request("A", list(range(10)))
    assert admit(manager, a) == ([1, 2, 3], 0)
    assert (manager.queries, manager.hits) == (10, 0)

    # B shares A's first 8 tokens: it reuses blocks 1 and 2 and computes 3 tokens.
    b = make_request("B", list(range(8)) + [50, 51, 52])
    assert admit(manager, b) == ([1, 2, 4], 8)
    assert ref_counts(manager) == {1: 2, 2: 2, 3: 1, 4: 1}
    assert (manager.queries, manager.hits) == (21, 8)

    # A finishes: the shared blocks stay with B, only A's own block is freed.
    manager.free(a)
    assert ref_counts(manager) == {1: 1, 2: 1, 4: 1}
    assert free_ids(manager) == [5, 6, 7, 3]
    # B finishes: its blocks join the tail last-first (4, 2, 1), still cached.
    manager.free(b)
    assert free_ids(manager) == [5, 6, 7, 3, 4, 2, 1]

    # C shares only the first block: a partial hit takes block 1 off the free list.
    c = make_request("C", [0, 1, 2, 3, 99, 98, 97, 96, 95])
    assert admit(manager, c) == ([1, 5, 6], 4)
    assert free_ids(manager) == [7, 3, 4, 2]
    assert (manager.queries, manager.hits) == (30, 12)
    assert manager.hit_rate == pytest.approx(12 / 30)


def test_a_prompt_is_never_entirely_taken_from_the_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("A", list(range(12)))
    admit(manager, a)  # blocks 1, 2, 3 all full and cached
    # Same 8 tokens: only block 1 is reused, the last token must be computed.
    blocks, num_hit = manager.get_computed_blocks(make_request("B", list(range(8))))
    assert [b.block_id for b in blocks] == [1] and num_hit == 4
    # 9 tokens: both full blocks are reused, token 8 is computed.
    blocks, num_hit = manager.get_computed_blocks(make_request("C", list(range(9))))
    assert [b.block_id for b in blocks] == [1, 2] and num_hit == 8
    # The whole 12 tokens: blocks 1, 2 reused; the last block is recomputed.
    blocks, num_hit = manager.get_computed_blocks(make_request("D", list(range(12))))
    assert [b.block_id for b in blocks] == [1, 2] and num_hit == 8


def test_eviction_takes_the_least_recently_freed_block_and_a_chain_tail_first() -> None:
    # Block size 2, ids 1..5.
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a = make_request("A", [1, 2, 3, 4, 5, 6, 7])  # blocks 1, 2, 3 full, block 4 partial
    assert admit(manager, a) == ([1, 2, 3, 4], 0)
    manager.free(a)
    assert free_ids(manager) == [5, 4, 3, 2, 1]

    # B (unrelated, 5 tokens) needs 3 blocks: the never-cached 5, the partial 4
    # and block 3, the tail of A's chain. A's blocks 1 and 2 survive.
    b = make_request("B", [9, 9, 9, 9, 9])
    assert admit(manager, b) == ([5, 4, 3], 0)
    hits, num_hit = manager.get_computed_blocks(make_request("A2", [1, 2, 3, 4, 5, 6, 7]))
    assert [x.block_id for x in hits] == [1, 2] and num_hit == 4

    # B's blocks are freed after A's: A's are older, so they go first.
    manager.free(b)
    assert free_ids(manager) == [2, 1, 3, 4, 5]
    c = make_request("C", [8, 8, 8])
    assert admit(manager, c) == ([2, 1], 0)
    # A's chain is gone, B's two full blocks (5 then 4) are still cached.
    hits, _ = manager.get_computed_blocks(make_request("A3", [1, 2, 3, 4, 5, 6, 7]))
    assert hits == []
    hits, num_hit = manager.get_computed_blocks(make_request("B2", [9, 9, 9, 9, 9]))
    assert [x.block_id for x in hits] == [5, 4] and num_hit == 4


def test_a_hit_on_a_free_cached_block_counts_against_the_free_blocks() -> None:
    # Block size 4, ids 1..4. A computes 8 tokens: blocks 1, 2 cached, then freed.
    manager = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True)
    a = make_request("A", list(range(8)))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [3, 4, 2, 1]
    # 20 tokens: hits blocks 1, 2 (both on the free list), needs 3 new: only 2 remain.
    big = make_request("big", list(range(20)))
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    assert manager.allocate_slots(big, 12, num_hit, hits) is None
    assert free_ids(manager) == [3, 4, 2, 1] and (manager.queries, manager.hits) == (8, 0)
    # 16 tokens: hits 1, 2 and needs exactly the 2 others.
    fits = make_request("fits", list(range(16)))
    assert admit(manager, fits) == ([1, 2, 3, 4], 8)
    assert manager.num_free_blocks == 0


def test_a_preempted_request_finds_its_own_outputs_in_the_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("A", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    for token in (7, 8, 9):  # three decode steps: tokens at positions 6, 7, 8
        a.append_output_token(token)
        compute(manager, a, 1)
    assert manager.get_block_table("A") == [1, 2, 3]  # blocks 1, 2 full and cached
    manager.free(a)  # preempted: recompute from prompt + outputs
    a.num_computed_tokens = 0
    hits, num_hit = manager.get_computed_blocks(a)
    assert [x.block_id for x in hits] == [1, 2] and num_hit == 8  # outputs 7, 8 included


def test_reset_prefix_cache_forgets_hashes_but_not_running_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("A", list(range(9)))
    admit(manager, a)
    manager.reset_prefix_cache()
    hits, num_hit = manager.get_computed_blocks(make_request("B", list(range(9))))
    assert hits == [] and num_hit == 0
    assert manager.get_block_table("A") == [1, 2, 3]
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_caching_disabled_finds_nothing_and_counts_nothing() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("A", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = make_request("B", list(range(9)))
    assert admit(manager, b) == ([4, 5, 6], 0)  # the head of the free list
    assert (manager.queries, manager.hits) == (0, 0) and a.block_hashes == []


# ------------------------------------------------ paged attention vs. dense


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain causal attention over one whole sequence: q [L,Hq,D], k/v [L,Hkv,D]."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, dim=1).transpose(0, 1),
        v.repeat_interleave(rep, dim=1).transpose(0, 1),
        is_causal=True,
        scale=scale,
    )
    return out.transpose(0, 1)  # [L, Hq, D]


def _check_paged_equals_dense(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, shared_prefix_blocks: int = 0
) -> None:
    """Sequences given as (tokens already cached, new tokens); the step writes then attends.

    Each sequence's blocks are drawn at random from the pool (never block 0).
    With `shared_prefix_blocks`, sequence 1's table starts with sequence 0's
    first blocks (and its tokens there equal sequence 0's): a prefix hit on
    blocks that this very step writes.
    """
    block_size, head_dim, num_blocks = 4, 16, 64
    gen = torch.Generator().manual_seed(1234 + len(seqs))
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    scale = head_dim**-0.5

    tables, qs, ks, vs = [], [], [], []
    for i, (cached, new) in enumerate(seqs):
        length = cached + new
        num_seq_blocks = -(-length // block_size)
        q = torch.randn(length, num_heads, head_dim, generator=gen)
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        written = 0  # tokens this sequence finds in the cache before the step
        if i == 1 and shared_prefix_blocks:
            written = shared_prefix_blocks * block_size  # sequence 0 writes them in the step
            k[:written], v[:written] = ks[0][:written], vs[0][:written]
            table = tables[0][:shared_prefix_blocks]
            table += [free.pop() for _ in range(num_seq_blocks - shared_prefix_blocks)]
        else:
            table = [free.pop() for _ in range(num_seq_blocks)]
        tables.append(table)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        # Tokens of earlier steps are in the cache already.
        slots = compute_slot_mapping(table, written, cached - written, block_size)
        slots_t = torch.tensor(slots, dtype=torch.int64)
        write_kv_cache(k[written:cached], v[written:cached], k_cache, v_cache, slots_t)

    # This step: one flat batch of every sequence's new tokens.
    slot_mapping, q_new, k_new, v_new, qsl = [], [], [], [], [0]
    for (cached, new), table, q, k, v in zip(seqs, tables, qs, ks, vs):
        slot_mapping += compute_slot_mapping(table, cached, new, block_size)
        q_new.append(q[cached:])
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        qsl.append(qsl[-1] + new)
    max_blocks = max(len(t) for t in tables)
    context_lens = [cached + new for cached, new in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
        ),
        max_query_len=max(new for _, new in seqs),
        max_context_len=max(context_lens),
        query_start_loc_cpu=qsl,
        context_lens_cpu=context_lens,
    )
    write_kv_cache(torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(torch.cat(q_new), k_cache, v_cache, meta, scale)

    expected = torch.cat([
        _dense_attention(q, k, v, scale)[cached:]
        for (cached, _), q, k, v in zip(seqs, qs, ks, vs)
    ])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_paged_prefill_of_several_sequences_equals_dense(num_heads: int, num_kv_heads: int) -> None:
    _check_paged_equals_dense([(0, 7), (0, 1), (0, 13), (0, 4)], num_heads, num_kv_heads)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (8, 2)])
def test_paged_decode_equals_dense(num_heads: int, num_kv_heads: int) -> None:
    _check_paged_equals_dense([(9, 1), (4, 1), (15, 1), (1, 1)], num_heads, num_kv_heads)


def test_paged_chunked_prefill_prefix_continuation_and_decode_in_one_step_equal_dense() -> None:
    # A chunk continuing a prompt mid-block, a prefix-cache continuation from a
    # block boundary, a decode, and a fresh prompt, all in one batch.
    _check_paged_equals_dense([(6, 5), (8, 3), (11, 1), (0, 9)], num_heads=6, num_kv_heads=2)


def test_paged_attention_reads_prefix_blocks_written_in_the_same_step() -> None:
    # Sequence 0 prefills 10 tokens; sequence 1 reuses its first 2 blocks (8
    # tokens) as a prefix hit and computes 3 tokens, in the same step.
    _check_paged_equals_dense(
        [(0, 10), (8, 3)], num_heads=4, num_kv_heads=2, shared_prefix_blocks=2
    )
