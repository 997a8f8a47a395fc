"""The OpenAI wire format: pydantic models of requests, responses and errors.

Requests accept and ignore fields they do not know (the server logs their
names); a field of the OpenAI API that the server does not implement is
refused (`suffix`, a `best_of` other than `n`). Sampling fields a request leaves out stay
`None` so that the engine (`SamplingParams.with_defaults`) fills them from the
model's `generation_config.json`, exactly as vLLM does.

Requests are parsed strictly: JSON types are never coerced (`"16"` is not an
integer, `"yes"` not a boolean, `true` not a token id), and every string a
request carries is checked to be valid Unicode (`Text`). A new request field
(structured outputs, tools ...) gets both by declaring its type with these
building blocks on an `OpenAIBaseModel`.

This module holds what both endpoints share (the strict building blocks,
errors, the sampling fields, usage, the model list) and the completions
endpoint's request and responses; the chat endpoint's messages, tools and
replies are in `protocol_chat.py`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from mini_vllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    """A fresh response id such as `cmpl-3f2a...` or `chatcmpl-...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


# --8<-- [start:strict_types]
class OpenAIBaseModel(BaseModel):
    """Base of every request: strict JSON types; unknown fields are dropped, and logged."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [str(k)[:40] for k in data if k not in known]
            if unknown:  # (a few names, each cut short: the log line stays small)
                logger.warning("%s: ignoring field(s) it does not know: %s", cls.__name__,
                               ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else ""))
        return data


def _valid_unicode(text: str) -> str:
    """`text`, unless it holds a lone UTF-16 surrogate (JSON's `"\\ud800"`).

    Python's JSON parser accepts such escapes, but the string cannot be
    encoded as UTF-8: the tokenizer, the chat template and the response would
    each fail on it later.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"a lone surrogate U+{ord(text[e.start]):04X} at character "
                             f"{e.start} is not valid Unicode text") from None
    return text


def _valid_unicode_tree(value: Any) -> Any:
    """`_valid_unicode` on every key and string inside a JSON value."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _valid_unicode(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


# A string of a request: valid Unicode (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
# Any JSON object whose strings are valid Unicode.
JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode_tree)]


def _prompt_form(value: Any) -> str | None:
    """Which of the four prompt forms `value` has, from its first item only.

    Validating against the one form it can be (instead of trying every member
    of a union) keeps a body of a million token ids one linear pass.
    """
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else ""
        if isinstance(first, str):
            return "texts"
        if isinstance(first, list):
            return "token_id_lists"
        return "token_ids"
    return None


PROMPT_FORMS = frozenset({"text", "texts", "token_ids", "token_id_lists"})
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], Tag("texts")]
    | Annotated[list[int], Tag("token_ids")]
    | Annotated[list[list[int]], Tag("token_id_lists")],
    Discriminator(_prompt_form, custom_error_type="prompt_type",
                  custom_error_message="prompt must be a string, a list of strings, a list of "
                                       "token ids or a list of token-id lists"),
]
# --8<-- [end:strict_types]


# ----------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """The body of every error: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# --8<-- [start:response_format]
class JsonSchemaFormat(OpenAIBaseModel):
    """`response_format.json_schema`: the schema the answer must follow.

    `strict` is accepted either way: the grammar always admits exactly the
    schema's properties (OpenAI's strict behaviour).
    """

    name: Text | None = None
    description: Text | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
# --8<-- [end:response_format]


# --8<-- [start:sampling_fields]
class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share, and their mapping to `SamplingParams`.

    `None` means "not given": the model's generation config decides, else the
    OpenAI default (see `SamplingParams.with_defaults`).
    """

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    best_of: int | None = None  # accepted only when it changes nothing (equal to n)
    # Which tokens may be drawn (chapter 18): vLLM's extra parameters and OpenAI's.
    logit_bias: dict[Text, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: JSONObject | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of ({best_of}) must equal n ({n}): the server does not "
                             "rank extra candidates")
        return best_of

    @field_validator("structured_outputs")
    @classmethod
    def _one_output_format(cls, value: dict | None, info: ValidationInfo) -> dict | None:
        fmt = info.data.get("response_format")
        if value is not None and fmt is not None and fmt.type != "text":
            raise ValueError("give either response_format or structured_outputs, not both")
        return value

    # --8<-- [start:structured_outputs_params]
    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field it came from.

        Raises:
            ValueError: naming the field, when the constraint is malformed.
        """
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format: a json_schema response format needs "
                                 "json_schema.schema")
            return StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format"
        if self.structured_outputs is not None:
            return StructuredOutputsParams.from_dict(self.structured_outputs), "structured_outputs"
        return None, None
    # --8<-- [end:structured_outputs_params]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def build_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                              structured_outputs: StructuredOutputsParams | None = None
                              ) -> SamplingParams:
        """The engine's `SamplingParams` for this request.

        Fields left `None` stay unset: the engine fills them from the model's
        generation config (`SamplingParams.with_defaults`), and a `max_tokens`
        of `None` lets the output run up to the context length.

        Raises:
            ValueError: for out-of-range values (the message names the field).
        """
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            # A whole response is sent once, at the end: the engine need not hand
            # back (or detokenize) anything before the request finishes.
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
        )
# --8<-- [end:sampling_fields]


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`.

    `prompt` is a string, a list of strings, a list of token ids or a list of
    token-id lists; every prompt gets `n` choices, numbered prompt-major
    (choice `i * n + j` is completion `j` of prompt `i`), as in vLLM.
    """

    prompt: Prompt
    max_tokens: int | None = 16  # null: up to the context length
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None  # text after the insertion point: not implemented

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported (the model cannot insert text)")
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (each a string or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated as one form: all ids (see _prompt_form)
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """Completions-style logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mini-vllm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
