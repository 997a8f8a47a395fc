"""The `mini-vllm` command line (also `python -m mini_vllm`).

```
mini-vllm [serve] --model DIR [engine flags] [--host --port ...]   OpenAI-compatible server
mini-vllm chat --model DIR                                         chat in the terminal
mini-vllm generate --model DIR --prompt TEXT                       print one completion
mini-vllm make-model DIR --preset tiny                             write a random-weight checkpoint
```

Engine flags are made from `EngineArgs`' fields, named as vLLM names them
(`max_num_seqs` is `--max-num-seqs`), and the server's from `FrontendArgs`'
(`--api-key`, `--max-n-sequences` ...). Without `--model` a command uses the
embedded default: a tiny Qwen3 the project trained, shipped inside the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import ssl
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import mini_vllm
from mini_vllm.checkpoint import make_model
from mini_vllm.config import EngineArgs
from mini_vllm.engine.async_engine import AsyncLLM, RequestFailedError
from mini_vllm.engine.heap import freeze_heap
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.args import FrontendArgs
from mini_vllm.entrypoints.connections import ensure_descriptors
from mini_vllm.entrypoints.openai_server import bind_socket, build_app, make_server
from mini_vllm.sampling_params import SamplingParams

logger = logging.getLogger("mini_vllm")

# One help line per `EngineArgs` field; a field without an entry still gets a flag.
_ENGINE_ARG_HELP: dict[str, str] = {
    "model": "checkpoint directory in the Hugging Face format (Qwen3, Llama, Mistral, Qwen2, "
             "GPT-2, Qwen3-MoE); default: the embedded tiny Qwen3 trained by the project",
    "tokenizer": "tokenizer directory, if not the model's",
    "dtype": "weights and activations dtype: auto (bfloat16 on a GPU, float32 on the CPU), "
             "float32, bfloat16 or float16",
    "device": "auto, cpu, cuda or cuda:N",
    "seed": "seed of the engine's random state",
    "block_size": "tokens per KV-cache block",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's "
                     "max_position_embeddings (at most 4096 on the CPU)",
    "max_num_seqs": "most requests in the running batch",
    "max_num_batched_tokens": "token budget of one engine step (prefill + decode)",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts over several steps",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use in all",
    "cpu_kv_cache_gb": "KV-cache size on the CPU, in GiB",
    "num_gpu_blocks_override": "a fixed number of KV-cache blocks (any device)",
    "enforce_eager": "never capture CUDA graphs",
    "max_piecewise_graph_tokens": "steps with prompts of up to this many tokens replay "
                                  "piecewise CUDA graphs (0: they run eagerly; default: "
                                  "the step budget up to 8192 on a GPU of 64 GiB or more, "
                                  "else 512)",
    "tensor_parallel_size": "GPUs to shard the model over (processes on the CPU)",
    "served_model_name": "the model name clients send as `model` (default: --model)",
    "load_format": "auto reads the checkpoint's weights; dummy fills them with random values "
                   "(for benchmarks of a directory without weights)",
    "engine_process": "run the engine's step loop in a process of its own, apart from the "
                      "HTTP server (default: on with a CUDA GPU, off on the CPU)",
    # Speculative decoding: a JSON object, as vLLM's --speculative-config.
    "speculative_config": "speculative decoding, as JSON: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}' or '{\"model\": DRAFT_DIR, "
                          "\"num_speculative_tokens\": 4}' (default: off)",
}
# --chat-template (vLLM's flag): a template for a model without one, or instead of its own.
_ENGINE_ARG_HELP["chat_template"] = (
    "a jinja chat template file (or the template itself) to use instead of the model's; "
    "a model without one (GPT-2) answers chat requests only with it")
_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_CHOICES = {"dtype": _DTYPES, "load_format": ("auto", "dummy")}
# Engine arguments that only `serve` uses (the other commands drive an `LLMEngine` directly).
_SERVER_ONLY = ("served_model_name", "engine_process")

# ---- parallelism: the flags of `mini_vllm/distributed/` (Part IV) -------------------
_ENGINE_ARG_HELP["distributed_executor_backend"] = (
    "how the tensor-parallel ranks other than the engine's are started: mp (processes "
    "of this host) or ray (Ray actors in a placement group, which may span nodes)")
_ENGINE_ARG_HELP["data_parallel_size"] = (
    "engine replicas (each with its own tensor-parallel group) behind this server, as "
    "Ray actors; each request goes to the least-loaded one (serve only)")
_CHOICES["distributed_executor_backend"] = ("mp", "ray")
_SERVER_ONLY += ("data_parallel_size",)


def _load_serving_engine(ns: argparse.Namespace) -> Any:
    """`serve`'s engine: an `AsyncLLM`, or with `--data-parallel-size N` its replicas."""
    if getattr(ns, "data_parallel_size", 1) == 1:
        return _load_engine(ns, AsyncLLM)
    from mini_vllm.distributed.data_parallel import DataParallelAsyncLLM

    try:
        return DataParallelAsyncLLM(engine_args_from(ns))
    except (ValueError, ImportError, RuntimeError) as e:
        raise UsageError(f"cannot start the engine replicas: {e}") from None
