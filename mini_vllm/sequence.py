"""`Request`: one sequence the engine is generating, and its `RequestStatus`.

A request is its prompt plus the tokens sampled so far. The scheduler decides
how many of those tokens are computed in each step and advances
`num_computed_tokens`; the engine appends each sampled token with
`append_output_token`. Everything else about a request (its detokenizer, its
stop checker, its random generator) belongs to the engine.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_vllm.sampling_params import SamplingParams


# The value of an output token that was sampled on the device and not read back yet.
PLACEHOLDER_TOKEN_ID = -1


# --8<-- [start:status]
class RequestStatus(enum.IntEnum):
    """Where a request is in its life.

    ```
    WAITING ──admitted──► RUNNING ──engine finishes it──► FINISHED_*
       ▲                     │
       └──── PREEMPTED ◄─────┘ (out of KV blocks: blocks freed, recomputed later)
    ```

    Every status after `PREEMPTED` is final.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the client went away or asked to stop
    FINISHED_ERROR = enum.auto()  # the engine failed on this request

    @property
    def is_finished(self) -> bool:
        """True for the final statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` of a final status, `None` for the others."""
        return _FINISH_REASONS.get(self)
# --8<-- [end:status]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# --8<-- [start:request]
class Request:
    """One sequence: a prompt, the tokens sampled after it, and how far it is computed.

    ```
    all_token_ids:  p0 p1 p2 p3 p4 | o0 o1 o2
                    └─ prompt ────┘ └ outputs ┘       num_tokens = 8
    computed:       ██ ██ ██ ██ ██   ██ ██ ░░         num_computed_tokens = 7
    ```

    The KV cache holds the first `num_computed_tokens` tokens. A decoding
    request always has exactly one uncomputed token: the one it sampled last.

    Args:
        request_id: unique among the engine's live requests.
        prompt_token_ids: the prompt (not empty).
        sampling_params: how to sample; the scheduler reads `n` and `max_tokens`.
        arrival_time: when the request arrived (any monotonic clock); earlier
            requests go first among equal priorities.
        priority: lower values are scheduled first and preempted last.
        eos_token_ids: the model's end-of-sequence tokens, for the stop checks.
        parent_id: the id shared by the `n` child requests of one prompt
            (`None` for a request of its own).

    Raises:
        ValueError: if the prompt is empty.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        eos_token_ids: Sequence[int] = (),
        parent_id: str | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.parent_id = parent_id

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # Prompt then outputs, kept as one list so slicing the tokens to
        # compute costs nothing extra.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Tokens whose K/V are in the cache, or will be once the step the
        # scheduler just planned has run (it advances this at schedule time).
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when the request was first admitted.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Output tokens sampled on the device but not yet read back: always the
        # last ones (see `append_placeholder_token`).
        self.num_unresolved_tokens = 0
        # Hashes of the full blocks of `all_token_ids`, filled in by the
        # KV cache manager (see `kv_cache/block_hash.py`).
        self.block_hashes: list[bytes] = []
        # Speculative decoding: how many proposed tokens its next decode step
        # makes room for (the scheduler may give fewer; 0: a plain decode).
        # Proposed tokens never enter `all_token_ids` until verified.
        self.num_spec_tokens = 0
        # Prompt plus the most output tokens it may produce (asked every step).
        max_tokens = self.max_tokens
        self._max_num_tokens = (len(self.prompt_token_ids) + max_tokens if max_tokens is not None
                                else float("inf"))

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs (the live list: read it, do not change it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        """The most output tokens this request may produce (`None`: up to max_model_len)."""
        return getattr(self.sampling_params, "max_tokens", None)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token; it becomes the next token to compute."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    # --8<-- [start:placeholders]
    def append_placeholder_token(self) -> int:
        """Record that a token was sampled on the device but is not on the host yet.

        With async scheduling the engine plans the next step before the
        sampled tokens are read back: the scheduler only needs to know that
        each request has one more token, and the model runner takes the
        token's value straight from the device. `resolve_token` fills the
        value in once it arrives.

        Returns:
            The placeholder's index in `output_token_ids`.
        """
        self.append_output_token(PLACEHOLDER_TOKEN_ID)
        self.num_unresolved_tokens += 1
        return len(self.output_token_ids) - 1

    def resolve_token(self, output_index: int, token_id: int) -> None:
        """Replace the placeholder at `output_index` with the sampled token."""
        self.output_token_ids[output_index] = token_id
        self._all_token_ids[self.num_prompt_tokens + output_index] = token_id
        self.num_unresolved_tokens -= 1

    @property
    def has_all_output_tokens(self) -> bool:
        """Its output, placeholders included, is `max_tokens` long: whatever the
        values turn out to be, it finishes once they are read back."""
        return len(self._all_token_ids) >= self._max_num_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are on the host (all but the unresolved tail)."""
        return len(self._all_token_ids) - self.num_unresolved_tokens
    # --8<-- [end:placeholders]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
# --8<-- [end:request]


__all__ = ["PLACEHOLDER_TOKEN_ID", "Request", "RequestStatus"]
