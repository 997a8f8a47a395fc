"""What completions and chat share: limits, tokenizing, SSE, and running prompts.

A request of the OpenAI API becomes one or more engine requests: its
`prompts x n` sequences are split into units (`admission.split_units`), each
one engine request. `OpenAIServing.generate` submits them (the first at once,
the rest through the fair gate) and merges their delta outputs into one
stream, while watching two things that end a request early:

```
 engine.generate(unit 0) ──► pump ─┐
 engine.generate(unit 1) ──► pump ─┤  (unit 1.. wait for the fair gate first)
 client disconnect ─► watcher ─────┼─► queue ─► merged (unit, RequestOutput)
 server shutdown   ─► watcher ─────┘
```

A disconnect or a shutdown cancels the pumps; cancelling the task that
consumes `engine.generate` is what aborts an engine request and frees its KV
blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from mini_vllm.engine.async_engine import AsyncLLM
from mini_vllm.entrypoints.admission import Admission, ServerBusy, Ticket, Unit, split_units
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.errors import (
    ClientDisconnected,
    OpenAIError,
    ServerShuttingDown,
    bad_request,
    error_from_exception,
    error_response,
)
from mini_vllm.entrypoints.metrics import ServerMetrics
from mini_vllm.entrypoints.protocol import ModelCard, ModelList, SamplingRequest
from mini_vllm.entrypoints.protocol_chat import ChatCompletionRequest
from mini_vllm.outputs import Logprob, RequestOutput
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from mini_vllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def sse(payload: BaseModel | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# --8<-- [start:sse_stream]
async def sse_stream(chunks: AsyncIterator[BaseModel], request_id: str) -> AsyncIterator[str]:
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
        error = error_from_exception(e, request_id)
        if error.status >= 500:
            logger.exception("request %s failed in the middle of its stream", request_id)
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


def request_id_of(raw_request: Request) -> str:
    """The id the server gave this HTTP request (`X-Request-Id`; see `middleware.py`)."""
    return getattr(raw_request.state, "request_id", "unknown")


_END = object()  # a pump's last item: its engine stream is done


@dataclasses.dataclass
class ServingContext:
    """What every endpoint shares: the engine, the served name, the server's state.

    Attributes:
        engine: the engine the requests run on.
        model_name: the name clients must use in `model` (or leave out).
        metrics: the app's metrics.
        shutdown: set when the server has been asked to exit.
        args: the front's settings (limits among them).
        admission: the bound on work in flight and the fair gate.
        pool: the worker threads that render chat templates and tokenize.
    """

    engine: AsyncLLM
    model_name: str
    metrics: ServerMetrics
    shutdown: asyncio.Event
    args: FrontendArgs
    admission: Admission
    pool: Executor


class OpenAIServing:
    """State and helpers every endpoint shares.

    Args:
        context: the engine and the server's shared state.
    """

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.engine = context.engine
        self.model_name = context.model_name
        self.metrics = context.metrics
        self.shutdown = context.shutdown
        self.args = context.args
        self.admission = context.admission
        self.tokenizer = context.engine.tokenizer
        config = context.engine.engine_config
        self.max_model_len: int = config.scheduler_config.max_model_len
        self.vocab_size: int = config.model_config.vocab_size

    def check_model(self, model: str | None) -> None:
        """Raise a 404 unless `model` is the served model (or left out)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                              f"`{self.model_name}`.", param="model")

    def model_list(self) -> ModelList:
        card = ModelCard(id=self.model_name, created=int(time.time()), root=self.model_name,
                         max_model_len=self.max_model_len)
        return ModelList(data=[card])

    # --8<-- [start:check_limits]
    def check_limits(self, request: SamplingRequest, num_prompts: int,
                     num_logprobs: int | None) -> None:
        """Refuse a request over the server's limits, before anything is built for it.

        Raises:
            OpenAIError: 400 naming the field.
        """
        args = self.args
        if request.n > args.max_n_sequences:
            raise OpenAIError(400, f"n must be at most {args.max_n_sequences}, got {request.n}",
                              param="n")
        if num_prompts > args.max_completion_prompts:
            raise OpenAIError(400, f"prompt: at most {args.max_completion_prompts} prompts in "
                              f"one request, got {num_prompts}", param="prompt")
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > args.max_stop_strings:
            raise OpenAIError(400, f"stop: at most {args.max_stop_strings} stop strings, got "
                              f"{len(stops)}", param="stop")
        if any(len(stop) > args.max_stop_string_len for stop in stops):
            raise OpenAIError(400, f"stop: a stop string may have at most "
                              f"{args.max_stop_string_len} characters", param="stop")
        if num_logprobs is not None and num_logprobs > args.max_logprobs:
            param = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
            raise OpenAIError(400, f"{param} must be at most {args.max_logprobs}, got "
                              f"{num_logprobs}", param=param)
        # Completion j of a seeded prompt is seeded with seed + j (chapter 6).
        if request.seed is not None and request.seed + request.n - 1 >= 2**64:
            raise OpenAIError(400, f"seed: completion j is seeded with seed + j, which must fit "
                              f"in 64 bits; with n = {request.n} seed must be below "
                              f"{2**64 - request.n + 1}", param="seed")
    # --8<-- [end:check_limits]

    def admit(self, request: SamplingRequest, num_prompts: int) -> Ticket:
        """Room for the request's `prompts x n` sequences (see `admission.py`).

        Raises:
            OpenAIError: 400 when it can never fit, 503 (with `Retry-After`) when
                the server is full now.
        """
        try:
            return self.admission.admit(num_prompts * request.n)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="n") from None
        except ServerBusy as e:
            raise error_from_exception(e) from None

    # --8<-- [start:compile_structured_output]
    async def structured_sampling_params(self, request: SamplingRequest, max_tokens: int | None,
                                         logprobs: int | None) -> SamplingParams:
        """The request's `SamplingParams`, its structured output compiled (chapter 18).

        The grammar compiles on the grammar engine's worker threads while the
        event loop goes on serving; once compiled it is cached, and the engine
        finds it there. So an invalid schema, regex or grammar, or one that
        takes longer than the bound to compile, is a 400 before the request
        takes any room in the server.

        Raises:
            OpenAIError: 400 naming the field the constraint came from.
        """
        try:
            spec, field = request.structured_outputs_params()
            params = request.build_sampling_params(max_tokens, logprobs, spec)
        except ValueError as e:
            raise bad_request(e) from None
        if spec is None:
            return params
        try:
            await self.engine.compile_structured_output(params)
        except ValueError as e:
            message = str(e)
            if field != "structured_outputs":  # the client sent `field`, not our spec
                message = f"{field}: {message.split(': ', 1)[-1]}"
            raise OpenAIError(400, message, param=field) from None
        return params
    # --8<-- [end:compile_structured_output]

    async def run_blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the worker pool, so the event loop goes on serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.context.pool, fn, *args)

    # --8<-- [start:tokenize]
    async def tokenize(self, prompts: Sequence[str | list[int]],
                       params: SamplingParams) -> list[list[int]]:
        """Every prompt as token ids, checked against the context length.

        Text is tokenized on the worker pool with `encode_batch`, which lets go
        of the GIL while the Rust tokenizer works: the event loop (and so
        `/health`, and every other stream) does not wait for a large prompt.

        Raises:
            OpenAIError: 400 naming the prompt that is empty, too long, or has a
                token id outside the vocabulary.
        """
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.run_blocking(self.tokenizer.encode_batch, texts) if texts
                       else [])
        token_ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
        for ids in token_ids:
            self._check_prompt(ids, params)
        return token_ids
    # --8<-- [end:tokenize]

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks of a prompt (`InputProcessor.process_inputs`), done
        here first so that no prompt of a request reaches the engine when one is bad."""
        if not ids:
            raise OpenAIError(400, "prompt: the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise OpenAIError(400, f"prompt: {len(ids)} tokens do not fit the model's context "
                              f"length ({self.max_model_len}), which must also hold at least "
                              "one output token", param="prompt")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise OpenAIError(400, f"prompt: token id {bad} is outside the vocabulary "
                              f"[0, {self.vocab_size})", param="prompt")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise OpenAIError(400, f"max_tokens: {len(ids)} prompt tokens + max_tokens "
                              f"{params.max_tokens} = {len(ids) + params.max_tokens} is more "
                              f"than the model's context length ({self.max_model_len})",
                              param="max_tokens")

    # --8<-- [start:generate]
    async def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        request_id: str,
        raw_request: Request,
        ticket: Ticket,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit the request's units and wait until the first has produced an output.

        Waiting for the first output lets a request the engine refuses become
        a 400 before any byte of a stream has gone out. A request that is not
        streamed is final-only (`build_sampling_params`): its first output is
        its last. The outputs' choice indices are the request's (`index`
        within its prompt's `n`), whatever unit computed them.

        Args:
            ticket: the request's admission; released when its last unit ends.

        Returns:
            An iterator over `(prompt index, delta RequestOutput)`, starting
            with the outputs already received.

        Raises:
            OpenAIError: 400 when the engine refuses the request, 503 when the
                server is shutting down.
            ClientDisconnected: when the client left while waiting.
        """
        units = split_units(len(prompts), params.n, self.admission.unit_seqs,
                            self.admission.first_unit_seqs)
        merged = self._merge(prompts, units, params, request_id, raw_request, ticket)
        first: list[tuple[Unit, RequestOutput]] = []
        # An exception out of `anext` has already ended `merged` (and run its
        # `finally`, which cancels the other units).
        try:
            while not any(unit.rank == 0 for unit, _ in first):
                first.append(await anext(merged))
        except ServerShuttingDown:
            raise OpenAIError(503, "the server is shutting down") from None
        return _by_prompt(first, merged)

    async def _merge(
        self,
        prompts: Sequence[list[int]],
        units: list[Unit],
        params: SamplingParams,
        request_id: str,
        raw_request: Request,
        ticket: Ticket,
    ) -> AsyncIterator[tuple[Unit, RequestOutput]]:
        queue: asyncio.Queue[tuple[Unit | None, Any]] = asyncio.Queue()
        gate = self.admission.bulk

        async def pump(index: int, unit: Unit) -> None:
            unit_params = params if unit.n == params.n else params.replace(
                n=unit.n, seed=None if params.seed is None else params.seed + unit.first_choice)
            if unit.rank:  # the bulk of a big request takes turns with other requests' bulk
                await gate.acquire(unit.n, unit.rank)
            timer = self.metrics.track(
                unit.n, params.output_kind == RequestOutputKind.FINAL_ONLY)
            try:
                async for output in self.engine.generate(
                        prompts[unit.prompt_index], unit_params, f"{request_id}-{index}",
                        priority=unit.rank):
                    timer.observe(output)
                    if unit.first_choice:
                        output.outputs = [dataclasses.replace(c, index=c.index + unit.first_choice)
                                          for c in output.outputs]
                    queue.put_nowait((unit, output))
                queue.put_nowait((unit, _END))
            except asyncio.CancelledError:
                timer.abort()
                raise
            except ValueError as e:  # refused by the engine: the client's fault
                queue.put_nowait((unit, bad_request(e)))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
                queue.put_nowait((unit, e))
            finally:
                if unit.rank:
                    gate.release(unit.n)

        async def watch_disconnect() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait((None, ClientDisconnected()))

        async def watch_shutdown() -> None:
            await self.shutdown.wait()
            queue.put_nowait((None, ServerShuttingDown()))

        tasks = [asyncio.create_task(pump(i, unit)) for i, unit in enumerate(units)]
        watchers = [asyncio.create_task(watch_disconnect()), asyncio.create_task(watch_shutdown())]
        try:
            running = len(tasks)
            while running:
                unit, item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield unit, item  # type: ignore[misc]
        finally:
            # Cancelling a pump cancels its `engine.generate`, which aborts the
            # engine request (or its wait at the gate). Finished pumps ignore it.
            # Nothing here may come after an await: when a stream's client has
            # left, the server cancels this task again at every await.
            ticket.release()
            for task in tasks + watchers:
                task.cancel()
            await asyncio.gather(*tasks, *watchers, return_exceptions=True)
    # --8<-- [end:generate]


async def _by_prompt(
    first: list[tuple[Unit, RequestOutput]], rest: AsyncIterator[tuple[Unit, RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`first`, then the rest, by prompt index; closing this closes `rest` (which
    aborts what still runs)."""
    try:
        for unit, output in first:
            yield unit.prompt_index, output
        async for unit, output in rest:
            yield unit.prompt_index, output
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
