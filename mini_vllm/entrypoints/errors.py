"""How a failure reaches a client: OpenAI's error body with the right HTTP status.

Every error the server sends, whatever raised it, has OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`. Endpoint code raises
`OpenAIError` (a status, a message, the field at fault); `bad_request` turns
a `ValueError` of the engine's validation into a 400 naming its field;
`error_from_exception` maps anything else (a full server, a dead engine, a
bug of ours) to its status; `error_json` renders the body. The middleware
and the connection layer use the same functions, so a 401, a 413 or a 503
there looks like one from an endpoint.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus

from fastapi.responses import Response

from mini_vllm.engine.async_engine import EngineDeadError
from mini_vllm.entrypoints.admission import ServerBusy
from mini_vllm.entrypoints.protocol import CompletionRequest, ErrorInfo, ErrorResponse
from mini_vllm.entrypoints.protocol_chat import ChatCompletionRequest

# Fields an engine or SamplingParams error message may name (see `bad_request`).
_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields)


class OpenAIError(Exception):
    """An error the API reports to the client as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests have been aborted."""


class ServerShuttingDown(Exception):
    """The server was asked to exit; unfinished requests end with `abort`."""


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
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
    # "temperature must ...", "prompt: ...", "structured_outputs.json: ...", "logit_bias[5] ..."
    first = re.split(r"[\s:.\[]", message, maxsplit=1)[0]
    return OpenAIError(400, message, param=first if first in _REQUEST_FIELDS else None)


def error_response(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The OpenAI error body for an HTTP status."""
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))


def error_json(status: int, message: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> Response:
    """An error as an HTTP response. The body is ASCII JSON, so no text in a
    message (a client's model name, say) can make the response fail to encode."""
    body = json.dumps(error_response(status, message, param).model_dump(), ensure_ascii=True)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def internal_error_message(request_id: str) -> str:
    """What a client learns of a bug of ours: that it happened, and where to look."""
    return f"the server failed to complete this request (request id {request_id})"


def error_from_exception(exc: BaseException, request_id: str = "unknown") -> OpenAIError:
    """The OpenAI error an exception becomes. Anything unexpected is a 500 whose
    message names only the request id; the caller logs the details."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ServerBusy):
        return OpenAIError(503, str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, "the engine is not running")
    return OpenAIError(500, internal_error_message(request_id))
