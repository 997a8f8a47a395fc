"""`Scheduler`: continuous batching under a token budget, with chunked prefill and preemption.

Every engine step the scheduler picks which requests run and how many of
their tokens each computes, so that the step holds at most
`max_num_batched_tokens` tokens and `max_num_seqs` requests:

- running requests first (a decode is one token; a prompt being prefilled
  in chunks takes what it still needs, up to the budget left), best priority
  first;
- then waiting requests, by (priority, arrival), each taking its prompt's
  uncached tokens, cut to the budget left (chunked prefill).

When the KV cache has no block left for a running request, the worst running
request (highest priority value, latest arrival) is preempted: its blocks are
freed and it goes back to the waiting queue, to be recomputed from its prompt
and the outputs it already has (much of which the prefix cache usually still
holds).

The engine runs the step, appends the sampled tokens to the requests and tells
the scheduler which requests finished (`finish_request`).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable

import numpy as np

from mini_vllm.config import SchedulerConfig
from mini_vllm.kv_cache import KVCacheManager
from mini_vllm.scheduler_output import ScheduledRequest, SchedulerOutput, SchedulerStats
from mini_vllm.sequence import Request, RequestStatus


class Scheduler:
    """Decides, step by step, which requests compute how many tokens.

    Args:
        scheduler_config: the step limits and `max_model_len`.
        kv_cache_manager: the block tables (and prefix cache) to allocate from.
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        # Both queues stay sorted by `_sort_key`: best priority, then earliest arrival.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Order of `add_request` calls: breaks ties between equal arrival times
        # (the `n` children of one prompt arrive together).
        self._order: dict[str, int] = {}
        self._num_added = 0
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    def _sort_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._order[request.request_id])

    # --8<-- [start:add_request]
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: see `check_request`.
        """
        self.check_request(request)
        self.requests[request.request_id] = request
        self._order[request.request_id] = self._num_added
        self._num_added += 1
        insort(self.waiting, request, key=self._sort_key)

    def check_request(self, request: Request) -> None:
        """Refuse a request that `add_request` could not queue (nothing changes).

        Raises:
            ValueError: for a duplicate id, or a request that could never
                run: its prompt leaves no room for an output token within
                `max_model_len`, or its longest possible sequence (prompt +
                `max_tokens`, at most `max_model_len`) needs more KV blocks
                than the whole cache has, so it would wait or be preempted
                forever instead of failing.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a new request")
        max_model_len = self.scheduler_config.max_model_len
        if request.num_tokens + 1 > max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {request.num_tokens} tokens, "
                f"which leaves no room for an output token within max_model_len ({max_model_len})"
            )
        kv = self.kv_cache_manager
        max_tokens = request.max_tokens
        longest = max_model_len if max_tokens is None else request.num_tokens + max_tokens
        longest = min(longest, max_model_len)
        # The last sampled token is never computed, so it needs no slot.
        if kv.num_blocks_for(longest - 1) > kv.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: up to {longest} tokens (prompt "
                f"{request.num_tokens} + max_tokens {max_tokens}) need "
                f"{kv.num_blocks_for(longest - 1)} KV blocks of {kv.block_size} tokens, but the "
                f"whole cache has {kv.num_blocks}; lower max_tokens or give the cache more memory"
            )
    # --8<-- [end:add_request]

    # --8<-- [start:schedule]
    def schedule(self) -> SchedulerOutput:
        """Plan one step: which requests compute how many tokens.

        Returns:
            The step's `SchedulerOutput` (empty when nothing can run).
        """
        # NOTE: invariants of a step.
        # 1. `running` and `waiting` are sorted by (priority, arrival, add order).
        #    Running requests are scheduled in that order, then waiting ones;
        #    a waiting request is admitted only if every waiting request before
        #    it was (no skipping ahead), and only in a step that preempted
        #    nobody (a step short of blocks has none to give a newcomer).
        # 2. The victim of a preemption is always `running[-1]`, the worst
        #    running request. It is at or after the request being scheduled,
        #    so it was not scheduled in this step: nothing is ever undone, and
        #    `num_computed_tokens` can advance as soon as a request is
        #    scheduled (as in vLLM v1). After `schedule()` returns it counts
        #    the tokens that will be in the cache once this step has run.
        # 3. Sum of `num_new_tokens` <= max_num_batched_tokens, and
        #    len(running) <= max_num_seqs.
        # 4. Full blocks enter the prefix cache when allocated, in the step
        #    that computes them; a request admitted later in the same step may
        #    already hit them (the model writes every K/V of the step before
        #    attention reads any). So the `n` children of one prompt, added
        #    in order with the same priority and arrival, share its blocks:
        #    the first child is scheduled first and the others find its
        #    prompt's full blocks in the cache.
        # 5. Slots for proposed tokens (speculative decoding) count as computed
        #    like any other; once the step is verified the engine takes the
        #    rejected ones back (`reject_tokens`), before the next schedule.
        config = self.scheduler_config
        kv = self.kv_cache_manager
        budget = config.max_num_batched_tokens
        out = SchedulerOutput(finished=self._finished_ids)
        self._finished_ids = []

        # 1. Running requests: decodes, and prompts still being prefilled in chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # --8<-- [start:skip_finished]
            if request.num_unresolved_tokens and request.has_all_output_tokens:
                # Async scheduling: the token still on the device is its last
                # (max_tokens); the engine finishes it when the value arrives.
                # A step for it would compute one more token only to drop it.
                i += 1
                continue
            # --8<-- [end:skip_finished]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                raise RuntimeError(
                    f"request {request.request_id!r} has no token to compute: the engine must "
                    "append the token sampled for it or finish it"
                )
            num_spec = self._num_spec_slots(request, num_new, budget)
            block_table = kv.allocate_slots(request, num_new + num_spec)
            if block_table is None and num_spec:  # speculation never preempts anyone
                num_spec = 0
                block_table = kv.allocate_slots(request, num_new)
            while block_table is None:  # out of blocks: preempt the worst running request
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
                block_table = kv.allocate_slots(request, num_new)
            if block_table is None:  # it preempted itself: it was the last one
                break
            self._schedule_request(out, request, num_new, block_table, num_spec)
            budget -= num_new + num_spec
            i += 1

        # 2. Waiting requests (new or preempted), best first.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < config.max_num_seqs
        ):
            request = self.waiting[0]
            # Nothing of it is in the cache yet: look for its prefix.
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not config.enable_chunked_prefill:
                break  # wait for a step with room for the whole prompt
            num_new = min(num_new, budget)
            block_table = kv.allocate_slots(request, num_new, num_hit_tokens, hit_blocks)
            if block_table is None:
                break  # no blocks: it stays first in line
            self.waiting.pop(0)
            if request.status == RequestStatus.WAITING:  # first admission
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            insort(self.running, request, key=self._sort_key)
            self._schedule_request(out, request, num_new, block_table)
            budget -= num_new
        return out
    # --8<-- [end:schedule]

    def _schedule_request(
        self, out: SchedulerOutput, request: Request, num_new: int, block_table: np.ndarray,
        num_spec: int = 0,
    ) -> None:
        """Add a request to the step and advance its `num_computed_tokens`
        (past `num_spec` proposed tokens too: `reject_tokens` takes back the rejected)."""
        start = request.num_computed_tokens
        is_prefill = start < max(request.num_prompt_tokens, request.num_tokens - 1)
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_new_tokens=num_new + num_spec,
                start_pos=start,
                token_ids=request.all_token_ids[start : start + num_new],
                block_table=block_table,
                sample=start + num_new == request.num_tokens,
                is_prefill=is_prefill,
                num_spec_tokens=num_spec,
            )
        )
        out.num_batched_tokens += num_new + num_spec
        if is_prefill:
            out.num_prefill_tokens += num_new
        else:
            out.num_decode_tokens += num_new + num_spec
        request.num_computed_tokens = start + num_new + num_spec

    # --8<-- [start:spec_slots]
    def _num_spec_slots(self, request: Request, num_new: int, budget: int) -> int:
        """Slots for proposed tokens after a decode's one known token.

        As many as the request asks for (`num_spec_tokens`), cut to the step's
        budget and to what it may still produce: a step that verifies `k`
        proposals yields at most `k + 1` tokens, which must stay within
        `max_tokens` and `max_model_len`. None while its last token is still
        on the device (async scheduling): proposing needs its value.
        """
        k = request.num_spec_tokens
        if k <= 0 or num_new != 1 or request.num_unresolved_tokens:
            return 0
        longest = self.scheduler_config.max_model_len
        if request.max_tokens is not None:
            longest = min(longest, request.num_prompt_tokens + request.max_tokens)
        return max(0, min(k, budget - 1, longest - request.num_tokens - 1))
    # --8<-- [end:spec_slots]

    # --8<-- [start:reject_tokens]
    def reject_tokens(self, request: Request, num_rejected: int) -> None:
        """Take back the cache slots of a running request's rejected proposals.

        `schedule` advanced `num_computed_tokens` past every proposed slot;
        verification kept some. The rejected ones were written to the cache
        but hold tokens that never happened: the count drops back, and every
        block past the last kept token goes back to the pool
        (`KVCacheManager.truncate`). None of them was entered in the prefix
        cache: only blocks full of known tokens are.

        Raises:
            ValueError: if `num_rejected` is negative or more than were computed.
        """
        if not 0 <= num_rejected <= request.num_computed_tokens:
            raise ValueError(f"reject_tokens: num_rejected must be in 0.."
                             f"{request.num_computed_tokens}, got {num_rejected}")
        request.num_computed_tokens -= num_rejected
        self.kv_cache_manager.truncate(request, request.num_computed_tokens)
    # --8<-- [end:reject_tokens]

    # --8<-- [start:preempt]
    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it to be recomputed.

        Its prompt and outputs stay; `num_computed_tokens` drops to 0. When it
        is admitted again it recomputes them all (minus what the prefix cache
        still holds) and samples its next token as if nothing had happened.
        It goes back among the waiting requests by (priority, arrival), ahead
        of every later arrival of its priority.
        """
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, request, key=self._sort_key)
    # --8<-- [end:preempt]

    # --8<-- [start:finish_request]
    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Remove a finished (or aborted, or failed) request and free its blocks.

        Unknown ids are ignored, so finishing twice is harmless. A request
        that failed (`FINISHED_ERROR`) may have left blocks that were entered
        in the prefix cache for a step that never completed, so the prefix
        cache is reset then.

        Raises:
            ValueError: if `status` is not a final status.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        del self._order[request_id]
        self._finished_ids.append(request_id)
        if status == RequestStatus.FINISHED_ERROR:
            self.kv_cache_manager.reset_prefix_cache()
    # --8<-- [end:finish_request]

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort waiting or running requests (unknown ids are ignored); their blocks are freed."""
        # A copy: the caller may pass a view of `self.requests`, which this changes.
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks)."""
        self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        """A snapshot of the queues, the KV cache and the prefix cache."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.queries,
            prefix_cache_hits=kv.hits,
            prefix_cache_hit_rate=kv.hit_rate,
        )


__all__ = ["Scheduler"]
