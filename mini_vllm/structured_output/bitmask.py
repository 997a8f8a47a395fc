"""Token bitmasks: which ids a grammar allows next, 32 ids to an int32 word.

A vocabulary of V ids needs W = ceil(V / 32) words per row; bit j of word k
says whether id 32k + j is allowed:

    word k = 0 ............................ word k = W - 1
    bit:     0  1  2 ... 31                 bits past V - 1 are never read
    id:     32k ...     32k+31

A batch's mask has one row per *constrained* request, plus the logits rows
those requests occupy; unconstrained rows are never touched. Only torch is
used here, so the sampler can import this without the grammar engine, and the
same code runs on CPU and CUDA tensors (bitwise ops and one `index_copy`).
"""

from __future__ import annotations

import math
import sys

import torch


def bitmask_width(vocab_size: int) -> int:
    """Words per row for a vocabulary of `vocab_size` ids: ceil(V / 32)."""
    return math.ceil(vocab_size / 32)


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU `[num_rows, ceil(V / 32)]` int32 bitmask with every id allowed (all bits 1)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


# --8<-- [start:unpack]
def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[R, W]` int32 words -> `[R, V]` bool, True where the id is allowed.

    Read as bytes, a little-endian word k is bytes 4k..4k+3, byte 4k + b
    holding the bits of ids 32k + 8b .. 32k + 8b + 7, lowest bit first; so
    the bytes' bits, in order, are the ids in order (and 8 shifts of a byte
    tensor move a quarter of the memory 32 shifts of the words would).
    """
    if sys.byteorder != "little":
        raise RuntimeError("unpack_bitmask reads int32 words as little-endian bytes")
    octets = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (octets.unsqueeze(-1) >> shifts) & 1  # [R, 4W, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [R, 32W] -> [R, V]
# --8<-- [end:unpack]


# --8<-- [start:apply]
def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of the ids each constrained row may not take to -inf.

    Args:
        logits: `[N, V]`, every row of the batch; not modified.
        rows: `[R]` int64, the constrained rows' indices in `logits`.
        bitmask: `[R, ceil(V / 32)]` int32, row r the mask of `logits[rows[r]]`,
            on the logits' device. V is the model's vocabulary: ids the
            tokenizer does not have (padding) are 0 bits, so never allowed.

    Returns:
        New logits; rows not in `rows` are bit-for-bit the input's.
    """
    if bitmask.shape != (rows.shape[0], bitmask_width(logits.shape[1])):
        raise ValueError(f"bitmask must be [{rows.shape[0]}, {bitmask_width(logits.shape[1])}] "
                         f"for {rows.shape[0]} rows of {logits.shape[1]} logits, "
                         f"got {list(bitmask.shape)}")
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [R, V]
    masked = logits.index_select(0, rows).masked_fill(~allowed, -math.inf)
    return logits.index_copy(0, rows, masked)
# --8<-- [end:apply]


__all__ = ["allocate_token_bitmask", "apply_token_bitmask", "bitmask_width", "unpack_bitmask"]
