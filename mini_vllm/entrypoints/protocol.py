"""The OpenAI wire format: pydantic models of requests, responses and errors.

Requests accept and ignore fields they do not know (benchmark clients send
`best_of`, `suffix`, `tools` ...). Sampling fields a request leaves out stay
`None` so that the engine (`SamplingParams.with_defaults`) fills them from the
model's `generation_config.json`, exactly as vLLM does.

Requests are parsed strictly: JSON types are never coerced (`"16"` is not an
integer, `"yes"` not a boolean, `true` not a token id), and every string a
request carries is checked to be valid Unicode (`Text`). A new request field
(structured outputs, tools ...) gets both by declaring its type with these
building blocks on an `OpenAIBaseModel`.
"""

from __future__ import annotations

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
    model_serializer,
    model_validator,
)

from mini_vllm.sampling_params import RequestOutputKind, SamplingParams


def random_id(prefix: str) -> str:
    """A fresh response id such as `cmpl-3f2a...` or `chatcmpl-...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


# --8<-- [start:strict_types]
class OpenAIBaseModel(BaseModel):
    """Base of every request: strict JSON types; unknown fields are accepted and dropped."""

    model_config = ConfigDict(extra="ignore", strict=True)


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

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def build_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (each a string or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated as one form: all ids (see _prompt_form)
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`.

    `max_completion_tokens` wins over the older `max_tokens`; when both are
    left out a reply may run up to the context length.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: JSONObject | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(TopLogprob):
    """Chat-style logprob of one token, with its `top_logprobs` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProb] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a chunk adds to a message; fields left at `None` are not sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
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
