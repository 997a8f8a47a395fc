"""What one scheduler step decides: `SchedulerOutput`, its `ScheduledRequest`s, and the stats.

These dataclasses are the contract between the scheduler (`scheduler.py`),
the engine and the model runner: the scheduler fills them, the others only
read them. vLLM keeps them apart from its scheduler likewise
(`vllm/v1/core/sched/output.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mini_vllm.sequence import Request


# --8<-- [start:outputs]
@dataclass
class ScheduledRequest:
    """One request's share of a step: everything the model runner needs for it.

    Attributes:
        request: the request (its `num_computed_tokens` already counts this step).
        num_new_tokens: tokens it computes in this step.
        start_pos: tokens of it already in the KV cache before this step
            (the position of its first new token).
        token_ids: the known tokens to compute,
            `request.all_token_ids[start_pos : start_pos + num_new_tokens - num_spec_tokens]`.
        block_table: its block ids after this step's allocation (a read-only
            int32 array: `KVCacheManager.allocate_slots`).
        sample: whether a token is sampled after this step: true iff the
            step computes its last token (`start_pos + num_new_tokens ==
            request.num_tokens`); false for a prompt chunk that is not the last.
        is_prefill: computes prompt tokens, or recomputes outputs after a
            preemption; false for a plain decode (the one token sampled last).
        num_spec_tokens: slots for proposed tokens after `token_ids`
            (speculative decoding): counted in `num_new_tokens`, allocated in
            `block_table`, not yet known when the step is scheduled.
    """

    request: Request
    num_new_tokens: int
    start_pos: int
    token_ids: list[int]
    block_table: np.ndarray
    sample: bool
    is_prefill: bool
    num_spec_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    """What one step computes: the contract between scheduler, engine and model runner.

    Attributes:
        scheduled: the step's requests, in a stable order (running requests
            by priority and arrival, then newly admitted ones).
        num_batched_tokens: the step's tokens in all (`<= max_num_batched_tokens`).
        num_prefill_tokens: of those, tokens of prefills (see `ScheduledRequest.is_prefill`).
        num_decode_tokens: of those, decode tokens (one per decoding request).
        preempted: ids of the requests preempted in this step (back to waiting).
        finished: ids of the requests finished or aborted since the previous
            step, whose per-request state the model runner may drop.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when nothing is computed in this step."""
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """request id -> tokens it computes in this step."""
        return {s.request_id: s.num_new_tokens for s in self.scheduled}


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler, for logs and the metrics endpoint.

    Attributes:
        num_running: requests holding KV blocks.
        num_waiting: requests waiting to be admitted (preempted ones included).
        num_preemptions: preemptions since start-up.
        kv_cache_usage: fraction of the KV blocks in use (0.0 .. 1.0).
        prefix_cache_queries: prompt tokens looked up in the prefix cache.
        prefix_cache_hits: of those, tokens found.
        prefix_cache_hit_rate: hits / queries (0.0 before any query).
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
# --8<-- [end:outputs]


__all__ = ["ScheduledRequest", "SchedulerOutput", "SchedulerStats"]
