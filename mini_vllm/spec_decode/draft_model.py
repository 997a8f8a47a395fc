"""`DraftModelProposer`: a small model of the same vocabulary proposes k tokens.

The draft runs `k` forwards per step, each over one token per speculating
sequence, sampled with the request's own parameters (its drafts are drawn
from a distribution `q` the rejection sampler knows). It has its own weights
and its own KV cache, but no block table of its own: its cache has as many
blocks as the target's and a block id names the same slots in both, so the
target's table, allocation, rollback and freeing serve both models.

```
positions               ... p-1 | p      p+1   p+2   ... p+k-1 | p+k
target computes (verify)        | x      d1    d2        d(k-1)  dk
draft computes          catch-up| x->d1  d1->d2 ...   d(k-1)->dk |
```

The draft's cache lags: after a step it holds the sequence up to `p + k - 1`,
of which only the positions the target accepted are valid. So each sequence
keeps how many of its tokens the draft has computed (`_computed`); a step's
first forward computes the ones missing (its "catch-up": usually the one
token after the accepted proposals, the whole prompt the first time) and
draws `d1` from the last; the `k - 1` forwards after it are single-token
decodes whose input is the token drawn before, still on the device
(`BatchEntry.prev_sample_row`). One copy to the host at the end.

The draft recomputes a sequence from its first token after it is admitted
(or preempted and admitted again) rather than trusting prefix-cache hits:
a cached block holds the target's K/V, and the draft's only if some
sequence that speculated computed it. Draft K/V only decides which proposals
are made, never which tokens are emitted.
"""

from __future__ import annotations

import dataclasses
from weakref import WeakKeyDictionary

import torch

from mini_vllm.config import EngineConfig
from mini_vllm.model_runner import BatchEntry, ModelRunner
from mini_vllm.sampler import Sampler
from mini_vllm.sampling_metadata import SamplingMetadata
from mini_vllm.sequence import PLACEHOLDER_TOKEN_ID, Request
from mini_vllm.spec_decode.proposer import ProposalRequest, Proposals
from mini_vllm.spec_decode.rejection_sampler import exponential_noise, sampling_probs


def draft_engine_config(target: EngineConfig, num_blocks: int) -> EngineConfig:
    """The draft model's engine configuration: the target's, with the draft's
    checkpoint and exactly `num_blocks` KV blocks (the target's block ids).

    Raises:
        ValueError: the target has no draft model.
    """
    spec = target.speculative_config
    if spec is None or spec.model is None or spec.draft_model_config is None:
        raise ValueError("draft_engine_config: the target's speculative_config has no draft model")
    return dataclasses.replace(
        target, model=spec.model, model_config=spec.draft_model_config,
        cache_config=dataclasses.replace(target.cache_config, num_gpu_blocks_override=num_blocks),
        tokenizer=target.tokenizer_path, speculative_config=None)


