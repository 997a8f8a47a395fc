"""Load a Hugging Face safetensors checkpoint into the model its config names.

The model class comes from the registry (`config.json`'s `architectures`).
A checkpoint is one `model.safetensors` or several shards listed by
`model.safetensors.index.json`. Every checkpoint tensor is copied into
exactly one slice of one model parameter, converting dtype on the way, by
the block that owns the parameter (its `weight_loader`): under tensor
parallelism a block takes only its rank's rows or columns of the tensor.

    model.layers.0.self_attn.q_proj.weight ─┐
    model.layers.0.self_attn.k_proj.weight ─┼─> rows of model.layers.0.self_attn.qkv_proj.weight
    model.layers.0.self_attn.v_proj.weight ─┘
    model.layers.0.mlp.gate_proj.weight ────┬─> rows of model.layers.0.mlp.gate_up_proj.weight
    model.layers.0.mlp.up_proj.weight ──────┘
    model.layers.0.mlp.experts.5.up_proj.weight ─> w13[5, I:] of model.layers.0.mlp.experts
    h.0.attn.c_attn.weight  [in, out] ──(.T)────> transformer.h.0.attn.c_attn.weight
    everything else ──────────────────────────> the parameter of the same name

What a model class may declare for its checkpoints (all optional):
`packed_modules_mapping` (fused modules), `transposed_weights` (Conv1D
weights stored `[in, out]`), `base_model_prefix` (a prefix some checkpoints
leave out), `ignored_suffixes` (buffers stored but not loaded); a module
with a `checkpoint_targets(prefix)` method (the experts) maps its own.

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
from mini_vllm.distributed.parallel_state import ParallelContext
from mini_vllm.layers import LayerNorm, RMSNorm, select_implementations
from mini_vllm.layers.linear import copy_checked
from mini_vllm.model_config import ModelConfig
from mini_vllm.models.registry import get_model_class, supports_tensor_parallel

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
# Where one checkpoint tensor goes: the module that owns the parameter, the
# parameter, and which of the module's stacked projections it is (or None).
# (None for a view a module handed over itself: its experts' stacked weights).
WeightTarget = tuple[nn.Module | None, torch.Tensor, int | None]


def checkpoint_targets(model: nn.Module) -> dict[str, WeightTarget]:
    """Map each checkpoint tensor name to the parameter it must be copied into.

    For a fused module listed in the model's `packed_modules_mapping`, each
    checkpoint tensor is one stacked projection of the fused weight (its
    `shard_id`), whose rows the module's `weight_loader` knows:

        qkv_proj.weight  [q_size + 2 * kv_size, hidden]
          rows [0, q_size)                   <- q_proj.weight  (shard 0)
          rows [q_size, q_size + kv_size)    <- k_proj.weight  (shard 1)
          rows [q_size + kv_size, end)       <- v_proj.weight  (shard 2)

    A tied `lm_head.weight` is the embedding's parameter and is listed once
    (as `model.embed_tokens.weight`), so a tied checkpoint needs no lm_head.
    A module with a `checkpoint_targets(prefix)` method (`FusedMoE`) names
    the targets of its own parameters.
    """
    packed: Mapping[str, tuple[str, ...]] = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    targets: dict[str, WeightTarget] = {}
    own: set[str] = set()  # modules that map their own parameters (to views of them)
    for module_name, module in modules.items():
        if module is not model and hasattr(module, "checkpoint_targets"):
            targets.update({name: (None, view, None) for name, view
                            in module.checkpoint_targets(module_name).items()})
            own.add(module_name)
    for name, param in model.named_parameters():  # shared parameters appear once
        module_name, _, leaf = name.rpartition(".")
        if module_name in own:
            continue
        parent, _, short = module_name.rpartition(".")
        module = modules[module_name]
        if short not in packed:
            targets[name] = (module, param, None)
            continue
        for shard_id, shard in enumerate(packed[short]):
            targets[f"{parent}.{shard}.{leaf}"] = (module, param, shard_id)
    return targets


def load_tensor(target: WeightTarget, tensor: torch.Tensor) -> None:
    """Copy `tensor` into its target: through the module's `weight_loader` (which
    takes this rank's share of it), else whole.

    Raises:
        ValueError: the shapes do not match (the message gives both).
    """
    module, param, shard_id = target
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard_id)
    else:
        copy_checked(param.data, tensor)  # (a view's .data is the view)
# --8<-- [end:targets]


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Yield `(name, file, tensor)` one tensor at a time (never a whole shard in memory)."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, file, f.get_tensor(name)


def _ignored(name: str, tied: bool, suffixes: tuple[str, ...]) -> bool:
    # Tied checkpoints sometimes carry a copy of the embedding as lm_head;
    # old ones store RoPE's inv_freq, which we compute; `suffixes` are the
    # model class's own buffers (GPT-2's causal masks).
    return ((tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")
            or name.endswith(suffixes))


# --8<-- [start:target_of]
def _target_name(name: str, targets: Mapping[str, torch.Tensor], prefix: str) -> str:
    """The model's name for checkpoint tensor `name`: itself, or with the model's
    `base_model_prefix` put back (`h.0.ln_1.weight` -> `transformer.h.0.ln_1.weight`)."""
    if name not in targets and prefix and f"{prefix}.{name}" in targets:
        return f"{prefix}.{name}"
    return name
# --8<-- [end:target_of]


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
    transposed: tuple[str, ...] = tuple(getattr(model, "transposed_weights", ()))
    prefix: str = getattr(model, "base_model_prefix", "")
    ignored: tuple[str, ...] = tuple(getattr(model, "ignored_suffixes", ()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, file, tensor in _iter_checkpoint(find_safetensors_files(model_dir)):
        if _ignored(name, tied, ignored):
            continue
        name = _target_name(name, targets, prefix)
        if name.endswith(transposed):
            tensor = tensor.t()  # a Conv1D weight [in, out] -> [out, in]
        target = targets.get(name)
        if target is None:
            unexpected.append(f"{name} (in {file.name})")
            continue
        if name in loaded:
            raise ValueError(f"checkpoint {model_dir}: tensor {name} appears twice ({file.name})")
        try:
            load_tensor(target, tensor)  # converts dtype and moves to the model's device
        except ValueError as e:  # "has shape (a, b), the model expects (c, d)"
            raise ValueError(f"checkpoint {model_dir}: tensor {name} in {file.name} {e}") from None
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
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))}
    for i, (_, param) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + i)
        if id(param) in norm_weights:
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
    parallel: ParallelContext | None = None,
) -> nn.Module:
    """Build the model `config.json` names on `device` in `dtype` and load its weights.

    Args:
        model_dir: the checkpoint directory.
        model_config: its shape (read from `config.json` when None).
        dtype: the weights' dtype (the checkpoint's is converted).
        device: where the weights live.
        attn_backend: passed to the model (the torch reference when None).
        load_format: `"auto"` reads the safetensors; `"dummy"` fills random
            weights (only `config.json` is needed).
        seed: the dummy weights' seed.
        parallel: the tensor-parallel group: each rank builds and loads its
            share of every weight (one rank when None).

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
    model_cls = get_model_class(model_config.architecture)
    if parallel is not None and parallel.world_size > 1:
        if not supports_tensor_parallel(model_config.architecture):
            raise ValueError(f"{model_config.architecture} does not run tensor-parallel yet")
        model = model_cls(model_config, attn_backend, device=device, dtype=dtype,
                          parallel=parallel)
    else:
        model = model_cls(model_config, attn_backend, device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    select_implementations(model, device, dtype)
    return model.eval()
# --8<-- [end:load_model]


__all__ = [
    "WeightTarget",
    "checkpoint_targets",
    "find_safetensors_files",
    "init_dummy_weights",
    "load_model",
    "load_tensor",
    "load_weights",
]
