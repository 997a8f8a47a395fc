"""`SpeculationPolicy`: how many tokens each sequence proposes next step.

Speculation is a bet. If each proposal is accepted with probability `a`
(independently, until the first rejection), the `j`-th proposal of a step is
used with probability `a^j`, while every proposal costs a row of the
verification and, with a draft model, a draft forward. And a speculating
sequence costs the engine its overlap of host and device: its tokens must be
read back before the next step is planned (async scheduling waits for them).

So per sequence the policy keeps an estimate of `a`, a running ratio of
accepted proposals to proposals tested (a proposal after a rejection is
never tested), decayed so that it follows the text as it changes, and sets

    k = the largest j <= num_speculative_tokens with  a^j >= MIN_GAIN

A sequence whose estimate falls so low that even `k = 1` does not pay stops
speculating, and tries again (one proposal, its estimate back at `MIN_GAIN`
worth one observation, so that one more rejection stops it again) after
`backoff` more tokens; `backoff` doubles each time it stops again, up to
`MAX_BACKOFF`. A sequence
whose proposer had nothing to propose (an n-gram with no match) counts as one
rejection: the step it speculated in bought nothing.

With `adaptive=False` every sequence proposes `num_speculative_tokens` every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from mini_vllm.sequence import Request

# The least chance of being used that keeps a proposal in the next step's run.
MIN_GAIN = 0.2
# Weight of the past in the estimate, per step.
DECAY = 0.7
# The estimate a sequence starts with: 0.4, worth one observation (a first step
# whose proposals all miss stops it; one whose proposals all pass keeps the full run).
PRIOR_ACCEPTED, PRIOR_TESTED = 0.4, 1.0
FIRST_BACKOFF, MAX_BACKOFF = 32, 512


@dataclass
class _SeqState:
    accepted: float = PRIOR_ACCEPTED  # decayed counts
    tested: float = PRIOR_TESTED
    resume_at: int | None = None  # stopped: its token count at which to try again
    backoff: int = FIRST_BACKOFF


class SpeculationPolicy:
    """Sets each sequence's `Request.num_spec_tokens` (see the module docstring).

    Args:
        num_speculative_tokens: the most tokens a sequence proposes per step.
        adaptive: False keeps `num_speculative_tokens` for every sequence.
    """

    def __init__(self, num_speculative_tokens: int, adaptive: bool = True) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive
        self._state: WeakKeyDictionary[Request, _SeqState] = WeakKeyDictionary()

    def start(self, request: Request) -> None:
        """A new sequence speculates from its first decode, with the full run; one
        with structured outputs never does (its grammar would have to follow each
        proposal before the proposal is verified)."""
        if getattr(request.sampling_params, "structured_outputs", None) is not None:
            request.num_spec_tokens = 0  # and no state: it never resumes
            return
        request.num_spec_tokens = self.num_speculative_tokens
        self._state[request] = _SeqState()

    def acceptance(self, request: Request) -> float:
        """The sequence's current estimate of `a` (the prior for an unknown one)."""
        st = self._state.get(request) or _SeqState()
        return st.accepted / st.tested

    # --8<-- [start:observe]
    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Take a verified step's result; set the sequence's next `num_spec_tokens`."""
        if not self.adaptive:
            request.num_spec_tokens = self.num_speculative_tokens
            return
        st = self._state.setdefault(request, _SeqState())
        rejected = num_accepted < num_proposed or num_proposed == 0
        st.accepted = DECAY * st.accepted + num_accepted
        st.tested = DECAY * st.tested + num_accepted + rejected
        a = st.accepted / st.tested
        k = 0 if a <= MIN_GAIN else min(self.num_speculative_tokens,
                                        int(math.log(MIN_GAIN) / math.log(a)) if a < 1 else
                                        self.num_speculative_tokens)
        if k == 0:  # not worth a step: stop for a while
            st.resume_at = request.num_tokens + st.backoff
            st.backoff = min(2 * st.backoff, MAX_BACKOFF)
        elif a >= 0.5:
            st.backoff = FIRST_BACKOFF
        request.num_spec_tokens = k
    # --8<-- [end:observe]

    # --8<-- [start:wants_values]
    def wants_values(self, request: Request) -> bool:
        """Whether the sequence speculates in its next decode, which needs this step's
        token on the host first. A stopped sequence whose pause is over is given one
        proposal to try again (its estimate back at the threshold)."""
        if request.num_spec_tokens > 0:
            return True
        st = self._state.get(request)
        if st is None or st.resume_at is None or request.num_tokens + 1 < st.resume_at:
            return False
        st.accepted, st.tested, st.resume_at = MIN_GAIN, 1.0, None
        request.num_spec_tokens = 1
        return True
    # --8<-- [end:wants_values]


__all__ = ["FIRST_BACKOFF", "MAX_BACKOFF", "MIN_GAIN", "SpeculationPolicy"]
