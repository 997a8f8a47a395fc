"""The command line's flags: one per `EngineArgs` and `FrontendArgs` field.

Engine flags are made from `EngineArgs`' fields, named as vLLM names them
(`max_num_seqs` is `--max-num-seqs`), and the server's from `FrontendArgs`'
(`--api-key`, `--max-n-sequences` ...); a field without a help line here still
gets a flag. `build_parser` puts them together with each command's own flags;
the commands themselves are in `mini_vllm/cli.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import mini_vllm
from mini_vllm.config import EngineArgs
from mini_vllm.entrypoints.args import FrontendArgs

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


__all__ = ["API_KEY_ENV", "add_engine_args", "add_frontend_args", "build_parser",
           "engine_args_from", "frontend_args_from"]
