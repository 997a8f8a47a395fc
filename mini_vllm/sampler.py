"""The sampler: one token per row of a batch of logits, each row with its own parameters.

`SamplingMetadata.build` turns the scheduled requests' `SamplingParams` (and
their token histories and random generators) into per-row tensors once per
step; `Sampler` then runs the whole batch through one fixed pipeline:

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mini_vllm.sampling_params import GREEDY_EPSILON, OPENAI_DEFAULTS, SamplingParams
from mini_vllm.structured_output.bitmask import apply_token_bitmask, bitmask_width

if TYPE_CHECKING:
    from mini_vllm.structured_output.grammar import StructuredOutputGrammar


class SamplingRequest(NamedTuple):
    """What the sampler needs to know about one row (a plain 4-tuple works too).

    Attributes:
        params: the request's parameters (unset fields count as OpenAI defaults).
        generator: the request's own generator when it has a seed (see
            `make_generator`; the engine keeps one per request for its whole
            life), else `None` (the row uses the shared default generator).
        prompt_token_ids: the prompt (for the repetition penalty).
        output_token_ids: the tokens generated so far (penalties, min_tokens).
        noise_key: a random key drawn once for the request's life, from which
            the fused GPU sampler draws an unseeded request's noise (chapter 9);
            `None` draws a fresh key at every step.
        grammar: the request's structured-output matcher, `None` when its
            output is unconstrained. It must have accepted every token of
            `output_token_ids` (the step's bitmask row is filled from it);
            once it is terminated it no longer constrains the row.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    noise_key: int | None = None
    grammar: StructuredOutputGrammar | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, for a request with `params.seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _to_device(
    data: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list/array as a tensor on `device` (pinned, non-blocking copy on CUDA)."""
    tensor = torch.as_tensor(data, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _value(p: SamplingParams, name: str) -> float:
    """A sampling field's value, its OpenAI default when unset."""
    v = getattr(p, name)
    return OPENAI_DEFAULTS[name] if v is None else v


def row_temperatures(reqs: Sequence[SamplingRequest]) -> tuple[list[float], list[bool]]:
    """Each row's temperature and whether it is greedy (temperature ~ 0)."""
    temps = [_value(r.params, "temperature") for r in reqs]
    return temps, [t < GREEDY_EPSILON for t in temps]


# --8<-- [start:counts]
def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each vocabulary token occurs in each row's list: [N, V] int32.

    The ids of all rows go to the device as one flat index, `row * V + token`,
    and one scatter_add counts them, with no padding and no per-row kernel:

        rows:   0: [5, 7, 5]    1: [2]
        flat:   [0*V+5, 0*V+7, 0*V+5, 1*V+2]   --scatter_add 1s-->   counts.view(-1)
    """
    n = len(token_lists)
    arrays = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_lists]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    flat += np.repeat(np.arange(n, dtype=np.int64) * vocab_size, lengths)
    index = _to_device(flat, torch.int64, device)
    counts = torch.zeros(n * vocab_size, dtype=torch.int32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return counts.view(n, vocab_size)  # [N*V] -> [N, V]
# --8<-- [end:counts]


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    Optional tensors are `None` when no row needs that stage; the sampler then
    skips it. Build with `SamplingMetadata.build`.

    Attributes:
        vocab_size: V, the logits' width.
        temperature: [N] float32; 1.0 on greedy rows (they are argmax'd anyway).
        is_greedy: [N] bool.
        all_greedy / all_random: host flags to skip the random / greedy path.
        top_k: [N] int64, V on rows without top-k; `None` if no row uses it.
        max_top_k: the largest top-k of a row that uses it.
        top_p: [N] float32, 1.0 = off; `None` if no row uses it.
        min_p: [N] float32, 0.0 = off; `None` if no row uses it.
        repetition_penalties / frequency_penalties / presence_penalties: [N] float32.
        prompt_output_mask: [N, V] bool, tokens in a row's prompt or output
            (rows with a repetition penalty only).
        output_token_counts: [N, V] int32, occurrences in a row's output
            (rows with a presence or frequency penalty only).
        min_tokens_index: (rows, token ids) to set to -inf for requests below
            their min_tokens: their EOS (unless ignore_eos) and stop token ids
            (not for a request with structured outputs, whose grammar decides).
        generators: row -> generator, for random rows with their own generator.
        max_num_logprobs: the largest `logprobs` asked for; `None` if no row asks.
        grammar_bitmask: (rows [R] int64, bitmask [R, ceil(V / 32)] int32) of
            the rows whose grammar constrains this token; `None` if none.
        allowed_token_ids_mask: (rows [R] int64, [R, V] bool True = allowed)
            of the rows with `allowed_token_ids`.
        bad_words_index: (rows, token ids) to set to -inf: the last token of
            each bad word whose other tokens end the row's output so far.
        logit_bias: (rows, token ids, values [K] float32) to add.
    """

    vocab_size: int
    temperature: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    prompt_output_mask: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed_token_ids_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words_index: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def constrains_tokens(self) -> bool:
        """Some row has a grammar, allowed_token_ids, bad_words or a logit_bias."""
        return (self.grammar_bitmask is not None or self.allowed_token_ids_mask is not None
                or self.bad_words_index is not None or self.logit_bias is not None)

    @classmethod
    def build(
        cls,
        requests: Sequence[SamplingRequest | tuple],
        device: torch.device | str,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
    ) -> SamplingMetadata:
        """Gather the rows' parameters into tensors on `device`.

        Args:
            requests: one `(params, generator | None, prompt_token_ids,
                output_token_ids)` per row, in the logits' row order.
            device: where the logits live.
            vocab_size: V, the logits' width (the model's vocabulary).
            eos_token_ids: the model's EOS ids, masked with the stop token ids
                while a request is below its `min_tokens`.

        Returns:
            The step's `SamplingMetadata`.
        """
        device = torch.device(device)
        reqs = [SamplingRequest(*r) for r in requests]
        eos = [t for t in eos_token_ids if 0 <= t < vocab_size]

        temps, greedy = row_temperatures(reqs)
        top_ks = [int(_value(r.params, "top_k")) for r in reqs]
        top_ks = [k if 0 < k < vocab_size else vocab_size for k in top_ks]  # off -> V
        top_ps = [_value(r.params, "top_p") for r in reqs]
        min_ps = [_value(r.params, "min_p") for r in reqs]
        reps = [_value(r.params, "repetition_penalty") for r in reqs]
        freqs = [r.params.frequency_penalty for r in reqs]
        press = [r.params.presence_penalty for r in reqs]
        # Filters only matter on random rows; a greedy row's value is neutralised.
        random_rows = [i for i, g in enumerate(greedy) if not g]
        use_top_k = any(top_ks[i] < vocab_size for i in random_rows)
        use_top_p = any(top_ps[i] < 1.0 for i in random_rows)
        use_min_p = any(min_ps[i] > 0.0 for i in random_rows)

        meta = cls(
            vocab_size=vocab_size,
            temperature=_to_device([1.0 if g else t for g, t in zip(greedy, temps)],
                                   torch.float32, device),
            is_greedy=_to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )
        if use_top_k:
            meta.top_k = _to_device(top_ks, torch.int64, device)
            meta.max_top_k = max(top_ks[i] for i in random_rows if top_ks[i] < vocab_size)
        if use_top_p:
            meta.top_p = _to_device(top_ps, torch.float32, device)
        if use_min_p:
            meta.min_p = _to_device(min_ps, torch.float32, device)

        if any(r != 1.0 for r in reps):
            meta.repetition_penalties = _to_device(reps, torch.float32, device)
            seen = [
                np.concatenate([np.asarray(r.prompt_token_ids, dtype=np.int64),
                                np.asarray(r.output_token_ids, dtype=np.int64)])
                if rep != 1.0 else ()
                for r, rep in zip(reqs, reps)
            ]
            meta.prompt_output_mask = _token_counts(seen, vocab_size, device) > 0
        if any(f != 0.0 or p != 0.0 for f, p in zip(freqs, press)):
            meta.frequency_penalties = _to_device(freqs, torch.float32, device)
            meta.presence_penalties = _to_device(press, torch.float32, device)
            outputs = [
                r.output_token_ids if (f != 0.0 or p != 0.0) else ()
                for r, f, p in zip(reqs, freqs, press)
            ]
            meta.output_token_counts = _token_counts(outputs, vocab_size, device)

        rows, cols = [], []
        for i, r in enumerate(reqs):
            # A structured output's grammar alone decides where it may end (it
            # allows EOS only there): min_tokens does not apply to it.
            if (len(r.output_token_ids) < r.params.min_tokens
                    and r.params.structured_outputs is None):
                banned = {t for t in r.params.stop_token_ids if t < vocab_size}
                if not r.params.ignore_eos:
                    banned.update(eos)
                rows += [i] * len(banned)
                cols += sorted(banned)
        if rows:
            meta.min_tokens_index = (_to_device(rows, torch.int64, device),
                                     _to_device(cols, torch.int64, device))

        meta.generators = {
            i: r.generator for i, r in enumerate(reqs) if r.generator is not None and not greedy[i]
        }
        asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        meta.max_num_logprobs = max(asked) if asked else None
        _build_token_constraints(meta, reqs, device)
        return meta

    def next_step(self) -> SamplingMetadata | None:
        """This metadata for the next step of the same rows, or None: build it anew.

        The reference rebuilds every step; the fused GPU sampler's metadata can
        move itself forward (chapter 9).
        """
        return None


# --8<-- [start:build_token_constraints]
def _build_token_constraints(meta: SamplingMetadata, reqs: Sequence[SamplingRequest],
                             device: torch.device) -> None:
    """Fill `meta`'s grammar, allowed_token_ids, bad_words and logit_bias fields.

    Each is left `None` when no row uses it. The grammar rows' bitmask is
    filled on the host (a large batch on several threads) and copied to the
    device once.
    """
    vocab_size = meta.vocab_size
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.is_terminated()]
    if rows:
        from mini_vllm.structured_output.grammar import fill_bitmasks  # (xgrammar: lazily)

        for i in rows:
            if reqs[i].grammar.vocab_size != vocab_size:
                raise ValueError(f"row {i}: its grammar covers {reqs[i].grammar.vocab_size} "
                                 f"token ids, the logits {vocab_size}")
        bitmask = torch.empty((len(rows), bitmask_width(vocab_size)), dtype=torch.int32)
        fill_bitmasks([reqs[i].grammar for i in rows], bitmask)  # every word written
        meta.grammar_bitmask = (_to_device(rows, torch.int64, device),
                                _to_device(bitmask, torch.int32, device))

    rows = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids]
    if rows:
        allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
        for j, i in enumerate(rows):
            allowed[j, _in_vocab("allowed_token_ids", reqs[i].params.allowed_token_ids,
                                 vocab_size)] = True
        meta.allowed_token_ids_mask = (_to_device(rows, torch.int64, device),
                                       _to_device(allowed, torch.bool, device))

    # A bad word's last token is banned when the output ends with its other
    # tokens: output [.., 5, 9] and bad word [5, 9, 4] -> ban 4 on this row.
    rows, cols = [], []
    for i, r in enumerate(reqs):
        if not r.params.bad_words:
            continue
        if r.params.bad_words_token_ids is None:
            raise ValueError("bad_words must be encoded before sampling: call "
                             "SamplingParams.update_from_tokenizer")
        out, n = r.output_token_ids, len(r.output_token_ids)
        banned = {seq[-1] for seq in r.params.bad_words_token_ids  # only the output's tail is read
                  if len(seq) - 1 <= n and list(out[n - len(seq) + 1:]) == seq[:-1]}
        banned = _in_vocab("bad_words_token_ids", sorted(banned), vocab_size)
        rows += [i] * len(banned)
        cols += banned
    if rows:
        meta.bad_words_index = (_to_device(rows, torch.int64, device),
                                _to_device(cols, torch.int64, device))

    rows, cols, values = [], [], []
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            ids = _in_vocab("logit_bias", list(r.params.logit_bias), vocab_size)
            rows += [i] * len(ids)
            cols += ids
            values += list(r.params.logit_bias.values())
    if rows:
        meta.logit_bias = (_to_device(rows, torch.int64, device),
                           _to_device(cols, torch.int64, device),
                           _to_device(values, torch.float32, device))


def _in_vocab(name: str, ids: list[int], vocab_size: int) -> list[int]:
    """`ids`, or a ValueError naming `name` if one is outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids
# --8<-- [end:build_token_constraints]


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
    "SamplingMetadata",
    "SamplingRequest",
    "make_generator",
]
