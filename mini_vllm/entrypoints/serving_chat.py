"""`POST /v1/chat/completions`: messages in, an assistant reply out.

The messages go through the model's chat template (with the request's
`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) into token ids; from
there a chat request is a completions request with one prompt. A stream of
`n` choices looks like this:

```
data: {choices: [{index: 0, delta: {role: "assistant", content: ""}}]}   one per choice
data: {choices: [{index: 0, delta: {content: "Hel"}}]}                   content deltas
data: {choices: [{index: 0, delta: {content: "lo"}}]}
data: {choices: [{index: 0, delta: {}, finish_reason: "stop"}]}          one per choice
data: {choices: [], usage: {...}}                          with include_usage only
data: [DONE]
```

With a reasoning parser or tools (chapter 18) a delta may carry `reasoning`
(and `reasoning_content`) or `tool_calls` instead of `content`, and a choice
that called a tool ends with `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mini_vllm.delta import DeltaMessage as ParsedDelta
from mini_vllm.entrypoints.errors import OpenAIError, ServerShuttingDown
from mini_vllm.entrypoints.output_parsers import ChoiceParser, ParsedMessage
from mini_vllm.entrypoints.protocol import UsageInfo, random_id
from mini_vllm.entrypoints.protocol_chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from mini_vllm.entrypoints.serving_engine import (
    OpenAIServing,
    request_id_of,
    sse_stream,
    token_text,
)
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from mini_vllm.tokenizer import NoChatTemplateError
from mini_vllm.tool_parsers import TOOL_PARSERS, HermesToolParser

# Arguments of `apply_chat_template` that `chat_template_kwargs` may not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "tools"})


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint."""

    # --8<-- [start:create_chat_completion]
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Serve one chat completions request.

        Raises:
            OpenAIError: 400 for an invalid request, 404 for an unknown model,
                503 when the server is full.
            ClientDisconnected: when the client leaves before the response.
        """
        self.check_model(request.model)
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        self.check_limits(request, 1, num_logprobs)
        self.check_tool_choice(request)
        params = await self.structured_sampling_params(request, request.requested_max_tokens,
                                                       num_logprobs)

        ticket = self.admit(request, 1)
        request_id = random_id("chatcmpl")
        created = int(time.time())
        try:
            text = await self.run_blocking(self.render_chat, request)
            prompt_ids = await self.tokenize([text], params)
            outputs = await self.generate(prompt_ids, params, request_id, raw_request, ticket)
        except BaseException:
            ticket.release()  # (once the stream has started, it releases the ticket itself)
            raise
        parser = self.choice_parser_factory(request, text)
        chunks = self._chunks(request, request_id, created, outputs,
                              parser if request.stream else None)
        if request.stream:
            return StreamingResponse(sse_stream(chunks, request_id_of(raw_request)),
                                     media_type="text/event-stream")
        response = await self._collect(request_id, created, request.n, chunks, parser)
        return JSONResponse(response.model_dump())
    # --8<-- [end:create_chat_completion]

    # --8<-- [start:parsers]
    def check_tool_choice(self, request: ChatCompletionRequest) -> None:
        """Refuse an "auto" tool choice the server was not started for (vLLM's rule).

        Raises:
            OpenAIError: 400 naming `tool_choice`.
        """
        if request.effective_tool_choice == "auto" and not self.args.enable_auto_tool_choice:
            raise OpenAIError(400, 'tool_choice: "auto" (the default with tools) needs the '
                              "server started with --enable-auto-tool-choice and "
                              "--tool-call-parser", param="tool_choice")

    def choice_parser_factory(self, request: ChatCompletionRequest,
                              prompt: str) -> Callable[[], ChoiceParser] | None:
        """What makes each choice's parsers, or None when the text is all content.

        The reasoning is split with the server's `--reasoning-parser`; tool calls
        are parsed with `--tool-call-parser` when the model chose to call
        ("auto"), and as Hermes calls when the request forced them (the grammar
        of `tool_choice_structured_outputs` writes exactly that format).
        """
        reasoning_name = self.engine.engine_config.reasoning_parser
        choice = request.effective_tool_choice
        if choice == "none":
            tools_cls = None
        elif choice == "auto":
            tools_cls = TOOL_PARSERS[self.args.tool_call_parser]
        else:
            tools_cls = HermesToolParser
        if reasoning_name is None and tools_cls is None:
            return None
        kwargs = request.chat_template_kwargs or {}
        thinking = kwargs.get("enable_thinking", True) is not False
        opens = Qwen3ReasoningParser.prompt_ends_in_reasoning(prompt)

        def make() -> ChoiceParser:
            reasoning = None
            if reasoning_name is not None:
                reasoning = REASONING_PARSERS[reasoning_name](
                    self.tokenizer, enable_thinking=thinking, prompt_opens_reasoning=opens)
            return ChoiceParser(reasoning, tools_cls() if tools_cls is not None else None)
        return make
    # --8<-- [end:parsers]

    def render_chat(self, request: ChatCompletionRequest) -> str:
        """The prompt's text: the messages through the chat template (run on the
        worker pool; the text is tokenized with the other prompts' text)."""
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise OpenAIError(400, f"chat_template_kwargs may not set {sorted(reserved)}",
                              param="chat_template_kwargs")
        messages = [m.for_template() for m in request.messages]
        # The functions go into the system turn, unless the model may not call them.
        tools = None
        if request.tools and request.effective_tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
        try:
            return str(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, tokenize=False,
                tools=tools, **kwargs))
        except NoChatTemplateError as e:  # a model without one (GPT-2)
            raise OpenAIError(400, str(e), param="messages") from None
        except (jinja2.TemplateError, ValueError) as e:
            raise OpenAIError(400, f"the chat template refused the messages: {e}",
                              param="messages") from None

    async def _chunks(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        make_parser: Callable[[], ChoiceParser] | None = None,
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        """The stream's chunks, in the order the module docstring shows.

        With `make_parser`, each choice's text goes through its own parsers, and
        its deltas carry reasoning and tool calls apart from the content; a
        choice that called a tool ends with `finish_reason` "tool_calls".
        The usage chunk comes when a stream asks for it, and always for a whole
        response (`_collect` takes the usage from it).
        """
        parsers = [make_parser() for _ in range(request.n)] if make_parser else None

        def chunk(index: int, delta: DeltaMessage, **fields: object) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name,
                choices=[ChatCompletionStreamChoice(index=index, delta=delta, **fields)])

        for index in range(request.n):
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        unfinished = set(range(request.n))
        prompt_tokens = completion_tokens = 0
        try:
            async for _, result in outputs:
                prompt_tokens = len(result.prompt_token_ids)
                for output in result.outputs:
                    completion_tokens += len(output.token_ids)
                    logprobs = self._logprobs(output, request.top_logprobs or 0)
                    finish_reason = output.finish_reason
                    if parsers is None:
                        delta = DeltaMessage(content=output.text)
                        sends = bool(output.text)
                    else:
                        parser = parsers[output.index]
                        parsed = parser.parse_stream(output.text, final=finish_reason is not None)
                        if parser.tools_called and finish_reason == "stop":
                            finish_reason = "tool_calls"
                        delta, sends = _delta(parsed), bool(parsed)
                    if sends or logprobs is not None:
                        yield chunk(output.index, delta, logprobs=logprobs)
                    if finish_reason is not None:
                        unfinished.discard(output.index)
                        yield chunk(output.index, DeltaMessage(), finish_reason=finish_reason,
                                    stop_reason=output.stop_reason)
        except ServerShuttingDown:
            for index in sorted(unfinished):
                yield chunk(index, DeltaMessage(), finish_reason="abort")
        if request.include_usage or not request.stream:
            yield ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=[],
                usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens))

    def _logprobs(self, output: CompletionOutput, num_top: int) -> ChatCompletionLogProbs | None:
        """Chat-format logprobs of one delta's tokens (None when none were asked for)."""
        if not output.logprobs:
            return None
        content = []
        for token_id, entry in zip(output.token_ids, output.logprobs):
            token = token_text(self.tokenizer, token_id, entry)
            top = [
                TopLogprob(token=(t := token_text(self.tokenizer, i, lp)), logprob=lp.logprob,
                           bytes=list(t.encode()))
                for i, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                if lp.rank <= num_top
            ]
            sampled = entry.get(token_id)
            content.append(ChatCompletionLogProb(
                token=token, logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list(token.encode()), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    async def _collect(self, request_id: str, created: int, n: int,
                       chunks: AsyncIterator[ChatCompletionStreamResponse],
                       make_parser: Callable[[], ChoiceParser] | None = None
                       ) -> ChatCompletionResponse:
        """Join a whole stream of chunks into one response; with `make_parser`, each
        choice's whole text is then split into reasoning, content and tool calls."""
        texts: list[list[str]] = [[] for _ in range(n)]
        choices = [ChatCompletionResponseChoice(index=i, message=ChatResponseMessage(content=""))
                   for i in range(n)]
        usage = UsageInfo()
        async for chunk in chunks:
            usage = chunk.usage or usage
            for delta in chunk.choices:
                choice = choices[delta.index]
                texts[delta.index].append(delta.delta.content or "")
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
                if delta.logprobs is not None and delta.logprobs.content is not None:
                    if choice.logprobs is None:
                        choice.logprobs = ChatCompletionLogProbs(content=[])
                    choice.logprobs.content.extend(delta.logprobs.content)  # type: ignore[union-attr]
        for choice, pieces in zip(choices, texts):
            choice.message.content = "".join(pieces)
            if make_parser is not None:
                _fill_message(choice, make_parser().parse_whole(choice.message.content))
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                      choices=choices, usage=usage)


def _delta(parsed: ParsedDelta) -> DeltaMessage:
    """The wire delta of what the parsers decided (only the parts that have something)."""
    return DeltaMessage(
        content=parsed.content or None,
        reasoning=parsed.reasoning or None, reasoning_content=parsed.reasoning or None,
        tool_calls=[call.to_openai() for call in parsed.tool_calls] or None)


def _fill_message(choice: ChatCompletionResponseChoice, parsed: ParsedMessage) -> None:
    """Put a parsed answer into a response choice ("tool_calls" when it called one)."""
    message = choice.message
    message.content = parsed.content
    message.reasoning = message.reasoning_content = parsed.reasoning
    message.tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name,
                                                                  arguments=c.arguments))
                          for c in parsed.tool_calls]
    if message.tool_calls and choice.finish_reason == "stop":
        choice.finish_reason = "tool_calls"
