"""`BlockPool`: the KV cache's fixed-size blocks, their reference counts and free list.

The model runner allocates the K and V tensors once, as `num_blocks` blocks
of `block_size` token slots each. This pool only hands out block *ids*: the
memory is never moved, a block id is all a request needs.

Every block has a reference count: the number of running requests whose
block table holds it (more than one when requests share a cached prefix). A
block whose count drops to 0 joins the free list, but keeps its K/V and its
hash: until it is handed out again, a new request with the same prefix can
take it back. So the free list is also the eviction order:

```
free list:  head ─► [7] [3] [9] [4] ◄─ tail
                     │               └── freed last: evicted last
                     └── popped first by get_new_blocks (its hash is dropped then)
```

Block 0 is never handed out: the model runner pads block tables with 0, so
padding points at a block no request owns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mini_vllm.kv_cache.block_hash import BlockHash

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    """One block of the KV cache.

    Attributes:
        block_id: index into the cache tensors' first dimension.
        ref_cnt: running requests using this block.
        block_hash: the hash of the full block's tokens (and prefix) while it
            is in the prefix cache, else `None`.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


# --8<-- [start:block_pool]
class BlockPool:
    """Blocks with reference counts, an LRU free list and a hash -> block map.

    Args:
        num_blocks: blocks in the KV cache tensors, block 0 included
            (so `num_blocks - 1` can be handed out).
        enable_caching: keep full blocks findable by hash (prefix caching).

    Raises:
        ValueError: if `num_blocks < 2`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # The free list in eviction order (head = next to hand out). An
        # OrderedDict is a linked list with O(1) removal from the middle,
        # which `touch` needs when a free cached block gets hit.
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[NULL_BLOCK_ID + 1 :]
        )
        # Prefix cache: hash -> the block holding those tokens' K/V.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but block 0)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no running request uses (cached ones included: they can be evicted)."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by running requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block caching `block_hash`, or `None`."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free list (ref count 1 each).

        A taken block that was cached is evicted: its hash is forgotten.

        Raises:
            ValueError: if fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit).

        A hit block with no references was on the free list; it leaves it,
        so it cannot be evicted while in use.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in order; unreferenced ones join the tail.

        Blocks that join the free list together are evicted in the order
        given, so pass a request's blocks last-first: the end of a prefix
        must go before its beginning, or the cached chain would have a hole.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Enter a request's newly full blocks `[num_cached_blocks, num_full_blocks)` in the cache.

        If the same hash is already cached by another block (two requests
        computed the same prefix at once), the first block stays the cached
        one and this one is simply not findable.

        Args:
            blocks: the request's blocks, in order.
            block_hashes: the hashes of its full blocks, in order.
            num_cached_blocks: blocks of the request already entered.
            num_full_blocks: blocks of the request now full.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use stay with their requests."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
# --8<-- [end:block_pool]


__all__ = ["NULL_BLOCK_ID", "BlockPool", "KVCacheBlock"]