# ---- end of the parallelism flags ---------------------------------------------------


# One help line per `FrontendArgs` field.
_FRONTEND_ARG_HELP: dict[str, str] = {
    "api_key": "require `Authorization: Bearer KEY` with one of these keys (default: "
               "$MINI_VLLM_API_KEY, else $VLLM_API_KEY, else no key); /health stays open",
    "allowed_origins": "origins browsers may call the API from (CORS), as a JSON list, e.g. "
                       "'[\"https://app.example\"]' (default: none)",
    "allowed_methods": "HTTP methods those origins may use, as a JSON list",
    "allowed_headers": "request headers those origins may send, as a JSON list",
    "allow_credentials": "let those origins send cookies and authorization headers",
    "disable_fastapi_docs": "serve no /docs, /redoc or /openapi.json",
    "ssl_keyfile": "TLS private key file (with --ssl-certfile: serve HTTPS)",
    "ssl_certfile": "TLS certificate chain file",
    "ssl_ca_certs": "CA certificates to check client certificates against",
    "ssl_cert_reqs": "client certificate: 0 not asked, 1 optional, 2 required",
    "limit_concurrency": "most open connections; more are answered 503 with Retry-After",
    "timeout_keep_alive": "seconds an idle keep-alive connection stays open",
    "timeout_request_headers": "seconds a client has to send a request's headers",
    "timeout_request_body": "seconds a client has to send a request's body (then 408)",
    "h11_max_incomplete_event_size": "most bytes of request headers",
    "max_request_body_bytes": "largest request body in bytes (larger: 413)",
    "max_n_sequences": "largest n (completions per prompt)",
    "max_completion_prompts": "most prompts in one completions request",
    "max_stop_strings": "most stop strings in one request",
    "max_stop_string_len": "longest stop string, in characters",
    "max_logprobs": "largest logprobs / top_logprobs",
    "max_queued_seqs": "sequences (prompts x n) held beyond the running batch "
                       "(--max-num-seqs); when full, requests get 503 with Retry-After",
}
# ---- tools and reasoning: the flags of Part IV's structured outputs ----------------
_FRONTEND_ARG_HELP["enable_auto_tool_choice"] = (
    "let the model decide whether to call a tool (tool_choice \"auto\", the default when a "
    "request has tools); needs --tool-call-parser")
_FRONTEND_ARG_HELP["tool_call_parser"] = (
    "how the model writes tool calls: hermes (Qwen3's <tool_call> tags)")
_ENGINE_ARG_HELP["reasoning_parser"] = (
    "how the model writes its reasoning: qwen3 (<think> blocks). The server then returns "
    "it as message.reasoning, and a structured output constrains only the answer after it")
_CHOICES["reasoning_parser"] = ("qwen3",)
# ---- end of the tools and reasoning flags ------------------------------------------

# Environment variables that give the API key when --api-key does not (the first set wins).
API_KEY_ENV = ("MINI_VLLM_API_KEY", "VLLM_API_KEY")


class UsageError(Exception):
    """A problem the user can fix: printed as one line, exit status 2."""


