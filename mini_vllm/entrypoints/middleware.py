"""ASGI middleware around the app: request ids and 500s, API keys, and request bodies.

```
uvicorn ─► CORS (when origins are allowed) ─► RequestIdMiddleware ─► ApiKeyMiddleware
        ─► BodyLimitMiddleware ─► FastAPI's routes
```

Each is a plain ASGI class (no `BaseHTTPMiddleware`, which buffers streams):
it looks at the request before the next layer does and answers in OpenAI's
error shape when it refuses one. An unauthenticated client is turned away
before its body is read; a body is read only up to the limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import uuid
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mini_vllm.entrypoints.errors import error_json, internal_error_message

logger = logging.getLogger(__name__)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


# --8<-- [start:request_id]
class RequestIdMiddleware:
    """Gives every request an id (`X-Request-Id`) and turns a bug into a 500 naming it.

    The client learns only that the request failed and its id; the traceback
    goes to the log under the same id. The exception stops here, so uvicorn
    keeps the client's keep-alive connection open.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s (%s %s) failed", request_id, scope["method"],
                             scope["path"])
            if not started:
                await error_json(500, internal_error_message(request_id))(
                    scope, receive, send_with_id)
# --8<-- [end:request_id]


# --8<-- [start:api_key]
class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` with one of `api_keys` (vLLM's `--api-key`).

    Paths in `open_paths` (`/health`, the docs) need no key; CORS preflights
    are answered by the CORS layer before this one. Keys are compared through
    their SHA-256 digests with `secrets.compare_digest`, so the time taken
    says nothing about how much of a guess was right.
    """

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], open_paths: Iterable[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self._open_paths = frozenset(open_paths)

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or b""
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = hashlib.sha256(token.strip()).digest()
        # Every key is compared, matched or not, so the time does not say which matched.
        return sum(secrets.compare_digest(digest, d) for d in self._digests) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] in self._open_paths
                or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        response = error_json(401, "missing or wrong API key: send the header "
                                   "`Authorization: Bearer <key>`",
                              headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
# --8<-- [end:api_key]


# --8<-- [start:body_limit]
class BodyLimitMiddleware:
    """Reads a request's body, up to `max_bytes` and within `timeout` seconds.

    A body that announces a larger `Content-Length` is refused with 413 before
    a byte of it is read; one that grows past the limit is refused when it
    does; one that has not arrived within `timeout` is a 408 (a client that
    trickles its body cannot hold the server). Either way the connection is
    closed, since the rest of the body is still on its way. A body that fits
    is handed to the app in one piece.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        too_large = False

        async def read_body() -> bytes | None:
            nonlocal too_large
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None  # nobody to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    too_large = True
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)

        try:
            body = await asyncio.wait_for(read_body(), self.timeout)
        except asyncio.TimeoutError:
            await error_json(408, f"the request body did not arrive within {self.timeout:g} s",
                             headers={"Connection": "close"})(scope, receive, send)
            return
        if too_large:
            await self._too_large(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # what follows the body: the client's disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_json(413, f"the request body is larger than {self.max_bytes} bytes "
                              "(the server's --max-request-body-bytes)",
                         headers={"Connection": "close"})(scope, receive, send)
# --8<-- [end:body_limit]


__all__ = ["ApiKeyMiddleware", "BodyLimitMiddleware", "RequestIdMiddleware"]
