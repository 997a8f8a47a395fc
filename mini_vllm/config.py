"""Configuration: one small frozen dataclass per component.

`ModelConfig` (`mini_vllm.model_config`) is read from a checkpoint's
`config.json`; `CacheConfig` and `SchedulerConfig` hold the engine arguments
that size the KV cache and the batches, `ParallelConfig` how the model is split
over GPUs; `EngineConfig` bundles them and is what `LLM(...)` and the CLI build
from vLLM-named engine arguments (`EngineArgs`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from mini_vllm.model_config import ModelConfig, resolve_dtype

if TYPE_CHECKING:
    from mini_vllm.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized.

    Attributes:
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of the GPU's memory the engine may use
            in all (weights, activations and KV cache); ignored on the CPU.
        cpu_kv_cache_gb: the KV cache's size on the CPU, in GiB.
        num_gpu_blocks_override: a fixed number of KV blocks, on any device
            (tests use tiny pools).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be positive, got {self.cpu_kv_cache_gb}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 2, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: the per-step token budget (prefill + decode).
        max_model_len: longest sequence (prompt + output) a request may reach.
        enable_chunked_prefill: split prompts longer than the budget over steps.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )


# --8<-- [start:parallel_config]
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread: over GPUs (tensor parallel) and over replicas.

    Attributes:
        tensor_parallel_size: ranks that each hold a share of every weight
            (one per GPU on a GPU).
        data_parallel_size: engine replicas, each with its own tensor-parallel
            group, behind one server (Ray actors).
        distributed_executor_backend: how the ranks other than the driver are
            started: `"mp"`, processes on this host; `"ray"`, Ray actors in a
            placement group (which may span the nodes of a Ray cluster).
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be one of "
                f"{DISTRIBUTED_EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}")

    def check_model(self, model: ModelConfig) -> None:
        """Raise a `ValueError` naming the field when `model` cannot be split this way."""
        n = self.tensor_parallel_size
        if n > 1:
            from mini_vllm.models.registry import supports_tensor_parallel

            if not supports_tensor_parallel(model.architecture):
                raise ValueError(f"tensor_parallel_size ({n}): {model.architecture} runs on "
                                 "one rank only (its weights are not split yet)")
        for name in ("num_attention_heads", "intermediate_size"):
            if getattr(model, name) % n:
                raise ValueError(f"tensor_parallel_size ({n}) must divide the model's "
                                 f"{name} ({getattr(model, name)})")
        kv = model.num_key_value_heads
        if kv % n and n % kv:
            raise ValueError(f"tensor_parallel_size ({n}) must divide the model's "
                             f"num_key_value_heads ({kv}) or be a multiple of it")
# --8<-- [end:parallel_config]


# --8<-- [start:piecewise_default]
# The graphs' memory pool keeps the activations of the largest step captured:
# graphs up to 8,192 tokens hold 358 MiB more than graphs up to 512 for
# Qwen3-0.6B (1,898 against 1,540 MiB on an H200), more for a wider model.
# Where that is a small share of the GPU, every prompt step replays graphs: an
# eager step of thousands of tokens launches some 400 kernels from Python, and
# on an H200 the GPU waited for them in some runs (chapter 9).
PIECEWISE_ALL_STEPS_MIN_GPU_BYTES = 64 * 2**30
PIECEWISE_LARGE_GPU_TOKENS = 8192  # the default step budget; the memory grows with it
PIECEWISE_SMALL_GPU_TOKENS = 512


def default_piecewise_graph_tokens(gpu_total_bytes: int, max_num_batched_tokens: int) -> int:
    """`max_piecewise_graph_tokens` when none is given: the step budget, up to 8,192
    tokens, on a GPU of at least 64 GiB; else 512 (or the budget, if smaller);
    0 bytes: no GPU."""
    large = gpu_total_bytes >= PIECEWISE_ALL_STEPS_MIN_GPU_BYTES
    return min(PIECEWISE_LARGE_GPU_TOKENS if large else PIECEWISE_SMALL_GPU_TOKENS,
               max_num_batched_tokens)
# --8<-- [end:piecewise_default]


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, resolved from engine arguments and the checkpoint."""

    model: str
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    enforce_eager: bool = False
    max_piecewise_graph_tokens: int = 512
    tokenizer: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    async_scheduling: bool = False
    engine_process: bool = False
    parallel_config: ParallelConfig = ParallelConfig()
    chat_template: str | None = None
    speculative_config: SpeculativeConfig | None = None
    reasoning_parser: str | None = None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


# `max_num_seqs` when none is given. On the CPU the KV cache is sized for what
# this many sequences of `max_model_len` tokens can fill (ModelRunner).
CUDA_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 128


