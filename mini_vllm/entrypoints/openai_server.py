"""The OpenAI-compatible HTTP server: a FastAPI app around an `AsyncLLM`.

```
client ──HTTP──► uvicorn (event loop) ──► route ──► OpenAIServing* ──► AsyncLLM.generate
                                                                           │ queue
                                               engine thread: step() ◄─────┘
```

`build_app(engine, args=FrontendArgs(...))` makes the app and `make_server`
the uvicorn server that runs it until SIGINT/SIGTERM. Every error leaves as
OpenAI's error body; a bug in one request is a 500 for that request only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import mini_vllm
from mini_vllm.engine.async_engine import AsyncLLM, EngineDeadError
from mini_vllm.entrypoints.admission import Admission
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.connections import (
    ConnectionGuard,
    GuardedH11Protocol,
    RateLimitedLog,
    rate_limited_exception_handler,
)
from mini_vllm.entrypoints.errors import (
    ClientDisconnected,
    OpenAIError,
    error_from_exception,
    error_json,
)
from mini_vllm.entrypoints.metrics import ServerMetrics
from mini_vllm.entrypoints.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from mini_vllm.entrypoints.protocol import (
    PROMPT_FORMS,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from mini_vllm.entrypoints.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from mini_vllm.entrypoints.serving_chat import OpenAIServingChat
from mini_vllm.entrypoints.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.serving_engine import OpenAIServing, ServingContext, request_id_of

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for open connections after a shutdown signal. Streams
# end (with finish_reason "abort") as soon as the signal arrives, so this is
# only a backstop for clients that never read their last bytes.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5


# Worker threads for chat templates and tokenization: enough that one large
# prompt does not hold up the others, few enough not to starve the engine.
TOKENIZER_WORKERS = 2
# Paths that answer without an API key.
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


# --8<-- [start:json_route]
class _JSONRequest(Request):
    """A request whose JSON body is parsed by orjson.

    Parsing holds the GIL, so while a large body is parsed the event loop
    (`/health`, every stream) waits: orjson does it several times faster than
    the standard library. It refuses lone surrogates, which the standard
    library accepts; such a body is parsed again by the latter, so that
    validation can say which field holds one.
    """

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
            except orjson.JSONDecodeError:
                self._json = json.loads(body)  # a JSONDecodeError here: malformed JSON, a 400
        return self._json


class _JSONRoute(APIRoute):
    """FastAPI's route, reading bodies through `_JSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return handle
# --8<-- [end:json_route]


def _location(loc: tuple[Any, ...]) -> list[str | int]:
    """A validation error's location without pydantic's internal steps: the body
    marker, the form a prompt was parsed as, and a union's member names."""
    return [part for part in loc
            if isinstance(part, int) or (part != "body" and part not in PROMPT_FORMS
                                         and not any(c in part for c in "[(,"))]


# --8<-- [start:validation_error]
def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending field for FastAPI's validation errors."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        first = errors[0]
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    # A union (`stop`: a string or a list) reports one error per member: the one
    # that got furthest into the value says what is wrong.
    first = max(errors, key=lambda e: len(_location(tuple(e.get("loc", ())))))
    loc = _location(tuple(first.get("loc", ())))
    field = str(loc[0]) if loc and isinstance(loc[0], str) else None
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{where.lstrip('.')}: {message}" if where else message), field
# --8<-- [end:validation_error]


def _install_error_handlers(app: FastAPI) -> None:
    """Turn every error into OpenAI's error body (FastAPI's 422 becomes a 400)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_json(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_json(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return error_json(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> Response:
        logger.error("request %s: the engine is not running: %s", request_id_of(request), exc)
        error = error_from_exception(exc)
        return error_json(error.status, error.message)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening any more

    # Any other exception reaches RequestIdMiddleware: a 500 naming the request id.


# Responses every generation endpoint may give besides 200, for the OpenAPI document.
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request"), (401, "Missing or wrong API key"),
        (404, "Unknown model"), (408, "The request body came too slowly"),
        (413, "Request body too large"), (500, "A bug of the server's"),
        (503, "The server is full, shutting down, or its engine has stopped"))
}


# One server-sent event of a stream: `data:` holds a chunk's JSON, the last one `[DONE]`.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}},
              "required": ["data"]}


def _streaming_ok(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "The response, or with `stream` a stream "
                  "of server-sent events (`data: <chunk>` ... `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


# --8<-- [start:openapi]
def _install_openapi(app: FastAPI, api_key: bool) -> None:
    """The OpenAPI document as the server behaves: 400 where FastAPI writes 422,
    and the bearer scheme when an API key is required."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    if api_key:
                        responses.setdefault("401", {
                            "description": "Missing or wrong API key",
                            "content": {"application/json": {"schema": {
                                "$ref": "#/components/schemas/ErrorResponse"}}}})
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            if api_key:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
# --8<-- [end:openapi]


