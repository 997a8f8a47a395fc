"""`POST /v1/completions`: prompts in, text completions out (whole or streamed).

One API request with `P` prompts and `n` choices per prompt is `P` engine
requests; the engine returns completion `j` of prompt `i` as
`CompletionOutput(index=j)`, which becomes choice `i * n + j`:

```
prompts  [p0, p1], n = 2     choices  0: p0/j0   1: p0/j1   2: p1/j0   3: p1/j1
```
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mini_vllm.entrypoints.errors import OpenAIError, ServerShuttingDown
from mini_vllm.entrypoints.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from mini_vllm.entrypoints.serving_engine import (
    OpenAIServing,
    request_id_of,
    sse_stream,
    token_text,
)
from mini_vllm.outputs import CompletionOutput, RequestOutput


@dataclass
class _ChoiceState:
    echo: str | None  # prompt text still to be sent before the first delta
    offset: int = 0  # text_offset of the next token: echo + earlier tokens' text, as vLLM
    num_tokens: int = 0
    finished: bool = False


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

    # --8<-- [start:create_completion]
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Serve one completions request.

        Raises:
            OpenAIError: 400 for an invalid request, 404 for an unknown model,
                503 when the server is full.
            ClientDisconnected: when the client leaves before the response.
        """
        self.check_model(request.model)
        prompts = request.prompts()
        if not prompts:  # the engine refuses each empty prompt itself
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        self.check_limits(request, len(prompts), request.logprobs)
        params = await self.structured_sampling_params(request, request.max_tokens,
                                                       request.logprobs)

        ticket = self.admit(request, len(prompts))
        request_id = random_id("cmpl")
        created = int(time.time())
        try:
            prompt_ids = await self.tokenize(prompts, params)
            outputs = await self.generate(prompt_ids, params, request_id, raw_request, ticket)
        except BaseException:
            ticket.release()  # (once the stream has started, it releases the ticket itself)
            raise
        chunks = self._chunks(request, prompts, request_id, created, outputs)
        if request.stream:
            return StreamingResponse(sse_stream(chunks, request_id_of(raw_request)),
                                     media_type="text/event-stream")
        return JSONResponse(
            (await self._collect(request_id, created, len(prompts) * request.n, chunks))
            .model_dump())
    # --8<-- [end:create_completion]

    async def _chunks(
        self,
        request: CompletionRequest,
        prompts: list[str | list[int]],
        request_id: str,
        created: int,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[CompletionStreamResponse]:
        """The stream's chunks: one per choice delta, then the usage chunk.

        The usage chunk comes when a stream asks for it, and always for a whole
        response (`_collect` takes the usage from it). On a server shutdown
        every unfinished choice ends with `abort`.
        """
        n = request.n
        states = []
        for prompt in prompts:
            echo = None
            if request.echo:
                echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
            states.extend(_ChoiceState(echo=echo) for _ in range(n))
        prompt_tokens = [0] * len(prompts)

        def chunk(choice: CompletionResponseChoice) -> CompletionStreamResponse:
            return CompletionStreamResponse(id=request_id, created=created,
                                            model=self.model_name, choices=[choice])

        try:
            async for prompt_index, result in outputs:
                prompt_tokens[prompt_index] = len(result.prompt_token_ids)
                for output in result.outputs:
                    choice = self._delta_choice(states[prompt_index * n + output.index],
                                                prompt_index * n + output.index,
                                                output, request.logprobs)
                    if choice is not None:
                        yield chunk(choice)
        except ServerShuttingDown:
            for index, state in enumerate(states):
                if not state.finished:
                    state.finished = True
                    yield chunk(CompletionResponseChoice(index=index, text="",
                                                         finish_reason="abort"))
        if request.include_usage or not request.stream:
            completion_tokens = sum(s.num_tokens for s in states)
            yield CompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=[],
                usage=UsageInfo(prompt_tokens=sum(prompt_tokens),
                                completion_tokens=completion_tokens,
                                total_tokens=sum(prompt_tokens) + completion_tokens))

    def _delta_choice(self, state: _ChoiceState, index: int, output: CompletionOutput,
                      num_logprobs: int | None) -> CompletionResponseChoice | None:
        """The choice chunk for one delta, or None when it adds nothing."""
        text = output.text
        if state.echo is not None:
            text = state.echo + text
            state.offset, state.echo = len(state.echo), None
        logprobs = None
        if num_logprobs is not None and output.logprobs:
            logprobs = CompletionLogProbs()
            for token_id, entry in zip(output.token_ids, output.logprobs):
                token = token_text(self.tokenizer, token_id, entry)
                logprobs.tokens.append(token)
                logprobs.token_logprobs.append(entry[token_id].logprob if token_id in entry
                                               else None)
                logprobs.top_logprobs.append({
                    token_text(self.tokenizer, i, lp): lp.logprob
                    for i, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                    if lp.rank <= num_logprobs
                } if num_logprobs else None)
                logprobs.text_offset.append(state.offset)
                state.offset += len(token)
        state.num_tokens += len(output.token_ids)
        state.finished = output.finish_reason is not None
        if not text and logprobs is None and not state.finished:
            return None
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=output.finish_reason,
                                        stop_reason=output.stop_reason)

    async def _collect(self, request_id: str, created: int, num_choices: int,
                       chunks: AsyncIterator[CompletionStreamResponse]) -> CompletionResponse:
        """Join a whole stream of chunks into one response."""
        choices = [CompletionResponseChoice(index=i, text="") for i in range(num_choices)]
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        usage = UsageInfo()
        async for chunk in chunks:
            usage = chunk.usage or usage
            for delta in chunk.choices:
                choice = choices[delta.index]
                texts[delta.index].append(delta.text)
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
                if delta.logprobs is not None:
                    if choice.logprobs is None:
                        choice.logprobs = CompletionLogProbs()
                    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(choice.logprobs, field).extend(getattr(delta.logprobs, field))
        for choice, pieces in zip(choices, texts):
            choice.text = "".join(pieces)
        return CompletionResponse(id=request_id, created=created, model=self.model_name,
                                  choices=choices, usage=usage)
