"""`SamplingParams`: how one request wants its tokens chosen and when it stops.

The fields and their meaning follow vLLM's `SamplingParams` (and through it the
OpenAI API), so a request written for vLLM means the same thing here. The five
fields a model's `generation_config.json` may set (temperature, top_p, top_k,
min_p, repetition_penalty) default to `None`, meaning "unset": the engine calls
`with_defaults(generation_config)` once per request to fill them, from the
model's file where it has them and from the OpenAI defaults otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mini_vllm.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from mini_vllm.tokenizer import Tokenizer

# Below this temperature a row is sampled greedily (argmax); dividing logits by
# something this small would only overflow. vLLM uses the same epsilon.
GREEDY_EPSILON = 1e-5

# Every invalid field raises ValueError, wrong types included (hence the TRY004 waivers):
# the server turns ValueError into a 400 naming the field.

# Most top-N alternatives a request may ask for per token (vLLM's max_logprobs).
MAX_LOGPROBS = 20

# OpenAI's bounds on a logit_bias value: -100 bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0

# --8<-- [start:defaults]
# Values for the generation-config fields when neither the request nor the
# model's generation_config.json sets them: OpenAI's defaults.
OPENAI_DEFAULTS: Mapping[str, float | int] = MappingProxyType({
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,  # 0 (or -1) = off
    "min_p": 0.0,
    "repetition_penalty": 1.0,
})
# --8<-- [end:defaults]


# --8<-- [start:output_kind]
class RequestOutputKind(enum.IntEnum):
    """What the engine returns for a request while it runs (vLLM's names).

    DELTA: an output per step with what is new (what streaming needs).
    FINAL_ONLY: one output, when the request finishes (what `LLM.generate`
        asks for: no per-step output objects to build and merge).
    """

    DELTA = 1
    FINAL_ONLY = 2
# --8<-- [end:output_kind]


def _number(name: str, value: Any) -> float:
    """`value` as a finite float, or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}")  # noqa: TRY004
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _int_text(name: str, text: str) -> int:
    """A decimal integer written as a string (a JSON object key), or a ValueError."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}: key {text!r} is not a token id") from None


def _integer(name: str, value: Any) -> int:
    """`value` as an int, or a ValueError naming the field (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM's names and meanings).

    Attributes:
        n: completions to generate for the prompt (the engine runs them as
            separate rows).
        temperature: divides the logits; 0 means greedy. `None` = unset.
        top_p: keep the smallest set of most likely tokens whose probability
            mass reaches `top_p` (1 = off). `None` = unset.
        top_k: keep the `top_k` most likely tokens (0 or -1 = off). `None` = unset.
        min_p: drop tokens less likely than `min_p` times the most likely one
            (0 = off). `None` = unset.
        seed: seeds this request's own random generator, so its tokens do not
            depend on what else is in the batch.
        max_tokens: most output tokens; `None` = up to the context length
            (the engine fills it in).
        min_tokens: output tokens before EOS, a stop token or a stop string may
            end the request.
        stop: strings that end the request; they are cut from the text.
        stop_token_ids: token ids that end the request.
        ignore_eos: keep generating after EOS.
        logprobs: return the sampled token's log-probability and the top
            `logprobs` alternatives (0 = only the sampled token's).
        presence_penalty: subtracted once from the logit of every token that
            occurs in the output so far, in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per occurrence
            in the output so far, in [-2, 2].
        repetition_penalty: > 0; divides positive (multiplies negative) logits of
            tokens in the prompt or the output (1 = off). `None` = unset.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string (or the stop
            token's text) in the output text.
        output_kind: a delta per step (`DELTA`, for streaming) or one output at
            the end (`FINAL_ONLY`).
        structured_outputs: constrain the output to a JSON schema, regex,
            choice or grammar (see `StructuredOutputsParams`; a dict of its
            fields is accepted too).
        logit_bias: token id -> a value in [-100, 100] added to that token's
            logit before sampling (OpenAI's semantics).
        allowed_token_ids: sample only among these ids.
        bad_words: words never to generate; each is banned as the token
            sequences it encodes to, with and without a leading space.
        bad_words_token_ids: those sequences, filled in from `bad_words` by
            `update_from_tokenizer` when the request is accepted; leave unset.
        prompt_logprobs: return the log-probability of every prompt token and
            its top `prompt_logprobs` alternatives.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Validates every field and normalises in place (numbers to int/float,
        # `stop` and `stop_token_ids` to fresh lists, never None). The dataclass
        # is frozen, so the normalised values go in through object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("n", _integer("n", self.n))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature is not None:
            put("temperature", _number("temperature", self.temperature))
            if self.temperature < 0:
                raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_p is not None:
            put("top_p", _number("top_p", self.top_p))
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            put("top_k", _integer("top_k", self.top_k))
            if self.top_k < -1:
                raise ValueError(f"top_k must be -1 or 0 (off) or at least 1, got {self.top_k}")
        if self.min_p is not None:
            put("min_p", _number("min_p", self.min_p))
            if not 0.0 <= self.min_p <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            put("seed", _integer("seed", self.seed))
            if not -(2**63) <= self.seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None:
            put("max_tokens", _integer("max_tokens", self.max_tokens))
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        put("min_tokens", _integer("min_tokens", self.min_tokens))
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        put("stop", self._validate_stop(self.stop))
        put("stop_token_ids", self._validate_stop_token_ids(self.stop_token_ids))
        if self.logprobs is not None:
            put("logprobs", _integer("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}] (0 = only the sampled token), "
                    f"got {self.logprobs}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        if self.repetition_penalty is not None:
            put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty))
            if self.repetition_penalty <= 0:
                raise ValueError(
                    f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
                )
        try:
            put("output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r}") from None
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise ValueError(f"{name} must be true or false, got {value!r}")  # noqa: TRY004
        self._validate_token_controls(put)

    # --8<-- [start:token_controls]
    def _validate_token_controls(self, put: Any) -> None:
        """Validate and normalise the fields that constrain which tokens may be drawn."""
        so = self.structured_outputs
        if isinstance(so, Mapping):
            put("structured_outputs", StructuredOutputsParams.from_dict(so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            bias = {}
            for key, value in self.logit_bias.items():
                # JSON object keys are strings: "123" is token 123.
                token = key if not isinstance(key, str) else _int_text("logit_bias", key)
                token = _integer("logit_bias key", token)
                value = _number(f"logit_bias[{token}]", value)
                if token < 0:
                    raise ValueError(f"logit_bias: token id {token} must be >= 0")
                if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
                bias[token] = value
            put("logit_bias", bias)
        if self.allowed_token_ids is not None:
            ids = self._validate_id_list("allowed_token_ids", self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty")
            put("allowed_token_ids", ids)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            if any(not w.strip() for w in words):
                raise ValueError("bad_words must not contain empty or whitespace-only strings")
            put("bad_words", list(words))
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, (list, tuple)):
                msg = f"bad_words_token_ids must be a list of token-id lists, got {seqs!r}"
                raise ValueError(msg)
            seqs = [self._validate_id_list("bad_words_token_ids", s) for s in seqs]
            if any(not s for s in seqs):
                raise ValueError("bad_words_token_ids must not contain an empty sequence")
            put("bad_words_token_ids", seqs)
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs))
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                                 f"got {self.prompt_logprobs}")

    @staticmethod
    def _validate_id_list(name: str, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{name} must be a list of token ids, got {ids!r}")  # noqa: TRY004
        out = [_integer(name, i) for i in ids]
        if any(i < 0 for i in out):
            raise ValueError(f"{name} must hold non-negative token ids, got {out}")
        return out

    def update_from_tokenizer(self, tokenizer: Tokenizer) -> SamplingParams:
        """A copy with `bad_words_token_ids` encoded from `bad_words` (vLLM's rule).

        A word is banned as its token sequence both at the start of the text
        (`"word"`) and after a space (`" word"`): a byte-level BPE encodes the
        two differently. The spaced form is kept only when it is a different
        sequence of the same length (otherwise the plain one already covers it).
        """
        if not self.bad_words:
            return self
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip())
            spaced = tokenizer.encode(" " + word.lstrip())
            seqs.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        return self.replace(bad_words_token_ids=seqs)

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse token ids outside the model's vocabulary, naming the field.

        Raises:
            ValueError: for a `logit_bias` key, an `allowed_token_ids` entry or a
                `bad_words_token_ids` entry >= vocab_size.
        """
        bad_words = [t for seq in self.bad_words_token_ids or () for t in seq]
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words_token_ids", bad_words)):
            bad = sorted(i for i in ids if i >= vocab_size)
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    # --8<-- [end:token_controls]

    @staticmethod
    def _validate_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            msg = f"stop must be a string or a list of strings, got {stop!r}"
            raise ValueError(msg)  # noqa: TRY004
        for s in items:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")  # noqa: TRY004
            if not s:
                raise ValueError("stop strings must not be empty")
        return list(items)

    @staticmethod
    def _validate_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            msg = f"stop_token_ids must be a list of integers, got {ids!r}"
            raise ValueError(msg)  # noqa: TRY004
        out = [_integer("stop_token_ids", i) for i in ids]
        if any(i < 0 for i in out):
            raise ValueError(f"stop_token_ids must be non-negative, got {out}")
        return out

    # --8<-- [start:with_defaults]
    def with_defaults(self, generation_config: Mapping[str, Any] | None) -> SamplingParams:
        """Fill the unset (`None`) generation fields like vLLM's "auto" generation config.

        Each of temperature, top_p, top_k, min_p and repetition_penalty that the
        request left unset takes the model's `generation_config.json` value when
        it has one, else the OpenAI default (`OPENAI_DEFAULTS`). Fields the
        request set are kept. `do_sample` is ignored, as vLLM ignores it.

        Args:
            generation_config: the parsed `generation_config.json` (or `None`).

        Returns:
            A new, validated `SamplingParams` with no unset generation field.

        Raises:
            ValueError: when the generation config holds an out-of-range value.
        """
        config = generation_config or {}
        changes = {}
        for name, default in OPENAI_DEFAULTS.items():
            if getattr(self, name) is None:
                value = config.get(name)
                changes[name] = default if value is None else value
        if not changes:
            return self
        try:
            return self.replace(**changes)
        except ValueError as e:
            raise ValueError(f"generation_config.json: {e}") from None
    # --8<-- [end:with_defaults]

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed (e.g. the engine's `max_tokens`)."""
        return dataclasses.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """A deep copy (the stop lists are not shared)."""
        return copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature below `GREEDY_EPSILON`).

        An unset temperature counts as the OpenAI default of 1 (random).
        """
        return self.temperature is not None and self.temperature < GREEDY_EPSILON


__all__ = ["GREEDY_EPSILON", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "OPENAI_DEFAULTS",
           "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
