"""`FrontendArgs`: the server's own settings, apart from the engine's.

Security (API keys, CORS, TLS, the docs pages), the connection limits uvicorn
enforces for us, and the limits every request is checked against before
anything is allocated for it. Each field is a flag of `mini-vllm serve`
(`--max-n-sequences` for `max_n_sequences`); the names are vLLM's where vLLM
has one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from mini_vllm.sampling_params import MAX_LOGPROBS


# --8<-- [start:frontend_args]
@dataclass(frozen=True)
class FrontendArgs:
    """Settings of the HTTP front (see `chapters/07-server.md`, "Running the server safely").

    Attributes:
        api_key: keys a client must send as `Authorization: Bearer <key>`
            (empty: no key needed). `/health` (and the docs pages) stay open.
        allowed_origins: origins a browser may call the API from (CORS);
            empty: none (closed).
        allowed_methods: HTTP methods those origins may use.
        allowed_headers: request headers those origins may send.
        allow_credentials: let those origins send cookies and auth headers.
        disable_fastapi_docs: serve no `/docs`, `/redoc` or `/openapi.json`.
        ssl_keyfile: TLS private key (with `ssl_certfile`: serve HTTPS).
        ssl_certfile: TLS certificate chain.
        ssl_ca_certs: CA certificates to check client certificates against.
        ssl_cert_reqs: whether a client certificate is required (the `ssl`
            module's `CERT_NONE` 0, `CERT_OPTIONAL` 1, `CERT_REQUIRED` 2).
        limit_concurrency: most open connections; a connection beyond it is
            answered 503 with `Retry-After` and closed.
        timeout_keep_alive: seconds an idle keep-alive connection stays open.
        timeout_request_headers: seconds a client has to send a request's
            headers, from the connection's start or the previous response.
        timeout_request_body: seconds a client has to send a request's body
            (408 after that).
        h11_max_incomplete_event_size: most bytes of request headers.
        max_request_body_bytes: largest request body; a larger one is a 413.
        max_n_sequences: largest `n` (completions per prompt).
        max_completion_prompts: most prompts in one completions request.
        max_stop_strings: most `stop` strings in one request.
        max_stop_string_len: longest `stop` string, in characters.
        max_logprobs: largest `logprobs` / `top_logprobs`.
        max_queued_seqs: sequences (prompts x n) the server holds beyond the
            engine's running batch (`max_num_seqs`); a request that finds no
            room gets 503 with `Retry-After`.
        enable_auto_tool_choice: let the model decide whether to call a tool
            (`tool_choice` "auto", the default when a request has tools); its
            calls are parsed with `tool_call_parser`.
        tool_call_parser: how the model writes tool calls (`"hermes"`: Qwen3's
            `<tool_call>` tags).
    """

    api_key: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    disable_fastapi_docs: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    limit_concurrency: int = 2048
    timeout_keep_alive: int = 5
    timeout_request_headers: float = 10.0
    timeout_request_body: float = 30.0
    h11_max_incomplete_event_size: int = 16 * 1024
    max_request_body_bytes: int = 2 * 1024 * 1024
    max_n_sequences: int = 128
    max_completion_prompts: int = 1024
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_logprobs: int = MAX_LOGPROBS
    max_queued_seqs: int = 4096
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
# --8<-- [end:frontend_args]

    def __post_init__(self) -> None:
        for name in ("api_key", "allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if any(not key for key in self.api_key):
            raise ValueError("api_key: an API key must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both or neither")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        for name in ("limit_concurrency", "timeout_keep_alive", "h11_max_incomplete_event_size",
                     "max_request_body_bytes", "max_n_sequences", "max_completion_prompts",
                     "max_stop_strings", "max_stop_string_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("timeout_request_headers", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the most the sampler "
                             f"returns), got {self.max_logprobs}")
        if self.max_queued_seqs < 0:
            raise ValueError(f"max_queued_seqs must be >= 0, got {self.max_queued_seqs}")
        from mini_vllm.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (e.g. hermes)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def replace(self, **changes: object) -> FrontendArgs:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


__all__ = ["FrontendArgs"]