class DraftModelProposer:
    """Proposals drawn from a draft model (see the module docstring).

    Args:
        runner: the draft's model runner, its cache sized as the target's.
        sampler: the engine's sampler (its `process_logits` stages).
        token_budget: the most tokens of catch-up one step computes (the
            scheduler's step budget); a sequence with more to catch up
            proposes nothing this step and catches up over several.
        eos_token_ids: the model's EOS ids (min_tokens masks).
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler, token_budget: int,
                 eos_token_ids: list[int]) -> None:
        self.runner = runner
        self.sampler = sampler
        self.token_budget = token_budget
        self.eos_token_ids = eos_token_ids
        self.vocab_size = runner.vocab_size
        # Per sequence: (its preemptions, its tokens whose draft K/V is in the cache).
        self._computed: WeakKeyDictionary[Request, tuple[int, int]] = WeakKeyDictionary()

    # --8<-- [start:propose]
    @torch.inference_mode()
    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        """Catch up, draw `d1`, then `k - 1` more single-token forwards (one host sync)."""
        # Longest runs first: the sequences still drafting at step j are a prefix.
        order = sorted(range(len(batch)), key=lambda i: -batch[i].num_tokens)
        entries, drafting = self._catch_up(batch, order)
        logits = self.runner.execute(entries) if entries else None  # [len(drafting), V]
        if not drafting:  # only catch-up chunks this step
            return Proposals([None for _ in batch])
        steps = [self._draw(logits, [batch[i] for i in drafting])]  # (tokens, probs) per step
        for j in range(1, batch[drafting[0]].num_tokens):
            active = [i for i in drafting if batch[i].num_tokens > j]
            entries = [BatchEntry([PLACEHOLDER_TOKEN_ID], batch[i].request.num_tokens - 1 + j,
                                  batch[i].block_table, prev_sample_row=row)
                       for row, i in enumerate(active)]  # d_j at position p + j -> d_(j+1)
            logits = self.runner.execute(entries, prev_sampled=steps[-1][0])
            steps.append(self._draw(logits, [batch[i] for i in active]))
        for i in drafting:  # its draft K/V now reaches position p + k - 1
            r = batch[i].request
            self._computed[r] = (r.num_preemptions, r.num_tokens - 1 + batch[i].num_tokens)
        return self._collect(batch, drafting, steps)
    # --8<-- [end:propose]

    # --8<-- [start:catch_up]
    def _catch_up(self, batch: list[ProposalRequest], order: list[int]
                  ) -> tuple[list[BatchEntry], list[int]]:
        """The first forward's entries, in `order`: each sequence's tokens the draft has
        not computed, up to its last; and the sequences that draw `d1` in it (those
        caught up in full), in the same order."""
        entries, drafting, budget = [], [], self.token_budget
        for i in order:
            b = batch[i]
            r, last = b.request, b.request.num_tokens - 1
            preemptions, computed = self._computed.get(r, (r.num_preemptions, 0))
            if preemptions != r.num_preemptions:  # its blocks were freed: start over
                computed = 0
            computed = min(computed, last)  # rejected proposals' K/V is not valid
            todo = r.all_token_ids[computed : last + 1]
            take = min(len(todo), budget)
            if take <= 0:
                continue
            budget -= take
            whole = take == len(todo)
            entries.append(BatchEntry(todo[:take], computed, b.block_table, sample=whole))
            if whole:
                drafting.append(i)
            else:  # a chunk: the rest next step
                self._computed[r] = (r.num_preemptions, computed + take)
        return entries, drafting
    # --8<-- [end:catch_up]

    def _draw(self, logits: torch.Tensor, rows: list[ProposalRequest]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw one proposal per row from the draft's distribution `q`, processed as
        the target's is: greedy rows take the argmax (a point mass)."""
        meta = SamplingMetadata.build([b.sampling for b in rows], logits.device,
                                      self.vocab_size, self.eos_token_ids)
        processed, _, probs = sampling_probs(self.sampler, logits, meta)
        if probs is None:
            return processed.argmax(dim=1), None
        sampled = (probs / exponential_noise(tuple(probs.shape), probs.device,
                                             meta.generators)).argmax(dim=1)
        if not meta.all_random:
            sampled = torch.where(meta.is_greedy, processed.argmax(dim=1), sampled)
        return sampled, probs

    def _collect(self, batch: list[ProposalRequest], drafting: list[int],
                 steps: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Proposals:
        """Per sequence its proposals in order, and their `q` rows in the same order."""
        flat = torch.cat([tokens for tokens, _ in steps]).tolist()  # the one host sync
        offsets = [0]
        for tokens, _ in steps:
            offsets.append(offsets[-1] + len(tokens))
        # Sequence `drafting[row]` is row `row` of every step it took part in.
        where: list[list[int]] = [[] for _ in batch]
        for row, i in enumerate(drafting):
            where[i] = [offsets[j] + row for j in range(batch[i].num_tokens)]
        ready = set(drafting)
        out = [[flat[w] for w in ws] if i in ready else None  # None: still catching up
               for i, ws in enumerate(where)]
        index = [w for ws in where for w in ws]  # q's rows in output order
        probs = None
        if any(p is not None for _, p in steps):
            all_q = torch.cat([p if p is not None else torch.zeros(
                len(t), self.vocab_size, device=t.device) for t, p in steps])
            probs = all_q[torch.tensor(index, device=all_q.device)]
        return Proposals(out, probs)


__all__ = ["DraftModelProposer", "draft_engine_config"]
