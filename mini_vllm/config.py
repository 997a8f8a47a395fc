"""Configuration: one small frozen dataclass per component.

`ModelConfig` is read from a checkpoint's `config.json`; `CacheConfig` and
`SchedulerConfig` hold the engine arguments that size the KV cache and the
batches; `EngineConfig` bundles them and is what `LLM(...)` and the CLI build
from vLLM-named engine arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn a dtype name (`"bfloat16"`, `"float32"` ...) into a `torch.dtype`.

    Raises:
        ValueError: if the name is not a supported dtype.
    """
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype: unsupported {name}; use one of {sorted(set(_DTYPES))}")
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"dtype: unsupported {name!r}; use 'auto' or one of {sorted(set(_DTYPES))}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Qwen3 model, as its `config.json` describes it.

    Attributes mirror Hugging Face's `Qwen3Config` names. `head_dim` is
    independent of `hidden_size / num_attention_heads` (Qwen3-0.6B has
    hidden 1024, 16 heads and head_dim 128).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "config.json: num_attention_heads "
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed `config.json` (Hugging Face Qwen3 format)."""
        archs = cfg.get("architectures") or ["Qwen3ForCausalLM"]
        if cfg.get("model_type", "qwen3") != "qwen3" or "Qwen3ForCausalLM" not in archs:
            raise ValueError(
                f"config.json: only Qwen3 dense models are supported, got model_type="
                f"{cfg.get('model_type')!r} architectures={archs}"
            )
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        rope_type = (scaling or {}).get("rope_type") or rope.get("rope_type") or "default"
        if rope_type != "default":
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json: missing required fields {missing}")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory.

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: naming the file when it is not valid JSON or not Qwen3.
        """
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: is {path} a Hugging Face checkpoint?")
        try:
            cfg = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers (at 2 bytes per value)."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 2


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
    served_model_name: str | None = None
    load_format: str = "auto"
    async_scheduling: bool | None = None
    engine_process: bool | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        """Resolve these arguments into an `EngineConfig`.

        Raises:
            ValueError: naming the argument that is out of range.
            FileNotFoundError: when the model directory lacks `config.json`.
        """
        from mini_vllm.checkpoint import resolve_model_dir

        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: only 1 is supported")
        if self.max_piecewise_graph_tokens is not None and self.max_piecewise_graph_tokens < 0:
            raise ValueError("max_piecewise_graph_tokens must be >= 0, "
                             f"got {self.max_piecewise_graph_tokens}")
        if self.engine_process is not None and not isinstance(self.engine_process, bool):
            raise ValueError(
                f"engine_process must be True, False or None, got {self.engine_process!r}")
        model_dir = str(resolve_model_dir(self.model))
        model_config = ModelConfig.from_pretrained(model_dir)

        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("device: 'cuda' was asked for but no CUDA GPU is available")
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
        )


__all__ = [
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
    "default_piecewise_graph_tokens",
    "resolve_dtype",
]