# --8<-- [start:engine_flags]
def add_engine_args(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """Add one flag per `EngineArgs` field (`--max-num-seqs` for `max_num_seqs` ...)."""
    group = parser.add_argument_group("engine")
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        # Annotations are strings here (`from __future__ import annotations`): "int | None".
        kind = _TYPES[str(f.type).split("|")[0].strip()]
        default = getattr(defaults, f.name)
        help_text = _ENGINE_ARG_HELP.get(f.name, f"engine argument {f.name}")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, help=help_text,
                               choices=_CHOICES.get(f.name))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` a parsed command line asks for."""
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names()
                         if hasattr(ns, name)})
# --8<-- [end:engine_flags]


def _json_list(text: str) -> list[str]:
    """A flag's value given as a JSON list of strings (vLLM's format for CORS lists)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as "
                                         f"'[\"https://app.example\"]', got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}")
    return port


# --8<-- [start:frontend_flags]
def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per `FrontendArgs` field (`--api-key`, `--max-n-sequences` ...)."""
    group = parser.add_argument_group("server")
    defaults = FrontendArgs()
    for f in dataclasses.fields(FrontendArgs):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_text = _FRONTEND_ARG_HELP[f.name]
        annotation = str(f.type)
        if f.name == "api_key":
            group.add_argument(flag, nargs="+", default=None, metavar="KEY", help=help_text)
        elif annotation.startswith("tuple"):
            group.add_argument(flag, type=_json_list, default=list(default), metavar="JSON",
                               help=help_text)
        elif annotation == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            if default is not None:
                help_text += " (default: %(default)s)"
            group.add_argument(flag, type=_TYPES[annotation.split("|")[0].strip()],
                               default=default, help=help_text)


def frontend_args_from(ns: argparse.Namespace) -> FrontendArgs:
    """The `FrontendArgs` a parsed command line asks for (the API key may come from
    the environment).

    Raises:
        ValueError: naming the flag that is out of range.
    """
    values = {name: getattr(ns, name) for name in FrontendArgs.field_names() if hasattr(ns, name)}
    if not values.get("api_key"):
        env_key = next((os.environ[v] for v in API_KEY_ENV if os.environ.get(v)), None)
        values["api_key"] = [env_key] if env_key else []
    return FrontendArgs(**values)
# --8<-- [end:frontend_flags]


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve`: the engine's, the server's and where to listen."""
    add_engine_args(parser)
    add_frontend_args(parser)
    group = parser.add_argument_group("listening and logging")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (0.0.0.0 for every interface)")
    group.add_argument("--port", type=_port, default=8000, help="port to listen on")
    group.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"), help="logging level")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="do not log one line per HTTP request")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage of `serve` is a screenful)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # `mini-vllm` with no command serves, so its help shows the serving flags too
    # (as `vllm serve --help` does); they are parsed by the `serve` command.
    parser = _Parser(
        prog="mini-vllm",
        description="A vLLM-style inference engine for Qwen3. Without a command, `serve`: "
                    "`mini-vllm --model DIR [flags below]`.")
    parser.add_argument("--version", action="version", version=f"mini-vllm {mini_vllm.__version__}",
                        help="print the version and exit")
    _add_serve_args(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible API (the default)",
                           description="Serve an OpenAI-compatible API over HTTP.")
    _add_serve_args(serve)

    chat = sub.add_parser("chat", help="chat with the model in the terminal",
                          description="Chat in the terminal. /reset starts over, /exit or "
                                      "Ctrl-D quits; Ctrl-C stops a reply.")
    add_engine_args(chat, skip=_SERVER_ONLY)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="a system message to start with")
    chat.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=True,
                      help="let Qwen3 think (<think>...</think>) before answering")

    gen = sub.add_parser("generate", help="print one completion of a prompt",
                         description="Complete one prompt and print the text as it comes.")
    add_engine_args(gen, skip=_SERVER_ONLY)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    _add_sampling_args(gen, max_tokens=64)

    make = sub.add_parser("make-model", help="write a Qwen3 checkpoint with random weights",
                          description="Write a Hugging Face-format Qwen3 directory with "
                                      "random weights and the shipped tokenizer.")
    make.add_argument("out_dir", help="directory to write")
    make.add_argument("--preset", default="tiny",
                      help="tiny, tiny-untied, qwen3-0.6b, qwen3-8b, or another family's: "
                           "tiny-llama3, llama3-8b, mistral-7b, qwen2.5-7b, gpt2-xl, "
                           "qwen3-30b-a3b, ... (mini_vllm/models/presets.py)")
    make.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    make.add_argument("--dtype", default=None, choices=_DTYPES[1:],
                      help="stored dtype (default: the preset's)")
    return parser


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help="most tokens to generate")
    group.add_argument("--temperature", type=float, default=None,
                       help="0 = greedy (default: the model's generation config)")
    group.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    group.add_argument("--top-k", type=int, default=None, help="sample among the top k tokens")
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="seed of this request's sampling")


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


__all__ = ["add_engine_args", "add_frontend_args", "build_parser", "engine_args_from",
           "frontend_args_from", "main", "stream_text"]
