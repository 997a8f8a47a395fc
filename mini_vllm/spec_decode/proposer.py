"""What a proposer is asked and what it answers.

Each step, after the scheduler has made room for them, the engine asks the
proposer for up to `num_tokens` tokens after each speculating sequence's
last token. The proposer may answer fewer (an n-gram with no match answers
none); the target verifies whatever it gets (`rejection_sampler`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from mini_vllm.sampling_metadata import SamplingRequest
from mini_vllm.sequence import Request


# --8<-- [start:proposal]
@dataclass
class ProposalRequest:
    """One sequence that speculates this step.

    Attributes:
        request: the sequence; its last token (`all_token_ids[-1]`, at
            position `num_tokens - 1`) is computed this step, and the
            proposals follow it.
        num_tokens: the most tokens to propose (the slots the scheduler
            gave it: `ScheduledRequest.num_spec_tokens`).
        block_table: its blocks, covering the proposals' positions (a
            draft model writes its own K/V there).
        sampling: its sampling parameters and generator (a draft model
            samples its proposals with them).
    """

    request: Request
    num_tokens: int
    block_table: Sequence[int]
    sampling: SamplingRequest


@dataclass
class Proposals:
    """A proposer's answer, in the order of the requests it was given.

    Attributes:
        token_ids: each sequence's proposed tokens (at most `num_tokens`,
            maybe none), or None when the proposer was not ready to propose
            for it (a draft model still computing its history): no verdict
            on the proposer, unlike an empty proposal.
        probs: `[sum of their lengths, V]` float32 on the device: the
            distribution each proposal was drawn from; None when every
            proposal is a point mass on its token (the n-gram proposer).
    """

    token_ids: list[list[int] | None]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes tokens for the target model to verify."""

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        """Up to `num_tokens` tokens after each sequence's last token."""
        ...
# --8<-- [end:proposal]


class TokenHistory:
    """A sequence's tokens as a numpy array, grown as the sequence grows.

    Converting a long history from its list every step would cost more than
    the lookup; the array is kept and only the new tokens are appended.
    """

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self._len = 0

    def update(self, token_ids: list[int]) -> np.ndarray:
        """The array of `token_ids`, which extends the tokens seen before."""
        n = len(token_ids)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len : n] = token_ids[self._len :]
        self._len = n
        return self._buf[:n]


__all__ = ["ProposalRequest", "Proposals", "Proposer", "TokenHistory"]
