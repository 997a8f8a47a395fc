"""The fused GPU sampler: temperature and draw in one kernel (`ops.sample_tokens`).

`FusedSampler` extends the reference `Sampler` (chapter 5). When no row
filters with top-k, top-p or min-p, the temperature and the sampling of every
row run as one kernel: Gumbel-max over the logits, the same distribution as
the reference's exponential race, in log space, reading the logits in the
model's dtype when no other stage needs them in float32. Each row's noise
comes from a counter-based generator (Philox) keyed per request, so a
request's tokens do not depend on the batch it runs in. Any other step runs
the reference pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm import ops
from mini_vllm.ops.sampling import kernel_fits, splitmix64
from mini_vllm.sampler import Sampler, SamplerOutput
from mini_vllm.sampling_metadata import (
    SamplingMetadata,
    SamplingRequest,
    _to_device,
    row_temperatures,
)


# --8<-- [start:noise_seeds]
def _noise_seeds(reqs: Sequence[SamplingRequest]) -> np.ndarray:
    """Each row's (Philox key, counter) for the fused sampler: `[N, 2]` int64.

    A request's key is fixed for its life (its generator's seed, mixed, when
    it has one; else `noise_key`) and the counter is the index of the token
    being drawn, so the noise of its t-th token is the same whatever batch it
    runs in, and again after a preemption. A row without a key takes a fresh one for this step (from
    torch's default generator, so `torch.manual_seed` reproduces it) with the
    row index as its counter.
    """
    seeds = np.empty((len(reqs), 2), dtype=np.int64)
    step_key = None
    for i, r in enumerate(reqs):
        if r.generator is not None:  # a seeded request: the key follows from its seed
            seeds[i] = (splitmix64(r.generator.initial_seed()), len(r.output_token_ids))
        elif r.noise_key is not None:
            seeds[i] = (r.noise_key, len(r.output_token_ids))
        else:
            if step_key is None:
                step_key = int(torch.randint(-(2**63), 2**63 - 1, ()))
            seeds[i] = (step_key, i)
    return seeds
# --8<-- [end:noise_seeds]


@dataclass
class FusedSamplingMetadata(SamplingMetadata):
    """`SamplingMetadata` plus what the fused kernel reads.

    Attributes:
        inv_temperature: `[N]` float32 1 / T (0 on greedy rows), or None when
            the kernel does not draw this step (a row filters with top-k,
            top-p or min-p, the vocabulary is too wide, or no kernels).
        noise_seeds: `[N, 2]` int64 (key, counter) of each row's Philox noise,
            the counter being the row's number of output tokens so far.
        keyed: every row has its own noise key (none is drawn per step).
    """

    inv_temperature: torch.Tensor | None = None
    noise_seeds: torch.Tensor | None = None
    keyed: bool = False

    @classmethod
    def build(
        cls,
        requests: Sequence[SamplingRequest | tuple],
        device: torch.device | str,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
    ) -> FusedSamplingMetadata:
        """`SamplingMetadata.build`, plus the kernel's inputs where it will draw."""
        meta = super().build(requests, device, vocab_size, eos_token_ids)
        device = torch.device(device)
        reqs = [SamplingRequest(*r) for r in requests]
        if (device.type == "cuda" and meta.top_k is None and meta.top_p is None
                and meta.min_p is None and ops.is_available() and kernel_fits(vocab_size)):
            temps, greedy = row_temperatures(reqs)
            meta.inv_temperature = _to_device(
                [0.0 if g else 1.0 / t for g, t in zip(greedy, temps)], torch.float32, device)
            meta.noise_seeds = _to_device(_noise_seeds(reqs), torch.int64, device)
            meta.keyed = all(r.noise_key is not None or r.generator is not None for r in reqs)
        return meta

    # --8<-- [start:next_step]
    def next_step(self) -> FusedSamplingMetadata | None:
        """This metadata for the next step of the same rows, or None: build it anew.

        Rebuilding costs Python work per row every step (about 0.7 ms at 256
        rows on an H200's host) for values that mostly do not change: a
        request's temperature is fixed, and in the fused sampler only each
        row's noise counter moves, by one per token. So when nothing else
        depends on the tokens drawn (no penalties, no min_tokens mask) and
        every row has its own noise key, the next step's metadata is this one
        with the counters advanced on the device: one small kernel, queued
        after the kernel that read them.

        The caller guarantees the precondition: the same requests in the same
        rows, each of which drew exactly one token with this metadata.
        """
        if (self.noise_seeds is None or not self.keyed or self.min_tokens_index is not None
                or self.repetition_penalties is not None or self.output_token_counts is not None
                or self.grammar_bitmask is not None or self.bad_words_index is not None):
            return None
        self.noise_seeds.select(1, 1).add_(1)  # in place, without a trip through __setitem__
        return self
    # --8<-- [end:next_step]


class FusedSampler(Sampler):
    """`Sampler` whose temperature and draw run as one kernel where they can."""

    def build_metadata(
        self,
        requests: Sequence[SamplingRequest | tuple],
        device: torch.device | str,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
    ) -> FusedSamplingMetadata:
        return FusedSamplingMetadata.build(requests, device, vocab_size, eos_token_ids)

    # --8<-- [start:forward]
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        seeds = getattr(metadata, "noise_seeds", None)
        if seeds is None or not logits.is_cuda:  # the kernel does not draw: the reference
            return super().__call__(logits, metadata)
        self.check_logits(logits, metadata)
        plain = (metadata.min_tokens_index is None and metadata.max_num_logprobs is None
                 and metadata.repetition_penalties is None
                 and metadata.output_token_counts is None and not metadata.constrains_tokens)
        if plain:  # the common case: one kernel reads the logits as they are
            return SamplerOutput(ops.sample_tokens(logits, metadata.inv_temperature, seeds))
        logits = self.process_logits(logits.float(), metadata)
        sampled = ops.sample_tokens(logits, metadata.inv_temperature, seeds)  # applies 1 / T
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        if not metadata.all_greedy:
            logits = logits / metadata.temperature.unsqueeze(1)
        return self.gather_logprobs(logits, sampled, metadata.max_num_logprobs)
    # --8<-- [end:forward]


__all__ = ["FusedSampler", "FusedSamplingMetadata"]
