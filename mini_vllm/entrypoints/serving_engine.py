"""What completions and chat share: errors, the model check, and running prompts.

A request of the OpenAI API becomes one or more engine requests (one per
prompt; each makes `n` choices). `OpenAIServing.generate` submits them all and
merges their delta outputs into one stream, while watching two things that
end a request early:

```
 engine.generate(p0) ──► pump ─┐
 engine.generate(p1) ──► pump ─┤
 client disconnect ─► watcher ─┼─► queue ─► merged (prompt index, RequestOutput)
 server shutdown   ─► watcher ─┘
```

A disconnect or a shutdown cancels the pumps; cancelling the task that
consumes `engine.generate` is what aborts an engine request and frees its KV
blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from mini_vllm.engine.async_engine import AsyncLLM, EngineDeadError
from mini_vllm.entrypoints.metrics import ServerMetrics
from mini_vllm.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from mini_vllm.outputs import Logprob, RequestOutput
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from mini_vllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Fields an engine or SamplingParams error message may name (see `bad_request`).
_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields)


class OpenAIError(Exception):
    """An error the API reports to the client as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests have been aborted."""


class ServerShuttingDown(Exception):
    """The server was asked to exit; unfinished requests end with `abort`."""


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def bad_request(exc: ValueError) -> OpenAIError:
    """A 400 for a `ValueError` of our validation.

    The engine's and `SamplingParams`' messages start with the field they are
    about (`"temperature must be >= 0 ..."`, `"prompt: ..."`); when that is a
    request field it becomes the error's `param`.
    """
    message = str(exc)
    first = message.replace(":", " ").split(" ", 1)[0]
    return OpenAIError(400, message, param=first if first in _REQUEST_FIELDS else None)


def error_response(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The OpenAI error body for an HTTP status."""
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))


def error_from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAI error an engine-side exception becomes."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {exc}")
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}")


def sse(payload: BaseModel | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# --8<-- [start:sse_stream]
async def sse_stream(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events for a stream of chunks, ending with `data: [DONE]`.

    An error after the stream has started cannot change the HTTP status any
    more: it goes out as one `data: {"error": ...}` event before `[DONE]`.
    A client that left gets nothing more.
    """
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except ClientDisconnected:
        return
    except Exception as e:
        error = error_from_exception(e)
        if error.status >= 500:
            logger.exception("error in the middle of a stream")
        yield sse(error_response(error.status, error.message, error.param))
    yield SSE_DONE
# --8<-- [end:sse_stream]


def token_text(tokenizer: Tokenizer, token_id: int, logprob: Logprob | dict[int, Logprob]) -> str:
    """The text of a token in a logprobs entry (decoded by the engine, else here)."""
    if isinstance(logprob, dict):
        logprob = logprob.get(token_id)  # type: ignore[assignment]
    if isinstance(logprob, Logprob) and logprob.decoded_token:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


_END = object()  # a pump's last item: its engine stream is done


class OpenAIServing:
    """State and helpers every endpoint shares.

    Args:
        engine: the engine the requests run on.
        model_name: the name clients must use in `model` (or leave out).
        metrics: the app's metrics.
        shutdown: set when the server has been asked to exit.
    """

    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics,
                 shutdown: asyncio.Event) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.shutdown = shutdown
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.engine_config.scheduler_config.max_model_len

    def check_model(self, model: str | None) -> None:
        """Raise a 404 unless `model` is the served model (or left out)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                              f"`{self.model_name}`.", param="model")

    def model_list(self) -> ModelList:
        card = ModelCard(id=self.model_name, created=int(time.time()),
                         root=str(self.engine.engine_config.model),
                         max_model_len=self.max_model_len)
        return ModelList(data=[card])

    # --8<-- [start:generate]
    async def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        request_id: str,
        raw_request: Request,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit every prompt and wait until each has produced its first output.

        Waiting for the first outputs lets a request the engine refuses (empty
        prompt, token ids outside the vocabulary, too long for the context)
        become a 400 before any byte of a stream has gone out. A request that
        is not streamed is final-only (`build_sampling_params`): its first
        output is its last.

        Returns:
            An iterator over `(prompt index, delta RequestOutput)`, starting
            with the outputs already received.

        Raises:
            OpenAIError: 400 when the engine refuses a prompt, 503 when the
                server is shutting down.
            ClientDisconnected: when the client left while waiting.
        """
        merged = self._merge(prompts, params, request_id, raw_request)
        first: list[tuple[int, RequestOutput]] = []
        waiting = set(range(len(prompts)))
        # An exception out of `anext` has already ended `merged` (and run its
        # `finally`, which cancels the other prompts).
        try:
            while waiting:
                index, output = await anext(merged)
                first.append((index, output))
                waiting.discard(index)
        except ValueError as e:
            raise bad_request(e) from None
        except ServerShuttingDown:
            raise OpenAIError(503, "the server is shutting down") from None
        return _prepend(first, merged)

    async def _merge(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        request_id: str,
        raw_request: Request,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int, prompt: str | list[int]) -> None:
            timer = self.metrics.track(
                params.n, params.output_kind == RequestOutputKind.FINAL_ONLY)
            try:
                async for output in self.engine.generate(prompt, params, f"{request_id}-{index}"):
                    timer.observe(output)
                    queue.put_nowait((index, output))
                queue.put_nowait((index, _END))
            except asyncio.CancelledError:
                timer.abort()
                raise
            except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
                queue.put_nowait((index, e))

        async def watch_disconnect() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait((-1, ClientDisconnected()))

        async def watch_shutdown() -> None:
            await self.shutdown.wait()
            queue.put_nowait((-1, ServerShuttingDown()))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        watchers = [asyncio.create_task(watch_disconnect()), asyncio.create_task(watch_shutdown())]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            # Cancelling a pump cancels its `engine.generate`, which aborts the
            # engine request. Finished pumps ignore the cancel.
            for task in tasks + watchers:
                task.cancel()
            await asyncio.gather(*tasks, *watchers, return_exceptions=True)
    # --8<-- [end:generate]


async def _prepend(
    first: list[tuple[int, RequestOutput]], rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`first`, then the rest; closing this closes `rest` (which aborts what still runs)."""
    try:
        for item in first:
            yield item
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