@dataclass
class EngineArgs:
    """Engine arguments named as vLLM names them (also the CLI's flags).

    `create_engine_config()` resolves `"auto"` values against the checkpoint and
    the machine: dtype `auto` is bfloat16 on a GPU and float32 on the CPU;
    `max_model_len` `None` means the model's `max_position_embeddings` (capped
    on the CPU to keep the default cache small). `load_format="dummy"` fills
    the weights with random values instead of reading them (benchmarks of a
    checkpoint directory that holds only `config.json` and the tokenizer).
    `async_scheduling` `None` means on for CUDA, off for the CPU: it plans the
    next step while the device still runs the current one (phase 9).
    `engine_process` `None` means the same: for CUDA, `AsyncLLM` (the server)
    runs the engine's step loop in a process of its own, on the CPU in a thread
    of the server's process (phase 9).
    `max_piecewise_graph_tokens`: a step with prompt tokens and at most this many
    tokens in all replays piecewise CUDA graphs (the forward between its
    attentions) instead of launching its kernels one by one; 0 turns them off
    (phase 9). `None` means the step budget (`max_num_batched_tokens`), up to
    8,192 tokens, on a GPU of at least 64 GiB, where the memory that the
    graphs of the largest steps hold is a small share, and 512 on a smaller one
    (see `default_piecewise_graph_tokens`).
    `enforce_eager` turns off every graph.
    `tensor_parallel_size` splits every weight over that many ranks (GPUs
    `0 .. N-1` on a GPU, processes on the CPU); `distributed_executor_backend`
    starts the ranks other than the engine's own as processes (`"mp"`) or as
    Ray actors (`"ray"`); `data_parallel_size` runs that many engine replicas
    as Ray actors behind one server (`mini-vllm serve` only). See
    `ParallelConfig` (Part IV).

    `chat_template`: a file holding a jinja chat template, or the template
    itself, used instead of the checkpoint's (a model without one, GPT-2,
    answers chat requests only with it).

    `speculative_config`: speculative decoding (a dict, or its JSON text, as
    vLLM takes it: `spec_decode.config.SpeculativeConfig`); None is off.

    `reasoning_parser`: the model's reasoning format (`"qwen3"`: `<think>` blocks),
    or None. With one, a structured output constrains only what follows the
    reasoning, and the server returns the reasoning apart (Part IV).

    `max_num_seqs` `None` means 256 on a GPU and 128 on the CPU (vLLM's CPU
    server default): the CPU's KV cache is capped at what `max_num_seqs`
    sequences of `max_model_len` tokens can fill, and a CPU gains little from
    more requests in flight.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    max_piecewise_graph_tokens: int | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    data_parallel_size: int = 1
    served_model_name: str | None = None
    load_format: str = "auto"
    async_scheduling: bool | None = None
    engine_process: bool | None = None
    chat_template: str | None = None
    # (annotated `str` first: the CLI makes its flag a JSON string from that)
    speculative_config: str | dict | None = None
    reasoning_parser: str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        """Resolve these arguments into an `EngineConfig`.

        Raises:
            ValueError: naming the argument that is out of range.
            FileNotFoundError: when the model directory lacks `config.json`.
        """
        from mini_vllm.model_dir import resolve_model_dir
        from mini_vllm.spec_decode.config import SpeculativeConfig

        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        parallel_config = ParallelConfig(self.tensor_parallel_size, self.data_parallel_size,
                                         self.distributed_executor_backend)
        if self.max_piecewise_graph_tokens is not None and self.max_piecewise_graph_tokens < 0:
            raise ValueError("max_piecewise_graph_tokens must be >= 0, "
                             f"got {self.max_piecewise_graph_tokens}")
        if self.engine_process is not None and not isinstance(self.engine_process, bool):
            raise ValueError(
                f"engine_process must be True, False or None, got {self.engine_process!r}")
        if self.reasoning_parser is not None:
            from mini_vllm.reasoning import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                                 f"got {self.reasoning_parser!r}")
        model_dir = str(resolve_model_dir(self.model))
        model_config = ModelConfig.from_pretrained(model_dir)
        parallel_config.check_model(model_config)
        chat_template = None
        if self.chat_template is not None:
            from mini_vllm.tokenizer import load_chat_template

            chat_template = load_chat_template(self.chat_template)

        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("device: 'cuda' was asked for but no CUDA GPU is available")
        tp = parallel_config.tensor_parallel_size
        if (device.type == "cuda" and tp > 1 and parallel_config.distributed_executor_backend
                == "mp" and tp > torch.cuda.device_count()):
            raise ValueError(f"tensor_parallel_size ({tp}) is larger than the "
                             f"{torch.cuda.device_count()} GPU(s) of this host")
        if self.dtype == "auto":
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        else:
            dtype = resolve_dtype(self.dtype)

        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
            if device.type == "cpu":
                max_model_len = min(max_model_len, 4096)
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's "
                f"max_position_embeddings ({model_config.max_position_embeddings})"
            )
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = CUDA_MAX_NUM_SEQS if device.type == "cuda" else CPU_MAX_NUM_SEQS
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        speculative = SpeculativeConfig.from_user(self.speculative_config, model_config)
        if speculative is not None:
            speculative.check_max_model_len(max_model_len)
        piecewise = self.max_piecewise_graph_tokens
        if piecewise is None:
            memory = (torch.cuda.get_device_properties(device).total_memory
                      if device.type == "cuda" else 0)
            piecewise = default_piecewise_graph_tokens(memory, budget)
        return EngineConfig(
            model=model_dir,
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_kv_cache_gb=self.cpu_kv_cache_gb,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            dtype=dtype,
            device=device,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            max_piecewise_graph_tokens=piecewise,
            tokenizer=self.tokenizer,
            served_model_name=self.served_model_name,
            load_format=self.load_format,
            async_scheduling=(device.type == "cuda" if self.async_scheduling is None
                              else self.async_scheduling),
            engine_process=(device.type == "cuda" if self.engine_process is None
                            else self.engine_process),
            parallel_config=parallel_config,
            chat_template=chat_template,
            speculative_config=speculative,
            reasoning_parser=self.reasoning_parser,
        )


__all__ = [
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "default_piecewise_graph_tokens",
]
