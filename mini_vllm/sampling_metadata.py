"""The sampler's inputs: each row's parameters as tensors, built once per step.

`SamplingMetadata.build` turns the scheduled requests' `SamplingParams` (and
their token histories, random generators and grammars) into per-row tensors on
the logits' device; `Sampler` (`sampler.py`) then runs the batch through its
pipeline. A stage no row needs gets no tensor, and the sampler skips it.
vLLM keeps the same split: `v1/sample/metadata.py` beside `v1/sample/sampler.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mini_vllm.sampling_params import GREEDY_EPSILON, OPENAI_DEFAULTS, SamplingParams
from mini_vllm.structured_output.bitmask import bitmask_width

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


__all__ = [
    "SamplingMetadata",
    "SamplingRequest",
    "make_generator",
    "row_temperatures",
]
