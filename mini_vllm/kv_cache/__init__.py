"""The paged KV cache's bookkeeping: blocks, block tables and the prefix cache.

The K/V tensors themselves are allocated by the model runner; this package
decides which block of them each token of each request uses.
"""

from mini_vllm.kv_cache.block_hash import (
    ROOT_HASH,
    BlockHash,
    extend_block_hashes,
    hash_block_tokens,
)
from mini_vllm.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from mini_vllm.kv_cache.kv_cache_manager import KVCacheManager, compute_slot_mapping

__all__ = [
    "NULL_BLOCK_ID",
    "ROOT_HASH",
    "BlockHash",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "compute_slot_mapping",
    "extend_block_hashes",
    "hash_block_tokens",
]
