"""`StructuredOutputGrammar`: one request's place in its grammar.

A compiled grammar is shared (it is cached and immutable); the position in it
is per request. This wrapper over xgrammar's `GrammarMatcher` is what the
engine keeps for each constrained completion:

    step t:   fill_bitmask(bitmask, row)   which ids may come next -> the sampler masks
              the sampler draws token x    (always an allowed one)
              accept_token(x)              the matcher moves past x
    ...
              a stop token (EOS) is allowed only where is_completed(); accepting
              it terminates the matcher: is_terminated()

`rollback(n)` undoes the last n accepted tokens (speculative decoding accepts
draft tokens, then takes back the rejected ones). `fill_bitmasks` fills the
rows of a whole batch at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr


# --8<-- [start:grammar]
class StructuredOutputGrammar:
    """A matcher for one request over a shared compiled grammar.

    Args:
        compiled: from `StructuredOutputManager` (any number of requests may
            share it).
        stop_token_ids: ids that end the request (EOS, the request's stop
            token ids); the grammar allows them only where it may end. Default:
            the stop ids of the tokenizer info it was compiled with.
        vocab_size: the model's vocabulary size, the width of the bitmask rows
            this fills (default: the compiled grammar's). Columns past the
            grammar's vocabulary (padding ids) are filled with 0: never allowed.
        batch: xgrammar's multi-threaded filler, shared by the grammars of one
            manager (`fill_bitmasks` uses it for large batches).

    Attributes:
        vocab_size: the model's vocabulary size, the width the bitmask covers.
        num_accepted: tokens accepted so far (minus those rolled back).
    """

    def __init__(self, compiled: xgr.CompiledGrammar,
                 stop_token_ids: Sequence[int] | None = None, vocab_size: int | None = None,
                 batch: xgr.BatchGrammarMatcher | None = None) -> None:
        known = compiled.tokenizer_info.vocab_size  # the ids xgrammar knows
        stops = None if stop_token_ids is None else [int(t) for t in stop_token_ids
                                                     if 0 <= int(t) < known]
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.vocab_size: int = known if vocab_size is None else vocab_size
        if self.vocab_size < known:
            raise ValueError(f"vocab_size ({self.vocab_size}) is smaller than the grammar's "
                             f"vocabulary ({known})")
        self._known = known
        self._batch = batch
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        """Move past one sampled token; False (and no change) if the grammar forbids it."""
        if not 0 <= token_id < self._known:
            return False
        ok = self._matcher.accept_token(int(token_id))
        self.num_accepted += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accept all of `token_ids` or none of them (the state is restored on failure)."""
        for n, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                self.rollback(n)
                return False
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the start, the grammar accepts (state unchanged)."""
        n = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback: num_tokens must be in [0, {self.num_accepted}], "
                             f"got {num_tokens}")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into `bitmask[row]` (bit j of word k: id 32k + j).

        `bitmask` is a CPU int32 tensor `[rows, ceil(vocab_size / 32)]`. The
        matcher's state does not change.
        """
        fill_bitmasks([self], bitmask, [row])

    def is_completed(self) -> bool:
        """The output so far is a whole sentence of the grammar: a stop token is allowed now."""
        return self._matcher.is_completed()

    def is_terminated(self) -> bool:
        """A stop token was accepted: the grammar admits nothing more."""
        return self._matcher.is_terminated()

    def reset(self) -> None:
        """Back to the start of the grammar, as if no token had been accepted."""
        self._matcher.reset()
        self.num_accepted = 0
# --8<-- [end:grammar]


# A batch at least this large is filled by xgrammar's thread pool (one row per
# task); smaller ones row by row, where handing the rows out costs more.
PARALLEL_FILL_MIN_ROWS = 16


# --8<-- [start:fill_bitmasks]
def fill_bitmasks(grammars: Sequence[StructuredOutputGrammar], bitmask: torch.Tensor,
                  rows: Sequence[int] | None = None) -> None:
    """Fill `bitmask[rows[j]]` from `grammars[j]` (default rows: 0, 1, ...).

    A large batch is filled in parallel (xgrammar releases the GIL and splits
    the rows over its threads). xgrammar writes only the words of the ids it
    knows (into a scratch buffer when the model's vocabulary is wider); the
    padding past them is cleared here:

        word:  0 ... known_words - 1 | known_words ... ceil(V / 32) - 1
               xgrammar's fill       | 0 (padding ids, never allowed)
               (bits of ids >= known in the last word: cleared)
    """
    if not grammars:
        return
    rows = list(range(len(grammars))) if rows is None else list(rows)
    first = grammars[0]
    known, width = first._known, bitmask.shape[1]
    known_words = (known + 31) // 32
    if any(g._known != known or g.vocab_size != first.vocab_size for g in grammars):
        raise ValueError("fill_bitmasks: the grammars cover different vocabularies")
    if width != (first.vocab_size + 31) // 32:
        raise ValueError(f"bitmask rows must have {(first.vocab_size + 31) // 32} words, "
                         f"got {width}")
    if not bitmask.is_contiguous():
        raise ValueError("fill_bitmasks: the bitmask must be contiguous")
    # xgrammar fills contiguous rows of `known_words` words: the bitmask itself when
    # that is its width, else a scratch buffer copied into it. The rest is numpy on
    # views of the same memory: a small torch op costs more than a row's fill.
    n, first_row = len(rows), rows[0]
    padded = known_words < width
    target = torch.empty((n, known_words), dtype=torch.int32) if padded else bitmask
    where = list(range(n)) if padded else rows
    if first._batch is not None and n >= PARALLEL_FILL_MIN_ROWS:
        first._batch.batch_fill_next_token_bitmask([g._matcher for g in grammars], target, where)
    else:
        for g, row in zip(grammars, where):
            g._matcher.fill_next_token_bitmask(target, row)
    words, out = target.numpy(), bitmask.numpy()
    index = (slice(first_row, first_row + n) if rows == list(range(first_row, first_row + n))
             else rows)
    if known % 32:  # the last known word's high bits are ids past the vocabulary
        tail = np.int32((1 << (known % 32)) - 1)  # positive: the low bits only
        words[slice(None) if padded else index, known_words - 1] &= tail
    if padded:
        out[index, :known_words] = words
        out[index, known_words:] = 0
# --8<-- [end:fill_bitmasks]


__all__ = ["PARALLEL_FILL_MIN_ROWS", "StructuredOutputGrammar", "fill_bitmasks"]