# --8<-- [start:build_app]
def build_app(engine: AsyncLLM, served_model_name: str | None = None,
              args: FrontendArgs | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncLLM`).

    Args:
        engine: a started `AsyncLLM`; the app shuts it down when the app stops.
        served_model_name: the name clients pass as `model`; defaults to the
            engine's `served_model_name`, else its model directory.
        args: the front's settings (security, limits); default `FrontendArgs()`.
    """
    args = args or FrontendArgs()
    config = engine.engine_config
    model_name = served_model_name or config.served_model_name or str(config.model)
    metrics = ServerMetrics(engine.get_stats, model_name)
    shutdown = asyncio.Event()  # binds to the server's loop on first use
    pool = ThreadPoolExecutor(TOKENIZER_WORKERS, thread_name_prefix="mini-vllm-tokenize")
    context = ServingContext(
        engine=engine, model_name=model_name, metrics=metrics, shutdown=shutdown, args=args,
        admission=Admission(config.scheduler_config.max_num_seqs, args.max_queued_seqs),
        pool=pool)
    models = OpenAIServing(context)
    completions = OpenAIServingCompletion(context)
    chat = OpenAIServingChat(context)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        shutdown.set()
        engine.shutdown()
        pool.shutdown(wait=False, cancel_futures=True)

    docs = not args.disable_fastapi_docs
    app = FastAPI(title="mini-vllm", version=mini_vllm.__version__, lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.router.route_class = _JSONRoute
    app.state.shutdown = shutdown
    app.state.model_name = model_name
    app.state.metrics = metrics
    app.state.context = context
    _install_error_handlers(app)
    _install_openapi(app, api_key=bool(args.api_key))

    # Added innermost first: a request meets CORS, then the request id, the key, the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes,
                       timeout=args.timeout_request_body)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_keys=args.api_key,
                           open_paths=("/health", *(DOCS_PATHS if docs else ())))
    app.add_middleware(RequestIdMiddleware)
    if args.allowed_origins:  # closed unless asked for: browsers get no CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(args.allowed_origins),
                           allow_methods=list(args.allowed_methods),
                           allow_headers=list(args.allowed_headers),
                           allow_credentials=args.allow_credentials)

    @app.post("/v1/completions", response_model=None,
              responses={**_streaming_ok(CompletionResponse), **_ERROR_RESPONSES})
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**_streaming_ok(ChatCompletionResponse), **_ERROR_RESPONSES})
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.get("/v1/models", response_model=ModelList)
    async def show_models() -> Response:
        return JSONResponse(models.model_list().model_dump())

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is running (no body)"},
                        503: {"description": "The engine is dead or shutting down (no body)"}})
    async def health() -> Response:
        alive = engine.is_running and not engine.errored and not shutdown.is_set()
        return Response(status_code=200 if alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": mini_vllm.__version__}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return engine.get_stats()

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def show_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
# --8<-- [end:build_app]


# --8<-- [start:server]
class OpenAIServer(uvicorn.Server):
    """uvicorn's server, which also ends in-flight generations when told to exit,
    and reports failing `accept()` calls at a bounded rate.

    On SIGINT/SIGTERM uvicorn stops accepting connections and waits for the
    open ones; setting the app's shutdown event first makes every running
    request finish at once with `finish_reason: "abort"` (streams still get
    their last chunks and `[DONE]`), so that wait is short.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI,
                 log: RateLimitedLog | None = None) -> None:
        super().__init__(config)
        self._app = app
        self._log = log or RateLimitedLog()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        # Running out of descriptors makes every accept() fail: one line now and then.
        self._loop.set_exception_handler(rate_limited_exception_handler(self._log))
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._app.state.shutdown.set)
# --8<-- [end:server]


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                access_log: bool = True, args: FrontendArgs | None = None) -> OpenAIServer:
    """A uvicorn server for `app` (call `.run()` to serve until told to exit).

    Args:
        args: the front's settings: TLS, the connection cap and the timeouts
            (default `FrontendArgs()`; pass the same as to `build_app`).
    """
    args = args or FrontendArgs()
    log = RateLimitedLog()
    guard = ConnectionGuard(args.limit_concurrency, args.timeout_request_headers, log)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        http=functools.partial(GuardedH11Protocol, guard=guard),  # type: ignore[arg-type]
        ws="none", lifespan="on",
        timeout_keep_alive=args.timeout_keep_alive,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
    return OpenAIServer(config, app, log)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port`, made before the model loads so that a port
    in use is reported at once (pass it to `OpenAIServer.run(sockets=[...])`).

    Raises:
        OSError: the address cannot be bound (in use, not ours, no such host).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
