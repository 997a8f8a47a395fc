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
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mini_vllm.entrypoints.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    random_id,
)
from mini_vllm.entrypoints.serving_engine import (
    OpenAIError,
    OpenAIServing,
    ServerShuttingDown,
    bad_request,
    request_id_of,
    sse_stream,
    token_text,
)
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.tokenizer import NoChatTemplateError

# Arguments of `apply_chat_template` that `chat_template_kwargs` may not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tokenize"})


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
        try:
            params = request.build_sampling_params(request.requested_max_tokens, num_logprobs)
        except ValueError as e:
            raise bad_request(e) from None

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
        chunks = self._chunks(request, request_id, created, outputs)
        if request.stream:
            return StreamingResponse(sse_stream(chunks, request_id_of(raw_request)),
                                     media_type="text/event-stream")
        response = await self._collect(request_id, created, request.n, chunks)
        return JSONResponse(response.model_dump())
    # --8<-- [end:create_chat_completion]

    def render_chat(self, request: ChatCompletionRequest) -> str:
        """The prompt's text: the messages through the chat template (run on the
        worker pool; the text is tokenized with the other prompts' text)."""
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise OpenAIError(400, f"chat_template_kwargs may not set {sorted(reserved)}",
                              param="chat_template_kwargs")
        # OpenAI's newer "developer" role is what chat templates call "system".
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in request.messages]
        try:
            return str(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, tokenize=False,
                **kwargs))
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
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        """The stream's chunks, in the order the module docstring shows.

        The usage chunk comes when a stream asks for it, and always for a whole
        response (`_collect` takes the usage from it).
        """

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
                    if output.text or logprobs is not None:
                        yield chunk(output.index, DeltaMessage(content=output.text),
                                    logprobs=logprobs)
                    if output.finish_reason is not None:
                        unfinished.discard(output.index)
                        yield chunk(output.index, DeltaMessage(),
                                    finish_reason=output.finish_reason,
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
                       chunks: AsyncIterator[ChatCompletionStreamResponse]
                       ) -> ChatCompletionResponse:
        """Join a whole stream of chunks into one response."""
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
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                      choices=choices, usage=usage)
