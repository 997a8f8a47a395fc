"""Connections: a cap on how many are open, and deadlines for their headers.

uvicorn gives us a keep-alive timeout (`timeout_keep_alive`, started when a
response ends) and a bound on the size of request headers
(`h11_max_incomplete_event_size`). It does not time out a connection that
never finishes its first request's headers, and its `limit_concurrency`
answers 503 without `Retry-After` and logs every refusal. `GuardedH11Protocol`,
uvicorn's HTTP/1.1 protocol with three additions, fills those gaps:

```
connection   1 .. limit             served; headers due within timeout_request_headers
             limit+1 .. ceiling     answered 503 + Retry-After (OpenAI's error), closed;
                                    its request line is due within 1 s
             above ceiling          closed at once
```

so the open descriptors never exceed `ceiling` (plus the engine's own), which
`ensure_descriptors` checks against the process's limit at start-up. The
event loop's accept errors (EMFILE and friends, should the descriptors run
out anyway) are logged at most once every few seconds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from mini_vllm.entrypoints.admission import RETRY_AFTER_S
from mini_vllm.entrypoints.errors import error_json

logger = logging.getLogger(__name__)

# Seconds a connection beyond the cap has to send its request line.
OVERFLOW_HEADER_TIMEOUT_S = 1.0
# Descriptors kept for everything but client connections (model files, pipes, logs ...).
RESERVED_DESCRIPTORS = 256
# Least seconds between two log lines about the same kind of trouble.
LOG_INTERVAL_S = 10.0


class RateLimitedLog:
    """Logs a kind of event at most once every `interval` seconds, with a count of
    the ones left out (an attack must not become a flood of log lines)."""

    def __init__(self, interval: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def report(self, kind: str, message: str) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        logger.warning("%s%s", message,
                       f" ({skipped} more like it since the last report)" if skipped else "")


# --8<-- [start:guard]
class ConnectionGuard:
    """What `GuardedH11Protocol` enforces; one per server.

    Args:
        limit: connections served at once.
        header_timeout: seconds to send a request's headers.
        log: where refusals and timeouts are reported.
    """

    def __init__(self, limit: int, header_timeout: float, log: RateLimitedLog) -> None:
        self.limit = limit
        self.ceiling = limit + max(16, limit // 4)
        self.header_timeout = header_timeout
        self.log = log

    async def overloaded(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app a connection beyond the cap gets: 503, try again later."""
        self.log.report("overloaded", f"more than {self.limit} open connections: answered 503")
        await error_json(503, f"the server has {self.limit} open connections, its limit; "
                              "retry later",
                         headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})(
            scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a connection cap and a headers deadline."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *,
                 guard: ConnectionGuard) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        open_now = len(self.connections)  # this one included
        if open_now > self._guard.ceiling:
            self._guard.log.report("ceiling", f"more than {self._guard.ceiling} open "
                                               "connections: closed new ones at once")
            transport.abort()
            return
        timeout = self._guard.header_timeout
        if open_now > self._guard.limit:
            self.app = self._guard.overloaded  # this connection's one request gets a 503
            timeout = min(timeout, OVERFLOW_HEADER_TIMEOUT_S)
        self._arm_header_timer(timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._cancel_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            # The first bytes of a kept-alive connection's next request: its headers are
            # due from now. (Until they came, uvicorn's keep-alive timeout held it.)
            self._arm_header_timer(self._guard.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self, timeout: float) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(timeout, self._headers_overdue)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._guard.log.report("headers", "closed connections that did not send their "
                                               "request headers in time")
            self.transport.close()
# --8<-- [end:guard]


def ensure_descriptors(limit: int) -> int:
    """The connection cap the process's descriptor limit allows, raising the soft limit
    toward the hard one when `limit` needs it (as vLLM does at start-up).

    Returns:
        `limit`, or a smaller cap (with a warning) when even the hard limit is too low.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to check
        return limit
    ceiling = limit + max(16, limit // 4)
    needed = ceiling + RESERVED_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        new_soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        allowed = max(1, (soft - RESERVED_DESCRIPTORS) * 4 // 5)
        logger.warning("the process may open %d files (ulimit -n): serving at most %d "
                       "connections instead of %d", soft, allowed, limit)
        return allowed
    return limit


_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def rate_limited_exception_handler(log: RateLimitedLog) -> Callable[
        [asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler that reports running out of descriptors (the
    loop's `accept()` failing) at most once every few seconds; anything else goes
    to the loop's default handler."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS:
            log.report("accept", f"cannot accept connections: {exc.strerror or exc}")
            return
        loop.default_exception_handler(context)

    return handle


__all__ = ["ConnectionGuard", "GuardedH11Protocol", "RateLimitedLog", "ensure_descriptors",
           "rate_limited_exception_handler"]
