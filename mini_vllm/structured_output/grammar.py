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
draft tokens, then takes back the rejected ones).
"""

from __future__ import annotations

from collections.abc import Sequence

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

    Attributes:
        vocab_size: the model's vocabulary size, the width the bitmask covers.
        num_accepted: tokens accepted so far (minus those rolled back).
    """

    def __init__(self, compiled: xgr.CompiledGrammar,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        stops = None if stop_token_ids is None else [int(t) for t in stop_token_ids]
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        """Move past one sampled token; False (and no change) if the grammar forbids it."""
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
        self._matcher.fill_next_token_bitmask(bitmask, row)

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


__all__ = ["StructuredOutputGrammar"]
