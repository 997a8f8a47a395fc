"""Names for full KV blocks: a hash of the block's tokens chained to its parent's.

Two requests may share a cached block only if everything before it is the
same too, because a token's K/V depends on every token before it. So the
hash of block `i` covers block `i`'s tokens *and* the hash of block `i - 1`:

```
tokens:   [t0 t1 t2 t3] [t4 t5 t6 t7] [t8 t9 ..
hash:      h0 = H(ROOT, t0..t3)
                         h1 = H(h0, t4..t7)
                                       h2 = H(h1, t8..t11)   (once the block is full)
```

Equal `h1` means equal tokens `t0..t7`, so the one hash names the whole
prefix. Only tokens go in: nothing per request (id, sampling parameters), so
any two requests with the same prefix meet on the same blocks.

Why SHA-256 and not Python's `hash(tuple)`: a cache hit hands one request
another's K/V, so a collision is a silent wrong answer, and one that a user
could aim at another user's prompt. Python's integer hash is built for dict
speed, not collision resistance (`hash(n) == n mod (2**61 - 1)`, so colliding
token tuples are easy to construct), while SHA-256 collisions are not known to
anyone. vLLM moved from `hash()` to SHA-256 for this reason. SHA-256 of one
16-token block takes a few microseconds, and each block is hashed once. The
serialization is fixed (little-endian int64 per token), so a block's hash is
the same in every process and on every machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes

# The parent of a sequence's first block.
ROOT_HASH: BlockHash = bytes(32)


# --8<-- [start:hash_block_tokens]
def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The SHA-256 of a parent block's hash followed by this block's tokens.

    Args:
        parent_hash: the previous block's hash, or `ROOT_HASH` for a first block.
        token_ids: the block's tokens (a full block).

    Returns:
        32 bytes.
    """
    h = hashlib.sha256(parent_hash)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())  # fixed layout: 8 bytes LE per token
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `token_ids` not hashed yet.

    `block_hashes` holds the hashes of the first `len(block_hashes)` blocks;
    tokens only ever get appended to a request, so those never change and
    only the newly filled blocks are hashed.

    Args:
        block_hashes: hashes computed so far; extended in place.
        token_ids: all the tokens of the sequence.
        block_size: tokens per block.
        num_tokens: hash only the blocks within the first `num_tokens` tokens
            (default: all); tokens whose values are not known yet (async
            scheduling) must not be hashed.

    Returns:
        `block_hashes`, now one hash per full block of `token_ids`.
    """
    num_full_blocks = (len(token_ids) if num_tokens is None else num_tokens) // block_size
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for i in range(len(block_hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        block_hashes.append(parent)
    return block_hashes
# --8<-- [end:hash_block_tokens]


__all__ = ["ROOT_HASH", "BlockHash", "extend_block_hashes", "hash_block_tokens"]
