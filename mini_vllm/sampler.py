"""The sampler: one token per row of a batch of logits, each row with its own parameters.

`SamplingMetadata.build` (`sampling_metadata.py`) turns the scheduled
requests' `SamplingParams` (and their token histories and random generators)
into per-row tensors once per step; `Sampler` then runs the whole batch
through one fixed pipeline:

    logits [N, V] float32
      -> token constraints   grammar bitmask, allowed_token_ids, bad_words: -inf;
                             logit_bias added (only the rows that ask for them)
      -> min_tokens mask     EOS and stop tokens at -inf until min_tokens outputs
      -> penalties           repetition (prompt + output), frequency, presence (output)
      -> temperature         logits / T   (greedy rows: T = 1)
      -> logprobs            log_softmax here, before any filtering
      -> min_p, top_k, top_p  filtered tokens at -inf (random rows only)
      -> sample              greedy rows: argmax; random rows: argmax(probs / Exp(1) noise)

This is the reference sampler. On a GPU the engine uses
`mini_vllm.gpu.FusedSampler`, which extends it: the temperature and the
draw run as one kernel (chapter 9).

A stage no row needs is skipped entirely. Everything is vectorised over rows
except drawing the noise of seeded rows, which comes from each request's own
`torch.Generator` so that its tokens do not depend on the rest of the batch.
Nothing here reads a value back to the host: the engine's `.tolist()` of the
sampled ids is the step's one sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mini_vllm.sampling_metadata import SamplingMetadata, SamplingRequest
from mini_vllm.structured_output.bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    """The sampler's result for N rows (all tensors on the logits' device).

    For a row whose request asked for `logprobs = n`: the sampled token is
    `logprobs_token_ids[i, 0]` with log-probability `logprobs[i, 0]` and rank
    `ranks[i]`; its top alternatives are `logprobs_token_ids[i, 1:1 + n]`
    (ranks 1..n). Columns past a row's own `n` belong to other rows' requests.

    Attributes:
        sampled_token_ids: [N] int64.
        logprobs_token_ids: [N, 1 + max_num_logprobs] int64, or `None`.
        logprobs: [N, 1 + max_num_logprobs] float32, or `None`.
        ranks: [N] int64, 1 + the number of tokens strictly more likely than
            the sampled one, or `None`.
    """

    sampled_token_ids: torch.Tensor
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    @property
    def token_ids(self) -> torch.Tensor:
        """Alias of `sampled_token_ids`."""
        return self.sampled_token_ids


class Sampler:
    """Samples one token per row; see the module docstring for the pipeline."""

    # --8<-- [start:forward]
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Choose the next token of every row.

        Args:
            logits: [N, V], one row per request that samples this step. It is
                not modified.
            metadata: the rows' parameters, from `build_metadata`.

        Returns:
            `SamplerOutput` with the sampled ids and, when a row asked for
            them, the logprobs.
        """
        self.check_logits(logits, metadata)
        logits = self.process_logits(logits.float(), metadata)
        if not metadata.all_greedy:
            logits = logits / metadata.temperature.unsqueeze(1)  # greedy rows: / 1
        sampled = self.sample(logits, metadata)
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return self.gather_logprobs(logits, sampled, metadata.max_num_logprobs)

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The stages before the temperature: the token constraints, the min_tokens
        mask, then the penalties."""
        if metadata.constrains_tokens:
            logits = self.apply_token_constraints(logits, metadata)
        if metadata.min_tokens_index is not None:
            minus_inf = torch.full((), -math.inf, device=logits.device)  # no host copy
            logits = logits.index_put(metadata.min_tokens_index, minus_inf)
        return self.apply_penalties(logits, metadata)
    # --8<-- [end:forward]

    @staticmethod
    def check_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        if logits.dim() != 2 or logits.shape[1] != metadata.vocab_size:
            raise ValueError(
                f"logits must be [N, {metadata.vocab_size}], got {list(logits.shape)}"
            )

    def build_metadata(
        self,
        requests: Sequence[SamplingRequest | tuple],
        device: torch.device | str,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
    ) -> SamplingMetadata:
        """The step's metadata for this sampler (see `SamplingMetadata.build`)."""
        return SamplingMetadata.build(requests, device, vocab_size, eos_token_ids)

    # --8<-- [start:token_constraints]
    @staticmethod
    def apply_token_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The grammar, allowed_token_ids and bad_words masks, then logit_bias.

        Each stage touches only the rows that asked for it (an `index_copy` of
        those rows, or an `index_put` at (row, token) pairs), so every other
        row is unchanged bit for bit. A masked logit is -inf, and stays -inf
        whatever bias is added to it.
        """
        minus_inf = torch.full((), -math.inf, device=logits.device)  # no host copy
        if metadata.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, *metadata.grammar_bitmask)
        if metadata.allowed_token_ids_mask is not None:
            rows, allowed = metadata.allowed_token_ids_mask
            kept = logits.index_select(0, rows).masked_fill(~allowed, -math.inf)
            logits = logits.index_copy(0, rows, kept)
        if metadata.bad_words_index is not None:
            logits = logits.index_put(metadata.bad_words_index, minus_inf)
        if metadata.logit_bias is not None:
            rows, cols, values = metadata.logit_bias
            logits = logits.index_put((rows, cols), values, accumulate=True)
        return logits
    # --8<-- [end:token_constraints]

    # --8<-- [start:penalties]
    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """vLLM's penalties, in its order; a row with neutral values is unchanged bit for bit.

        repetition (tokens in prompt or output): l > 0 -> l / r, l <= 0 -> l * r
        frequency  (output only):                l -= f * count
        presence   (output only):                l -= p * (count > 0)
        """
        if metadata.repetition_penalties is not None:
            r = metadata.repetition_penalties.unsqueeze(1)  # [N, 1]
            penalised = torch.where(logits > 0, logits / r, logits * r)
            logits = torch.where(metadata.prompt_output_mask, penalised, logits)
        if metadata.output_token_counts is not None:
            counts = metadata.output_token_counts
            logits = (
                logits
                - metadata.frequency_penalties.unsqueeze(1) * counts
                - metadata.presence_penalties.unsqueeze(1) * (counts > 0)
            )
        return logits
    # --8<-- [end:penalties]

    # --8<-- [start:filters]
    @staticmethod
    def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Drop tokens with p < min_p * p_max, compared in log space:

        p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)   (min_p = 0 -> -inf, keeps all)
        """
        threshold = logits.amax(dim=1, keepdim=True) + torch.log(min_p).unsqueeze(1)
        return logits.masked_fill(logits < threshold, -math.inf)

    @staticmethod
    def apply_top_k_top_p(
        logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Keep each row's top-k tokens, then the top-p nucleus of what is left.

        Both become a per-row logit threshold, and every token whose logit is at
        least the threshold survives, so tokens tied at the cut are all kept:

            top-k: threshold = the k-th largest logit
            top-p: sort the (top-k'd) probabilities in descending order and keep
                   position j while the mass before it is < p:
                   probs    0.5  0.3  0.1  0.1      p = 0.75
                   before   0.0  0.5  0.8  0.9
                   kept      x    x                -> threshold = logit of 0.3
        """
        top_k, top_p = metadata.top_k, metadata.top_p
        if top_p is None:
            # Top-k only: a partial top-k of the largest k asked for, no full sort.
            k = top_k.clamp(max=metadata.max_top_k)  # rows without top-k have V > max
            values = logits.topk(metadata.max_top_k, dim=1).values  # [N, max_k], descending
            threshold = values.gather(1, (k - 1).unsqueeze(1))
            threshold = threshold.masked_fill((top_k > metadata.max_top_k).unsqueeze(1),
                                              -math.inf)
            return logits.masked_fill(logits < threshold, -math.inf)

        sorted_logits = logits.sort(dim=1, descending=True).values  # [N, V]
        if top_k is not None:
            k_threshold = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # V -> the minimum
            sorted_logits = sorted_logits.masked_fill(sorted_logits < k_threshold, -math.inf)
        probs = sorted_logits.softmax(dim=1)
        mass_before = probs.cumsum(dim=1) - probs
        num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=1, keepdim=True)
        num_kept = num_kept.clamp(min=1)  # the top token always stays (0 only for NaN rows)
        threshold = sorted_logits.gather(1, num_kept - 1)
        # top_p = 1 is off: do not let rounding in the cumsum drop the tail.
        threshold = threshold.masked_fill((top_p >= 1.0).unsqueeze(1), -math.inf)
        if top_k is not None:
            threshold = torch.maximum(threshold, k_threshold)
        return logits.masked_fill(logits < threshold, -math.inf)
    # --8<-- [end:filters]

    # --8<-- [start:sample]
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; random rows race exponential noise.

        argmax_i p_i / E_i with E_i ~ Exponential(1) i.i.d. picks token i with
        probability exactly p_i (the smallest of independent exponentials
        E_i / p_i is index i with probability p_i / sum p). A seeded row draws
        its V noise values from its own generator, the same V values per step
        whatever else is in the batch; the other rows share one batched draw.
        """
        greedy = None if metadata.all_random else logits.argmax(dim=1)
        if metadata.all_greedy:
            return greedy

        if metadata.min_p is not None:
            logits = self.apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = self.apply_top_k_top_p(logits, metadata)
        probs = logits.softmax(dim=1)

        noise = torch.empty_like(probs)
        if len(metadata.generators) < probs.shape[0]:
            noise.exponential_()  # rows without a generator: one draw from the default one
        for row, generator in metadata.generators.items():
            row_noise = torch.empty(probs.shape[1], device=probs.device)
            noise[row] = row_noise.exponential_(generator=generator)
        # A noise value of exactly 0 would turn a filtered-out token (p = 0) into 0/0 = NaN.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = (probs / noise).argmax(dim=1)

        if greedy is None:
            return sampled
        return torch.where(metadata.is_greedy, greedy, sampled)
    # --8<-- [end:sample]

    # --8<-- [start:logprobs]
    @staticmethod
    def gather_logprobs(
        logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
    ) -> SamplerOutput:
        """Log-probabilities of the sampled token and of the top `num_logprobs` tokens.

        They come from the logits after the min_tokens mask, the penalties and
        the temperature (greedy rows: temperature 1) but before min-p, top-k and
        top-p, so a token the filters removed still shows its probability.
        """
        logprobs = logits.log_softmax(dim=1)  # [N, V]
        sampled_logprob = logprobs.gather(1, sampled.unsqueeze(1))  # [N, 1]
        ranks = (logprobs > sampled_logprob).sum(dim=1) + 1
        token_ids = sampled.unsqueeze(1)
        values = sampled_logprob
        num_logprobs = min(num_logprobs, logprobs.shape[1])
        if num_logprobs > 0:
            top = logprobs.topk(num_logprobs, dim=1)  # sorted, most likely first
            token_ids = torch.cat([token_ids, top.indices], dim=1)
            values = torch.cat([values, top.values], dim=1)
        return SamplerOutput(
            sampled_token_ids=sampled, logprobs_token_ids=token_ids, logprobs=values, ranks=ranks
        )
    # --8<-- [end:logprobs]


__all__ = [
    "Sampler",
    "SamplerOutput",
]
