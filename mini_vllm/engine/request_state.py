"""The engine's bookkeeping: user requests, their completions, and a launched step.

`LLMEngine` (`llm_engine.py`) keeps a `_Group` per user request and a
`_Completion` per sample of it (`SamplingParams.n`); each completion wraps the
scheduler's `Request` with its own detokenizer, stop checker and random
generator, and buffers what it has not reported yet. A `_Step` is a step that
was launched and not read back yet (chapter 6), and `_LogprobRows` its
logprobs once they are on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mini_vllm.outputs import CompletionOutput, Logprob
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.sequence import Request
from mini_vllm.stop_checker import StopChecker
from mini_vllm.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from mini_vllm.engine.speculative import SpecRows
    from mini_vllm.model_runner import HostCopy
    from mini_vllm.structured_output import StructuredOutputGrammar


# --8<-- [start:state]
@dataclass
class _Completion:
    """Engine-side state of one child request (one of the `n` completions)."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None
    noise_key: int | None  # an unseeded completion's key for the fused GPU sampler's noise
    # Detokenized once, when it ends, not token by token (see _detokenizes_at_end).
    text_at_end: bool
    # What is new since the last output of this completion.
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reported_finish: bool = False
    # Structured outputs (chapter 18): the completion's matcher, and whether its
    # reasoning is over (the grammar constrains only what comes after it).
    grammar: StructuredOutputGrammar | None = None
    reasoning_ended: bool = True

    def take_delta(self) -> CompletionOutput:
        out = CompletionOutput(self.index, self.text, self.token_ids, self.logprobs,
                               self.finish_reason, self.stop_reason)
        self.text, self.token_ids = "", []
        self.logprobs = [] if self.logprobs is not None else None
        self.reported_finish = self.finish_reason is not None
        return out


@dataclass
class _Group:
    """A user request: its prompt and its `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    arrival_time: float
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: no output until it finishes
    first_token_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)
# --8<-- [end:state]


class _LogprobRows:
    """The sampler's logprob tensors on the host, read row by row."""

    def __init__(self, ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor) -> None:
        self.ids, self.values, self.ranks = ids.tolist(), values.tolist(), ranks.tolist()

    def row(self, i: int, n: int, tokenizer: Tokenizer) -> dict[int, Logprob]:
        """The sampled token's logprob and the top `n`, as `{token_id: Logprob}`."""
        ids, values = self.ids[i], self.values[i]
        entry = {ids[0]: Logprob(values[0], self.ranks[i], tokenizer.decode([ids[0]]))}
        for rank, (tid, lp) in enumerate(zip(ids[1:1 + n], values[1:1 + n]), start=1):
            entry.setdefault(tid, Logprob(lp, rank, tokenizer.decode([tid])))
        return entry


# --8<-- [start:launched_step]
@dataclass
class _Step:
    """A launched step: who sampled (and where their placeholder is), and the results."""

    rows: list[tuple[_Group, _Completion, int]]  # (group, completion, output index)
    host: HostCopy  # the sampled ids (and logprobs) on their way to the host
    row_of: dict[str, int]  # child request id -> row of `sampled`
    sampled: torch.Tensor | None  # [rows] on the device, read by the next step
    # A row will speculate: read it back before the next schedule.
    needs_values: bool
    decode_only: bool = False  # every sequence decoded one token (statistics)
    spec: SpecRows | None = None  # a speculative step: several tokens a row
    # A row's next sampling depends on its tokens' values (penalties, a grammar,
    # bad words): read it back before the next step's sampler.
    sampler_needs_values: bool = False
# --8<-- [end:launched_step]


def _uses_penalties(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0 or p.frequency_penalty != 0
            or (p.repetition_penalty is not None and p.repetition_penalty != 1))


def _depends_on_tokens(c: _Completion) -> bool:
    """Whether a completion's next sampling depends on the values of its tokens so far:
    penalties count them, a grammar's mask and a bad word's ban follow them."""
    p = c.request.sampling_params
    return (_uses_penalties(p) or bool(p.bad_words_token_ids)
            or (c.grammar is not None and not c.grammar.is_terminated()))
