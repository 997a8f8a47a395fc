"""The engine's speculative step: propose, verify in one forward, keep what was accepted.

A step in which some sequence was given proposal slots (`ScheduledRequest.num_spec_tokens`)
goes through here instead of the plain `_launch`:

```
schedule          room for 1 + k tokens per speculating sequence (phase 4)
propose           up to k tokens each (n-gram lookup, or k draft forwards)
verify            one target forward: [last token, d1 .. dk] of each, logits at all k + 1
rejection sample  accepted proposals + one more token, per sequence
read back         (the step's one sync) then per token: detokenize, stop checks
roll back         the rejected proposals' slots: num_computed_tokens back, blocks freed
```

Everything else in the batch (prompt chunks, sequences that do not
speculate) runs in the same forward and samples as usual (a sequence with
no proposal is a rejection sampler row with nothing to verify).

A speculative step is always read back before the next one is planned (its
number of tokens per sequence is only known then), and so is a step whose
sequences will propose next (the proposer needs the tokens' values):
`_Step.needs_values`. Sequences that do not speculate keep async scheduling's
overlap.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mini_vllm.engine.request_state import _Step
from mini_vllm.sampling_metadata import SamplingMetadata
from mini_vllm.spec_decode.metrics import SpecDecodingStats
from mini_vllm.spec_decode.ngram_proposer import NgramProposer
from mini_vllm.spec_decode.policy import SpeculationPolicy
from mini_vllm.spec_decode.proposer import ProposalRequest, Proposer
from mini_vllm.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from mini_vllm.config import EngineConfig
    from mini_vllm.engine.request_state import _Completion, _Group
    from mini_vllm.outputs import RequestOutput
    from mini_vllm.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class SpecRows:
    """What `_Step` needs to read a speculative step back, per sampling row.

    Attributes:
        num_draft_tokens: proposals verified (k of the row; 0 for a plain row).
        num_spec_slots: proposal slots the scheduler gave it (at least
            `num_draft_tokens`: a proposer may propose fewer).
        judged: whether the proposer was ready for it (the policy learns
            only from those: a draft model catching up proposes nothing).
        start_time: when the step was launched (`time.perf_counter`).
    """

    num_draft_tokens: list[int]
    num_spec_slots: list[int]
    judged: list[bool]
    start_time: float


class SpeculativeSteps:
    """`LLMEngine`'s speculative step (the engine mixes this in; see the module docstring).

    Attributes (None without a `speculative_config`):
        proposer: the n-gram or draft-model proposer.
        rejection_sampler: verifies the proposals.
        spec_policy: each sequence's number of proposals.
        spec_stats: acceptance and timing totals (`get_stats`).
    """

    proposer: Proposer | None = None
    rejection_sampler: RejectionSampler | None = None
    spec_policy: SpeculationPolicy | None = None
    spec_stats: SpecDecodingStats | None = None

    # --8<-- [start:init]
    def _init_speculative(self, config: EngineConfig) -> None:
        """Build the proposer (a draft model gets a runner and a cache of the target's
        block count), the rejection sampler, the policy and the statistics."""
        spec = config.speculative_config
        if spec is None:
            return
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            from mini_vllm.engine.llm_engine import make_model_runner
            from mini_vllm.spec_decode.draft_model import DraftModelProposer, draft_engine_config

            runner = make_model_runner(draft_engine_config(config, self.model_runner.num_blocks))
            self.proposer = DraftModelProposer(
                runner, self.sampler, config.scheduler_config.max_num_batched_tokens,
                self.eos_token_ids)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.spec_policy = SpeculationPolicy(spec.num_speculative_tokens, spec.adaptive)
        self.spec_stats = SpecDecodingStats()
        logger.info("speculative decoding: %s, up to %d tokens per step%s", spec.method,
                    spec.num_speculative_tokens, "" if spec.adaptive else " (fixed)")
    # --8<-- [end:init]

    def _speculates(self, sched: SchedulerOutput) -> bool:
        return self.spec_policy is not None and any(s.num_spec_tokens for s in sched.scheduled)

    def _wants_values(self, rows: list[tuple[_Group, _Completion]]) -> bool:
        """Whether a sequence of this step speculates in its next: then the step must be
        read back before the next is planned."""
        policy = self.spec_policy
        if policy is None:
            return False
        wants = [policy.wants_values(c.request) for _, c in rows]  # each row: it may resume
        return any(wants)

    # --8<-- [start:launch_spec]
    def _launch_spec(self, sched: SchedulerOutput, prev: _Step | None = None,
                     before_sampling: Callable[[], None] | None = None
                     ) -> _Step | list[RequestOutput]:
        """Propose, verify and rejection-sample a step (see the module docstring).

        `before_sampling` as for `_launch`: called once the verifying forward is
        queued (rows that do not speculate may need the previous step's tokens).
        """
        start = time.perf_counter()
        entries = self._batch_entries(sched, prev)
        rows = [(i, *self._children[s.request_id]) for i, s in enumerate(sched.scheduled)
                if s.sample]
        try:
            spec = [i for i, s in enumerate(sched.scheduled) if s.num_spec_tokens]
            proposals = self.proposer.propose([
                ProposalRequest(sched.scheduled[i].request, sched.scheduled[i].num_spec_tokens,
                                sched.scheduled[i].block_table,
                                self._sampling_request(self._children[sched.scheduled[i]
                                                                      .request_id][1]))
                for i in spec])
            self.spec_stats.draft_time_s += time.perf_counter() - start
            unready = {i for i, d in zip(spec, proposals.token_ids) if d is None}
            drafts = {i: d for i, d in zip(spec, proposals.token_ids) if d}
            for i, d in drafts.items():  # the last known token, then its proposals
                if d:
                    entries[i] = dataclasses.replace(
                        entries[i], token_ids=[*entries[i].token_ids, *d], num_logits=1 + len(d))
            logits = self.model_runner.execute(  # [sum(1 + k), V]
                entries, prev.sampled if prev is not None else None)
            if before_sampling is not None:
                before_sampling()
            metadata = self._verify_metadata(rows, drafts, logits.device)
            num_drafts = [len(drafts.get(i, ())) for i, _, _ in rows]
            result = self.rejection_sampler(
                logits, metadata, num_drafts, [t for i, _, _ in rows for t in drafts.get(i, ())],
                proposals.probs)
        except Exception as e:  # fail these requests, keep the engine alive
            logger.exception("engine step failed")
            self._last_sampling = None
            return self._fail([s.request.request_id for s in sched.scheduled], repr(e))
        self._last_sampling = None  # rows drew several tokens: the next rows start afresh
        tensors = [result.output_token_ids]
        if result.logprobs is not None:
            tensors += [result.logprobs_token_ids, result.logprobs, result.ranks]
        return _Step(
            rows=[(g, c, c.request.num_output_tokens) for _, g, c in rows],
            host=self.model_runner.to_host(tensors),
            row_of={}, sampled=None,  # nothing of it is read on the device by the next step
            needs_values=True,
            decode_only=sched.num_prefill_tokens == 0,
            spec=SpecRows(num_drafts, [sched.scheduled[i].num_spec_tokens for i, _, _ in rows],
                          [i not in unready for i, _, _ in rows], start),
        )
    # --8<-- [end:launch_spec]

    # --8<-- [start:verify_metadata]
    def _verify_metadata(self, rows: list[tuple[int, _Group, _Completion]],
                         drafts: dict[int, list[int]], device: torch.device) -> SamplingMetadata:
        """One row of sampling parameters per verified position: row `j` of a sequence
        counts its first `j` proposals as output tokens, as decoding one token at a
        time would have when it sampled there (penalties, min_tokens)."""
        reqs = []
        for i, _, c in rows:
            base, d = self._sampling_request(c), drafts.get(i, [])
            reqs += [base._replace(output_token_ids=[*base.output_token_ids, *d[:j]])
                     for j in range(len(d) + 1)]
        return SamplingMetadata.build(reqs, device, self.vocab_size, self.eos_token_ids)
    # --8<-- [end:verify_metadata]

    # --8<-- [start:record_spec]
    def _record_spec(self, step: _Step, tensors: list[torch.Tensor],
                     logprobs: object, now: float) -> list[RequestOutput]:
        """Record a read-back speculative step: each row's tokens in order until one
        finishes it, then the rollback of its rejected proposals."""
        spec = step.spec
        tokens = tensors[0].tolist()  # [S, max_k + 1], PLACEHOLDER_TOKEN_ID past the end
        touched: dict[str, _Group] = {}
        first_row, produced = 0, 0
        for (group, c, index), row, k, slots, judged in zip(
                step.rows, tokens, spec.num_draft_tokens, spec.num_spec_slots, spec.judged):
            rows_of_seq, first_row = range(first_row, first_row + k + 1), first_row + k + 1
            if c.finish_reason is not None:  # finished or aborted since it was launched
                continue
            req = c.request
            emitted = [t for t in row if t != PLACEHOLDER_TOKEN_ID]  # accepted + 1
            for j, token_id in enumerate(emitted):
                req.append_output_token(token_id)
                self._record_token(c, token_id, index + j + 1, logprobs, rows_of_seq[j])
                produced += 1
                if c.finish_reason is not None:  # a stop inside the run: the rest is dropped
                    break
            if group.first_token_time is None:
                group.first_token_time = now
            self.spec_stats.observe(k, len(emitted) - 1)
            if slots:
                if judged:
                    self.spec_policy.observe(req, k, len(emitted) - 1)
                if c.finish_reason is None:
                    self.scheduler.reject_tokens(req, slots - (len(emitted) - 1))
            if not group.final_only or (c.finish_reason is not None and group.finished):
                touched[group.request_id] = group
        self.stats["generation_tokens_total"] += produced
        self.spec_stats.num_spec_steps += 1
        self.spec_stats.step_time_s += time.perf_counter() - spec.start_time
        return [self._make_output(g) for g in touched.values()]
    # --8<-- [end:record_spec]


__all__ = ["SpecRows", "SpeculativeSteps"]
