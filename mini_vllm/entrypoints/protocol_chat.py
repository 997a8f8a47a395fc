"""The chat endpoint's wire format: messages, tools, and the replies and chunks.

`POST /v1/chat/completions` takes everything a completions request takes
(`SamplingRequest`, in `protocol.py`) plus a conversation, the tools the model
may call and how it must call them (`tool_choice`); it answers with an
assistant message, or a stream of `DeltaMessage` chunks. The same strict
building blocks (`OpenAIBaseModel`, `Text`, `JSONObject`) check every field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from mini_vllm.entrypoints.protocol import (
    JSONObject,
    OpenAIBaseModel,
    SamplingRequest,
    Text,
    UsageInfo,
)
from mini_vllm.structured_output.params import StructuredOutputsParams
from mini_vllm.tool_parsers.tool_choice import tool_choice_structured_outputs

# ----------------------------------------------------------------------------- requests


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: Text


class FunctionCallText(OpenAIBaseModel):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(OpenAIBaseModel):
    """A tool call of an earlier assistant message, sent back by the client."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallText


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation; content is a string or a list of text parts.

    An assistant message may carry the `tool_calls` it made (and its
    `reasoning`); a `tool` message answers the call `tool_call_id`.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (OpenAI's "developer" is "system")."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        for key in ("name", "tool_call_id", "reasoning", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# --8<-- [start:tools]
class FunctionDefinition(OpenAIBaseModel):
    name: Text
    description: Text | None = None
    parameters: JSONObject | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of `tools`: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: Text


class NamedToolChoice(OpenAIBaseModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
# --8<-- [end:tools]


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
    tools: list[ChatCompletionToolsParam] | None = Field(default=None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true")
        return self

    # --8<-- [start:tool_choice]
    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice: str | NamedToolChoice | None,
                                 info: ValidationInfo) -> str | NamedToolChoice | None:
        if choice is None:
            return choice
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("tool_choice can only be set together with tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in tools}:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is "
                             "not in tools")
        fmt = info.data.get("response_format")
        if choice not in ("none", "auto") and (
                info.data.get("structured_outputs") is not None
                or (fmt is not None and fmt.type != "text")):
            raise ValueError("a required or named tool_choice constrains the output itself: "
                             "it cannot be combined with response_format or structured_outputs")
        return choice

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """`tool_choice`, defaulting as OpenAI's does: "auto" with tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """As for completions, or with a required or named `tool_choice` the grammar
        of its calls (`tool_parsers/tool_choice.py`)."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return super().structured_outputs_params()
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        named = choice if isinstance(choice, str) else choice.model_dump()
        parallel = self.parallel_tool_calls is not False
        return tool_choice_structured_outputs(tools, named, parallel), "tools"
    # --8<-- [end:tool_choice]

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ----------------------------------------------------------------------------- responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(TopLogprob):
    """Chat-style logprob of one token, with its `top_logprobs` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProb] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    """A tool call the model made (`message.tool_calls[i]`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's message. With a reasoning parser the reasoning comes apart
    (`reasoning`, and `reasoning_content` for older clients); with tools, the
    calls it made (`content` is then `None` when nothing else was written)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
    """What a chunk adds to a message; fields left at `None` are not sent.

    `tool_calls` holds OpenAI's streamed pieces of calls (`DeltaToolCall.to_openai`).
    """

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k in ("role", "content", "reasoning", "reasoning_content", "tool_calls")
                if (v := getattr(self, k)) is not None}


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
