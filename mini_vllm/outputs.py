"""What the engine hands back: `RequestOutput`s made of `CompletionOutput`s.

The names and fields follow vLLM's, so code written against vLLM's offline
API reads the same here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token.

    Attributes:
        logprob: natural log of the token's probability (after temperature,
            before top-k/top-p filtering, as vLLM reports it).
        rank: 1 for the most likely token.
        decoded_token: the token's text.
    """

    logprob: float
    rank: int
    decoded_token: str = ""


# One dict per output token: token id -> Logprob. It holds the sampled token
# and the top-N alternatives asked for with `SamplingParams.logprobs`.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    In the offline API the fields are cumulative; in a stream each yielded
    output carries only what is new since the previous one (`text` and
    `token_ids` are deltas then).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as the engine reports it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> None:
        """Fold a later delta of the same request into this output.

        The offline API accumulates a request's deltas into one cumulative
        output this way; a stream whose reader fell behind merges queued
        deltas into one chunk.
        """
        by_index = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            old = by_index.get(c.index)
            if old is None:
                self.outputs.append(c)
                by_index[c.index] = c
                continue
            old.text += c.text
            # In place: a request's lists are not copied again at every step.
            old.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if old.logprobs is None:
                    old.logprobs = []
                old.logprobs.extend(c.logprobs)
            old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.error = delta.error
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics.update(delta.metrics)
