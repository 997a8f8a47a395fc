"""`SpecDecodingStats`: what speculation proposed, what was kept, what it cost.

The counters follow vLLM's (`spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`) and two ratios
are derived from them:

- acceptance rate = accepted / proposed tokens;
- mean acceptance length = 1 + accepted / drafts: the tokens a verifying
  sequence gains per step, its bonus or recovered token included.

The draft's share of the time is the time spent proposing (a draft model's
forwards, or the n-gram lookup) over the wall time of the speculative steps
(from their launch to the read-back of their tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodingStats:
    """Totals since start-up (see the module docstring).

    Attributes:
        num_spec_steps: engine steps in which some sequence verified proposals.
        num_drafts: sequence-steps with at least one proposal.
        num_draft_tokens: proposed tokens.
        num_accepted_tokens: of those, accepted.
        num_accepted_tokens_per_pos: accepted tokens at each position of a run.
        draft_time_s: seconds spent proposing.
        step_time_s: seconds of the speculative steps, launch to read-back.
    """

    num_spec_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    step_time_s: float = 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verified proposals in one step."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (
                num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0.0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence gains per step (0.0 before any proposal)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def draft_time_fraction(self) -> float:
        """The proposer's share of the speculative steps' time."""
        return self.draft_time_s / self.step_time_s if self.step_time_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The engine statistics' `spec_decode_*` entries (JSON-friendly)."""
        return {
            "spec_decode_num_spec_steps": self.num_spec_steps,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_draft_time_s": self.draft_time_s,
            "spec_decode_step_time_s": self.step_time_s,
            "spec_decode_draft_time_fraction": self.draft_time_fraction,
        }


__all__ = ["SpecDecodingStats"]
