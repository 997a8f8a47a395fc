"""The `mini-vllm` command line (also `python -m mini_vllm`).

```
mini-vllm [serve] --model DIR [engine flags] [--host --port ...]   OpenAI-compatible server
mini-vllm chat --model DIR                                         chat in the terminal
mini-vllm generate --model DIR --prompt TEXT                       print one completion
mini-vllm make-model DIR --preset tiny                             write a random-weight checkpoint
```

The flags and the parser are built in `entrypoints/cli_args.py`; this module
holds the commands. Without `--model` a command uses the embedded default: a
tiny Qwen3 the project trained, shipped inside the package.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import ssl
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import mini_vllm
from mini_vllm.checkpoint import make_model
from mini_vllm.engine.async_engine import AsyncLLM, RequestFailedError
from mini_vllm.engine.heap import freeze_heap
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.cli_args import build_parser, engine_args_from, frontend_args_from
from mini_vllm.entrypoints.connections import ensure_descriptors
from mini_vllm.entrypoints.openai_server import bind_socket, build_app, make_server
from mini_vllm.sampling_params import SamplingParams

logger = logging.getLogger("mini_vllm")


class UsageError(Exception):
    """A problem the user can fix: printed as one line, exit status 2."""


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, seed=ns.sampling_seed)


def _setup_logging(level: int) -> None:
    """Send the engine's log lines (KV-cache size ...) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _load_engine(ns: argparse.Namespace, cls: type[LLMEngine | AsyncLLM]) -> Any:
    """Build an engine (`LLMEngine` or `AsyncLLM`); a bad model or flag is a UsageError."""
    try:
        return cls(engine_args_from(ns).create_engine_config())
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    except (ValueError, OSError) as e:
        raise UsageError(f"cannot load the model: {e}") from None


def _load_serving_engine(ns: argparse.Namespace) -> Any:
    """`serve`'s engine: an `AsyncLLM`, or with `--data-parallel-size N` its replicas."""
    if getattr(ns, "data_parallel_size", 1) == 1:
        return _load_engine(ns, AsyncLLM)
    from mini_vllm.distributed.data_parallel import DataParallelAsyncLLM

    try:
        return DataParallelAsyncLLM(engine_args_from(ns))
    except (ValueError, ImportError, RuntimeError) as e:
        raise UsageError(f"cannot start the engine replicas: {e}") from None


DEFAULT_SERVED_NAME = "mini-vllm-tiny"


# --8<-- [start:serve]
def _check_tls(args: FrontendArgs) -> None:
    """Load the TLS key and certificate once, so a bad file is reported before the model loads."""
    if args.ssl_certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"cannot use --ssl-certfile {args.ssl_certfile} with --ssl-keyfile "
                         f"{args.ssl_keyfile}: {e}") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    _setup_logging(getattr(logging, ns.log_level.upper()))
    # Like vLLM, clients name the model as --model was given; the embedded default
    # model gets a short name instead of its cache path.
    ns.served_model_name = ns.served_model_name or ns.model or DEFAULT_SERVED_NAME
    try:
        args = frontend_args_from(ns)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_tls(args)
    # Everything that can be wrong with where we listen is found before the model loads.
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        raise UsageError(f"cannot listen on {ns.host}:{ns.port}: {e.strerror or e}") from None
    args = args.replace(limit_concurrency=ensure_descriptors(args.limit_concurrency))
    try:
        engine = _load_serving_engine(ns)
    except BaseException:
        sock.close()
        raise
    app = build_app(engine, args=args)
    config = engine.engine_config
    model_name = app.state.model_name
    base = f"{'https' if args.ssl_certfile else 'http'}://{ns.host}:{sock.getsockname()[1]}"
    example = json.dumps({"model": model_name, "max_tokens": 64,
                          "messages": [{"role": "user", "content": "Hello!"}]})
    key_header = " -H 'Authorization: Bearer $KEY'" if args.api_key else ""
    print(f"mini-vllm {mini_vllm.__version__}\n"
          f"  model    {config.model}\n"
          f"  dtype    {str(config.dtype).removeprefix('torch.')}   device {config.device}   "
          f"max_model_len {config.scheduler_config.max_model_len}   "
          f"engine {'process' if config.engine_process else 'thread'}\n"
          f"  serving  {model_name!r} at {base}/v1 (OpenAI API; /health /metrics /stats)"
          f"{'; API key required' if args.api_key else ''}\n"
          f"Try:\n"
          f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{key_header} \\\n"
          f"    -d '{example}'",
          flush=True)
    server = make_server(app, ns.host, ns.port, log_level=ns.log_level,
                         access_log=not ns.disable_uvicorn_access_log, args=args)
    freeze_heap()  # this process serves from here on (engine/heap.py)
    # uvicorn re-raises the signal that stopped it once it has shut down
    # cleanly; make SIGTERM end like Ctrl-C (a KeyboardInterrupt, caught below).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
        sock.close()
    return 0
