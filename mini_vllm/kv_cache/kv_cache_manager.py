"""`KVCacheManager`: block tables of requests, over a `BlockPool`, with prefix caching.

The scheduler talks to this class only: how many of a new request's tokens
are already cached (`get_computed_blocks`), give a request room for its next
tokens (`allocate_slots`), and give its blocks back (`free`). The model runner
turns a block table into cache slots with `compute_slot_mapping`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mini_vllm.kv_cache.block_hash import extend_block_hashes
from mini_vllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from mini_vllm.sequence import Request


# --8<-- [start:slot_mapping]
def compute_slot_mapping(
    block_table: Sequence[int], start_pos: int, num_tokens: int, block_size: int
) -> list[int]:
    """Cache slots of a sequence's tokens `start_pos .. start_pos + num_tokens - 1`.

    Token position `p` lives in block `block_table[p // block_size]`, at
    offset `p % block_size`; its slot in the cache seen as one flat list of
    token rows is `block_id * block_size + offset`:

    ```
    block_size = 4, block_table = [7, 2, 5], start_pos = 3, num_tokens = 6

    position     0  1  2  3 | 4  5  6  7 | 8  9
    block             7     |     2      |  5
    new tokens            ^   ^  ^  ^  ^   ^
    slots                31   8  9 10 11  20
    ```

    Args:
        block_table: the sequence's block ids, in order.
        start_pos: position of the first token (tokens already in the cache).
        num_tokens: tokens to place.
        block_size: tokens per block.

    Returns:
        One slot per token.

    Raises:
        ValueError: if the block table is too short for the last position.
    """
    end_pos = start_pos + num_tokens
    if end_pos > len(block_table) * block_size:
        raise ValueError(
            f"block table of {len(block_table)} blocks holds {len(block_table) * block_size} "
            f"tokens, not positions up to {end_pos - 1}"
        )
    slots: list[int] = []
    pos = start_pos
    while pos < end_pos:  # one contiguous run of slots per block touched
        first_slot = block_table[pos // block_size] * block_size + pos % block_size
        run_end = min(end_pos, (pos // block_size + 1) * block_size)
        slots.extend(range(first_slot, first_slot + run_end - pos))
        pos = run_end
    return slots
# --8<-- [end:slot_mapping]


class KVCacheManager:
    """Block tables and prefix caching for the scheduler.

    Args:
        num_blocks: blocks in the KV cache tensors (block 0 included, never used).
        block_size: tokens per block.
        enable_caching: automatic prefix caching on full blocks.
        max_model_len: the longest sequence, to report the maximum concurrency.

    Raises:
        ValueError: for a non-positive size.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int = 4096,
    ) -> None:
        if block_size <= 0 or max_model_len <= 0:
            raise ValueError(
                f"block_size ({block_size}) and max_model_len ({max_model_len}) must be positive"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, in int32 arrays kept alongside (their
        # first len(req_to_blocks[id]) entries): a step hands out a view, and the
        # model runner copies them as arrays, never an int at a time (chapter 9).
        self.req_to_block_ids: dict[str, np.ndarray] = {}
        # How many of a request's first blocks are entered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens, counted when a request is admitted.
        self.queries = 0
        self.hits = 0

    @property
    def num_blocks(self) -> int:
        """Blocks that can hold tokens (block 0 excluded)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def max_concurrency(self) -> float:
        """How many requests of `max_model_len` tokens fit in the cache at once."""
        return self.num_blocks * self.block_size / self.max_model_len

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by running requests (0.0 .. 1.0)."""
        return self.block_pool.usage

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits / queries, in tokens (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in order (a new list; empty for an unknown id)."""
        if request_id not in self.req_to_blocks:
            return []
        return self.req_to_block_ids[request_id][: len(self.req_to_blocks[request_id])].tolist()

    # --8<-- [start:get_computed_blocks]
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that has no blocks yet.

        The prefix stops one token short of the request's tokens: the last
        token must be computed so that there are logits to sample from.
        Nothing is reserved: pass the result to `allocate_slots` right away.

        Returns:
            The cached blocks, in order, and the number of tokens they hold.
        """
        if not self.enable_caching:
            return [], 0
        block_hashes = extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size,
            request.num_known_tokens,
        )
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:  # the chain is broken: nothing after it can match
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size
    # --8<-- [end:get_computed_blocks]

    # --8<-- [start:allocate_slots]
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Make room for a request's next `num_new_tokens` tokens.

        ```
        |<- num_computed_tokens ->|<- num_new_computed_tokens ->|<- num_new_tokens ->|
          already in its blocks     prefix-cache hit (admission)   computed this step
        |<------------ tokens its blocks must hold after the call ------------------>|
        ```

        The hit blocks (from `get_computed_blocks`, for a request being
        admitted) are referenced first, so allocating new blocks cannot
        evict them. Then every block that will be full once this step has
        run is entered in the prefix cache: its K/V is written in this step,
        before any request reads it (within a layer the model writes the
        whole batch's K/V before attention runs).

        Args:
            request: the request; `num_computed_tokens` not yet advanced.
            num_new_tokens: tokens to compute in this step.
            num_new_computed_tokens: tokens covered by `new_computed_blocks`.
            new_computed_blocks: prefix-cache hits of a request being admitted.

        Returns:
            The request's whole block table, a read-only int32 array (a view
            that later allocations leave as it is), or `None` (and nothing
            changed) when there are not enough free blocks.
        """
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_to_allocate = (
            self.num_blocks_for(num_tokens_after) - len(req_blocks) - len(new_computed_blocks)
        )
        if new_computed_blocks:
            # Hit blocks sitting on the free list stop being free once referenced.
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        else:
            num_evictable_hits = 0  # the usual case (every decode step): no hits to count
        if num_to_allocate > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if req_id not in self.req_to_blocks:  # admission: one prefix-cache lookup
            self.req_to_blocks[req_id] = req_blocks
            # Room for a whole max_model_len request: it never grows past that.
            self.req_to_block_ids[req_id] = np.empty(
                max(self.num_blocks_for(self.max_model_len), num_to_allocate
                    + len(new_computed_blocks)), dtype=np.int32)
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
            if self.enable_caching:
                self.queries += request.num_tokens
                self.hits += num_new_computed_tokens
        block_ids = self.req_to_block_ids[req_id]
        if new_computed_blocks or num_to_allocate > 0:
            self.block_pool.touch(new_computed_blocks)
            new_blocks = list(new_computed_blocks)
            if num_to_allocate > 0:
                new_blocks += self.block_pool.get_new_blocks(num_to_allocate)
            start = len(req_blocks)
            req_blocks.extend(new_blocks)
            if len(req_blocks) > len(block_ids):  # past max_model_len: a larger array
                grown = np.empty(2 * len(req_blocks), dtype=np.int32)
                grown[:start] = block_ids[:start]
                block_ids = self.req_to_block_ids[req_id] = grown
            block_ids[start : len(req_blocks)] = [b.block_id for b in new_blocks]

        # --8<-- [start:cache_known_blocks]
        if self.enable_caching:
            # Blocks holding a token not read back yet are entered later (their
            # hash needs the value), at the request's next allocation.
            num_full = min(num_tokens_after, request.num_known_tokens) // self.block_size
            if num_full > self.num_cached_blocks[req_id]:  # a block filled up: hash it
                block_hashes = extend_block_hashes(
                    request.block_hashes, request.all_token_ids, self.block_size,
                    request.num_known_tokens,
                )
                self.block_pool.cache_full_blocks(
                    req_blocks, block_hashes, self.num_cached_blocks[req_id], num_full
                )
                self.num_cached_blocks[req_id] = num_full
        # --8<-- [end:cache_known_blocks]
        # Only appended to later (or cut back by `truncate` once the step that
        # read it has run): a stable view.
        table = block_ids[: len(req_blocks)]
        table.flags.writeable = False
        return table
    # --8<-- [end:allocate_slots]

    # --8<-- [start:free]
    def free(self, request: Request) -> None:
        """Give back a request's blocks (finished, aborted or preempted).

        Blocks go to the free list last block first, so the end of the
        request's cached prefix is evicted before its beginning and the
        chain stays usable as long as possible.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
    # --8<-- [end:free]

    # --8<-- [start:truncate]
    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep the blocks that hold a request's first `num_tokens` tokens; free the rest.

        Speculative decoding's rollback: block size 4, 6 tokens kept of 11 written,

        ```
        positions   0 1 2 3 | 4 5 6 7 | 8 9 10
        kept        x x x x | x x . . | .  .  .
        blocks        [7]       [2]       [5]   -> block 5 goes back to the pool
        ```

        Block 2 keeps its rejected tail (slots 6, 7), which the next step
        overwrites. Blocks entered in the prefix cache hold known tokens
        only, all of them among the kept ones, so none is freed here.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        keep = self.num_blocks_for(num_tokens)
        if keep < self.num_cached_blocks[request.request_id]:
            raise ValueError(f"truncate: {request.request_id!r} would lose blocks that are in "
                             "the prefix cache")
        if keep < len(blocks):
            tail = blocks[keep:]
            del blocks[keep:]
            self.block_pool.free_blocks(reversed(tail))
    # --8<-- [end:truncate]

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (e.g. after the weights changed)."""
        self.block_pool.reset_prefix_cache()

    def reset_stats(self) -> None:
        """Zero the prefix-cache counters."""
        self.queries = self.hits = 0


__all__ = ["KVCacheManager", "compute_slot_mapping"]
