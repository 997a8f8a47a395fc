"""The OpenAI-compatible HTTP server: a FastAPI app around an `AsyncLLM`.

```
client ──HTTP──► uvicorn (event loop) ──► route ──► OpenAIServing* ──► AsyncLLM.generate
                                                                           │ queue
                                               engine thread: step() ◄─────┘
```

`build_app(engine)` makes the app; `serve(engine, host, port)` runs it under
uvicorn until SIGINT/SIGTERM. Every error leaves as OpenAI's error body; a
bug in one request is a 500 for that request only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import mini_vllm
from mini_vllm.engine.async_engine import AsyncLLM, EngineDeadError
from mini_vllm.entrypoints.metrics import ServerMetrics
from mini_vllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from mini_vllm.entrypoints.serving_chat import OpenAIServingChat
from mini_vllm.entrypoints.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.serving_engine import (
    ClientDisconnected,
    OpenAIError,
    OpenAIServing,
    error_from_exception,
    error_response,
)

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for open connections after a shutdown signal. Streams
# end (with finish_reason "abort") as soon as the signal arrives, so this is
# only a backstop for clients that never read their last bytes.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_response(status, message, param).model_dump(), status_code=status)


# --8<-- [start:validation_error]
def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending field for FastAPI's validation errors."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union (e.g. `prompt`) reports one error per member: name only the field.
    field = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), field
# --8<-- [end:validation_error]


def _install_error_handlers(app: FastAPI) -> None:
    """Turn every error into OpenAI's error body (FastAPI's 422 becomes a 400)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
        error = error_from_exception(exc)
        return _error(error.status, error.message)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening any more

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Response:
        # Starlette logs the traceback after this response is sent; the server
        # keeps serving.
        error = error_from_exception(exc)
        return _error(error.status, error.message)


# --8<-- [start:build_app]
def build_app(engine: AsyncLLM, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncLLM`).

    Args:
        engine: a started `AsyncLLM`; the app shuts it down when the app stops.
        served_model_name: the name clients pass as `model`; defaults to the
            engine's `served_model_name`, else its model directory.
    """
    config = engine.engine_config
    model_name = served_model_name or config.served_model_name or str(config.model)
    metrics = ServerMetrics(engine.get_stats, model_name)
    shutdown = asyncio.Event()  # binds to the server's loop on first use
    shared = (engine, model_name, metrics, shutdown)
    models = OpenAIServing(*shared)
    completions = OpenAIServingCompletion(*shared)
    chat = OpenAIServingChat(*shared)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        shutdown.set()
        engine.shutdown()

    app = FastAPI(title="mini-vllm", version=mini_vllm.__version__, lifespan=lifespan)
    app.state.shutdown = shutdown
    app.state.model_name = model_name
    app.state.metrics = metrics
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.get("/v1/models")
    async def show_models() -> Response:
        return JSONResponse(models.model_list().model_dump())

    @app.get("/health")
    async def health() -> Response:
        alive = engine.is_running and not engine.errored and not shutdown.is_set()
        return Response(status_code=200 if alive else 503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": mini_vllm.__version__})

    @app.get("/stats")
    async def stats() -> Response:
        return JSONResponse(engine.get_stats())

    @app.get("/metrics")
    async def show_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
# --8<-- [end:build_app]


# --8<-- [start:server]
class OpenAIServer(uvicorn.Server):
    """uvicorn's server, which also ends in-flight generations when told to exit.

    On SIGINT/SIGTERM uvicorn stops accepting connections and waits for the
    open ones; setting the app's shutdown event first makes every running
    request finish at once with `finish_reason: "abort"` (streams still get
    their last chunks and `[DONE]`), so that wait is short.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._app.state.shutdown.set)
# --8<-- [end:server]


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                access_log: bool = True) -> OpenAIServer:
    """A uvicorn server for `app` (call `.run()` to serve until told to exit)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S)
    return OpenAIServer(config, app)
