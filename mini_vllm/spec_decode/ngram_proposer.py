"""`NgramProposer`: propose what followed the last time the sequence's tail was seen.

Prompt lookup decoding: text that quotes, edits or summarises its prompt (code
edits, retrieval answers, JSON with repeated keys) often continues with a span
that already occurs in the sequence. The proposer takes the sequence's last
`n` tokens (`prompt_lookup_min <= n <= prompt_lookup_max`), finds their most
recent earlier occurrence, longest `n` first, and proposes the tokens that
followed it:

```
tokens   ... the cat sat on the mat . the cat [sat on the mat] ... | the cat
                                                                     └ tail, n = 2
earlier        the cat ──► sat on the mat          proposals: sat on the mat
```

It costs no model forward: one scan of the history on the host. Its proposals
are point masses (`Proposals.probs` is None).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import numpy as np

from mini_vllm.sequence import Request
from mini_vllm.spec_decode.proposer import ProposalRequest, Proposals, TokenHistory


# --8<-- [start:lookup]
def ngram_lookup(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed an earlier occurrence of the longest
    tail of `tokens` between `min_n` and `max_n` tokens long.

    Every earlier position holding the last token is a candidate end of a
    match; each candidate's match is extended backwards one token at a time,
    all candidates at once. Of the longest matches, the latest one that is
    followed by `num_tokens` tokens wins (a match right before the tail is
    followed by fewer: in a repeating text, the previous period):

        tokens     x a b a b a b        last token b, min_n = max_n = 2
        matches    ending at 2 and 4    (a b)
        followed   by 4 and 2 tokens    num_tokens = 3: the one ending at 2
        proposal   tokens[3:6] = a b a
    """
    length = len(tokens)
    if length <= min_n or num_tokens <= 0:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])  # candidate match ends
    if len(ends) == 0:
        return []
    match = np.ones(len(ends), dtype=np.int64)  # each candidate's match length so far
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        alive &= ends >= j
        alive &= tokens[np.maximum(ends - j, 0)] == tokens[length - 1 - j]
        if not alive.any():
            break
        match += alive
    good = np.flatnonzero(match >= min_n)
    if len(good) == 0:
        return []
    following = np.minimum(length - 1 - ends[good], num_tokens)
    best = good[np.lexsort((ends[good], following, match[good]))[-1]]  # longest, fullest, latest
    start = int(ends[best]) + 1
    return tokens[start : start + num_tokens].tolist()
# --8<-- [end:lookup]


class NgramProposer:
    """Prompt-lookup proposals (see the module docstring).

    Args:
        prompt_lookup_min: the shortest tail looked up.
        prompt_lookup_max: the longest tail looked up.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # Each sequence's history as an array, dropped with the request.
        self._history: WeakKeyDictionary[Request, TokenHistory] = WeakKeyDictionary()

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        """An n-gram lookup per sequence (see `ngram_lookup`)."""
        out = []
        for b in batch:
            history = self._history.get(b.request)
            if history is None:
                history = self._history[b.request] = TokenHistory()
            tokens = history.update(b.request.all_token_ids)
            out.append(ngram_lookup(tokens, b.num_tokens, self.min_n, self.max_n))
        return Proposals(out)


__all__ = ["NgramProposer", "ngram_lookup"]