# --8<-- [end:serve]


# --8<-- [start:stream_text]
def stream_text(engine: LLMEngine, prompt: str | list[int],
                params: SamplingParams) -> Iterator[str]:
    """Run one request on a synchronous `LLMEngine`, yielding its text as it comes.

    Raises:
        ValueError: the engine refused the request (e.g. too long).
        RequestFailedError: the engine failed while computing it.
        KeyboardInterrupt: Ctrl-C; the request is aborted first.
    """
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.error is not None:
                    raise RequestFailedError(output.error)
                for completion in output.outputs:
                    if completion.text:
                        yield completion.text
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request([request_id])
# --8<-- [end:stream_text]


def cmd_generate(ns: argparse.Namespace) -> int:
    _setup_logging(logging.WARNING)
    engine = _load_engine(ns, LLMEngine)
    try:
        params = _sampling_params(ns)
        for piece in stream_text(engine, ns.prompt, params):
            print(piece, end="", flush=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except RequestFailedError as e:
        print(f"\nmini-vllm: error: {e}", file=sys.stderr)
        return 1
    print()
    return 0


# --8<-- [start:chat]
def cmd_chat(ns: argparse.Namespace) -> int:
    _setup_logging(logging.WARNING)
    engine = _load_engine(ns, LLMEngine)
    try:
        params = _sampling_params(ns)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if engine.tokenizer.chat_template is None:  # GPT-2: say so before the first prompt
        raise UsageError("the model has no chat template: give one with --chat-template FILE")
    start = [{"role": "system", "content": ns.system}] if ns.system else []
    messages = list(start)
    print(f"Chatting with {engine.config.model}. /reset starts over, /exit or Ctrl-D quits.",
          flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            print("(conversation cleared)", flush=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True,
            enable_thinking=ns.enable_thinking)
        reply: list[str] = []
        try:
            for piece in stream_text(engine, prompt, params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" (stopped)", end="")
        except (ValueError, RequestFailedError) as e:  # e.g. the chat outgrew the context
            messages.pop()
            print(f"error: {e}. /reset to start over.", flush=True)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
# --8<-- [end:chat]


def cmd_make_model(ns: argparse.Namespace) -> int:
    try:
        out = make_model(ns.out_dir, preset=ns.preset, seed=ns.seed, dtype=ns.dtype)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    print(f"wrote {out} (preset {ns.preset}, seed {ns.seed})")
    return 0


_HANDLERS = {"serve": cmd_serve, "chat": cmd_chat, "generate": cmd_generate,
             "make-model": cmd_make_model}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] not in _HANDLERS and args[0] not in ("-h", "--help", "--version")):
        args.insert(0, "serve")  # `mini-vllm --model DIR` serves
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        return _HANDLERS[ns.command](ns)
    except UsageError as e:
        print(f"mini-vllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


__all__ = ["main", "stream_text"]
