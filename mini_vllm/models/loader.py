"""Load a Hugging Face safetensors checkpoint into our Qwen3.

A checkpoint is one `model.safetensors` or several shards listed by
`model.safetensors.index.json`. Every checkpoint tensor is copied into
exactly one slice of one model parameter, converting dtype on the way:

    model.layers.0.self_attn.q_proj.weight ─┐
    model.layers.0.self_attn.k_proj.weight ─┼─> rows of model.layers.0.self_attn.qkv_proj.weight
    model.layers.0.self_attn.v_proj.weight ─┘
    model.layers.0.mlp.gate_proj.weight ────┬─> rows of model.layers.0.mlp.gate_up_proj.weight
    model.layers.0.mlp.up_proj.weight ──────┘
    everything else ──────────────────────────> the parameter of the same name

Anything missing, unexpected or of the wrong shape is an error that names
the tensor (and the file), never a silently random weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mini_vllm.attention import AttentionBackend
from mini_vllm.config import ModelConfig
from mini_vllm.layers import select_implementations
from mini_vllm.models.qwen3 import Qwen3ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# --8<-- [start:find_files]
def find_safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory.

    Uses `model.safetensors.index.json` when present (sharded checkpoint),
    else `model.safetensors`, else every `*.safetensors` file.

    Raises:
        FileNotFoundError: naming the directory when it holds no weights, or
            the shard the index lists that does not exist.
        ValueError: naming the index when it is not valid JSON.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file} not found: it is listed in {index}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards"
        )
    return files
# --8<-- [end:find_files]


# --8<-- [start:targets]
def checkpoint_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Map each checkpoint tensor name to the tensor it must be copied into.

    For a fused module listed in the model's `packed_modules_mapping`, each
    checkpoint tensor gets a row slice (a view) of the fused weight, in the
    order of the fused module's `output_sizes`:

        qkv_proj.weight  [q_size + 2 * kv_size, hidden]
          rows [0, q_size)                   <- q_proj.weight
          rows [q_size, q_size + kv_size)    <- k_proj.weight
          rows [q_size + kv_size, end)       <- v_proj.weight

    A tied `lm_head.weight` is the embedding's parameter and is listed once
    (as `model.embed_tokens.weight`), so a tied checkpoint needs no lm_head.
    """
    packed: Mapping[str, tuple[str, ...]] = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # shared parameters appear once
        module_name, _, leaf = name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        if short not in packed:
            targets[name] = param.data
            continue
        output_sizes: list[int] = modules[module_name].output_sizes
        offset = 0
        for shard, size in zip(packed[short], output_sizes, strict=True):
            targets[f"{parent}.{shard}.{leaf}"] = param.data.narrow(0, offset, size)
            offset += size
    return targets
# --8<-- [end:targets]


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Yield `(name, file, tensor)` one tensor at a time (never a whole shard in memory)."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, file, f.get_tensor(name)


def _ignored(name: str, tied: bool) -> bool:
    # Tied checkpoints sometimes carry a copy of the embedding as lm_head;
    # old ones store RoPE's inv_freq, which we compute.
    return (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")


# --8<-- [start:load_weights]
@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy a checkpoint's tensors into `model`'s parameters, converting dtype.

    Args:
        model: a model with Hugging Face parameter names (fused modules
            declared in `packed_modules_mapping`).
        model_dir: the checkpoint directory.

    Raises:
        FileNotFoundError: a weight file is missing.
        ValueError: a tensor is unexpected, duplicated, of the wrong shape,
            or missing (each message names the tensors).
    """
    targets = checkpoint_targets(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, file, tensor in _iter_checkpoint(find_safetensors_files(model_dir)):
        if _ignored(name, tied):
            continue
        target = targets.get(name)
        if target is None:
            unexpected.append(f"{name} (in {file.name})")
            continue
        if name in loaded:
            raise ValueError(f"checkpoint {model_dir}: tensor {name} appears twice ({file.name})")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint {model_dir}: tensor {name} in {file.name} has shape "
                f"{tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)  # converts dtype and moves to the model's device
        loaded.add(name)
    if unexpected:
        raise ValueError(
            f"checkpoint {model_dir} has {len(unexpected)} tensor(s) the model does not use: "
            + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else "")
        )
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} is missing {len(missing)} tensor(s): "
            + ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        )
# --8<-- [end:load_weights]


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter with random values instead of reading a checkpoint.

    Norm weights are `1 + 0.1 * N(0, 1)`, everything else `0.02 * N(0, 1)`:
    values that do not matter for speed, drawn on the weights' own device so
    an 8B model fills in a moment (benchmarks with `load_format="dummy"`).
    """
    for i, (name, param) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.1, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)


# --8<-- [start:load_model]
def load_model(
    model_dir: str | Path,
    model_config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """Build a `Qwen3ForCausalLM` on `device` in `dtype` and load its weights.

    Args:
        model_dir: the checkpoint directory.
        model_config: its shape (read from `config.json` when None).
        dtype: the weights' dtype (the checkpoint's is converted).
        device: where the weights live.
        attn_backend: passed to the model (the torch reference when None).
        load_format: `"auto"` reads the safetensors; `"dummy"` fills random
            weights (only `config.json` is needed).
        seed: the dummy weights' seed.

    Returns:
        The model in eval mode, each block on its fast implementation where
        that can run on `device` in `dtype` (`select_implementations`).

    Raises:
        ValueError: for an unknown `load_format`, or a checkpoint that does
            not match the model (see `load_weights`).
        FileNotFoundError: a weight file is missing.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if model_config is None:
        model_config = ModelConfig.from_pretrained(model_dir)
    # Weights are allocated empty, directly on the device and in the target
    # dtype: no random init, no float32 copy of a bfloat16 model.
    model = Qwen3ForCausalLM(model_config, attn_backend, device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    select_implementations(model, device, dtype)
    return model.eval()
# --8<-- [end:load_model]


__all__ = [
    "checkpoint_targets",
    "find_safetensors_files",
    "init_dummy_weights",
    "load_model",
    "load_weights",
]
