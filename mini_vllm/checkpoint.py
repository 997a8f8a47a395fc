"""Offline checkpoints: Hugging Face-format Qwen3 directories with random weights.

`make_model(out_dir, preset)` writes everything a real `Qwen/Qwen3-*` download holds
(`config.json`, safetensors weights, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json` with the chat template), so the engine, `transformers` and the
tests all read our checkpoints through the same code as real ones. The tokenizer is the
byte-level BPE shipped in `mini_vllm/data/` (built by `scripts/build_tokenizer.py`); the
weights are random but deterministic in the seed. Where a `--model` argument points
(or the embedded default model) is `model_dir.py`'s business.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mini_vllm.model_config import resolve_dtype

DATA_DIR = Path(__file__).resolve().parent / "data"
TOKENIZER_FILE = DATA_DIR / "tokenizer.json"
CHAT_TEMPLATE_FILE = DATA_DIR / "chat_template.jinja"

DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
DEFAULT_PRESET = "tiny"

# Token ids of the shipped tokenizer's added tokens that config files refer to. The
# test suite checks them against tokenizer.json (they are at the end of the vocabulary,
# in Qwen3's order, as in Qwen3 where <|endoftext|> is 151643).
ENDOFTEXT_ID = 2305  # <|endoftext|>: bos / pad, and a second eos
IM_END_ID = 2307  # <|im_end|>: the chat eos

# Qwen3's additional special tokens (tokenizer_config.json `additional_special_tokens`).
_ADDITIONAL_SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# --8<-- [start:presets]
_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1_000_000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
}

PRESETS: dict[str, dict[str, Any]] = {
    # A few MB, fast on a CPU: the embedded default and the tests' model. head_dim is
    # deliberately NOT hidden_size / num_attention_heads (64 / 4 = 16), as in real Qwen3.
    # vocab_size is the tokenizer's 2331 tokens rounded up to a multiple of 64, so ids
    # 2331..2367 exist in the embedding but not in the tokenizer (as in real Qwen3).
    "tiny": {
        **_QWEN3_COMMON,
        "vocab_size": 2368,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "max_window_layers": 4,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    # The real architectures' shapes (Qwen/Qwen3-0.6B and Qwen/Qwen3-8B).
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
# The same tiny shapes with a separate lm_head.weight (exercises the untied path).
PRESETS["tiny-untied"] = {**PRESETS["tiny"], "tie_word_embeddings": False}
# --8<-- [end:presets]

GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": ENDOFTEXT_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def preset_config(preset: str, dtype: str | torch.dtype | None = None,
                  overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `config.json` contents of a preset.

    Args:
        preset: a key of `PRESETS`.
        dtype: the weights' dtype (`"float32"`, `"bfloat16"`, ...); None keeps the preset's.
        overrides: config fields to replace (e.g. `{"num_hidden_layers": 2}`).

    Raises:
        ValueError: for an unknown preset or dtype.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    config = json.loads(json.dumps(PRESETS[preset]))  # a deep copy
    config.update(overrides or {})
    if dtype is not None:
        config["torch_dtype"] = str(resolve_dtype(dtype)).removeprefix("torch.")
    return config


# --8<-- [start:weight_shapes]
def weight_shapes(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The (Hugging Face name, shape) of every tensor a Qwen3 checkpoint stores, in order.

    Linear weights are `[out_features, in_features]`. Tied checkpoints store no
    `lm_head.weight` (the embedding doubles as the output projection).
    """
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden)),
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (q_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_dim)),
            (f"{p}.self_attn.q_norm.weight", (head_dim,)),  # per-head RMSNorm of q
            (f"{p}.self_attn.k_norm.weight", (head_dim,)),  # per-head RMSNorm of k
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes
# --8<-- [end:weight_shapes]


# --8<-- [start:random_weight]
def random_weight(name: str, shape: tuple[int, ...], seed: int, hidden_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """A deterministic random tensor for one parameter.

    Each tensor has its own generator seeded from (seed, name), so a tensor's values do
    not depend on which other tensors are written or in what order (shards can be
    produced one at a time). The scales keep activations and logits well-behaved at any
    size: norms are 1 + 0.1·N(0,1) so a missing norm changes the output; linear layers
    are N(0,1)/sqrt(in_features) so activations keep unit scale through the stack; the
    embedding and lm_head are N(0,1)·2.5/sqrt(hidden) so logits have a std of about 2.5
    (neither flat nor one-hot).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        values = 1.0 + 0.1 * values
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        values *= 2.5 / math.sqrt(hidden_size)
    else:
        values /= math.sqrt(shape[1])
    return values.to(dtype)
# --8<-- [end:random_weight]


def _plan_shards(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int,
                 max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group tensors, in order, into shards of at most `max_shard_bytes` each.

    A tensor larger than the limit gets a shard of its own.
    """
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    return shards


def write_weights(out_dir: Path, config: Mapping[str, Any], seed: int,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write random safetensors weights for `config`; returns the files (`write_sharded`)."""
    dtype = resolve_dtype(config["torch_dtype"])
    return write_sharded(out_dir, weight_shapes(config), dtype, max_shard_bytes,
                         lambda name, shape: random_weight(name, shape, seed,
                                                           config["hidden_size"], dtype))


def write_sharded(out_dir: Path, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                  max_shard_bytes: int,
                  make_tensor: Callable[[str, tuple[int, ...]], torch.Tensor]) -> list[Path]:
    """Write the tensors `make_tensor(name, shape)` makes, one shard in memory at a time.

    One shard is saved as `model.safetensors`; more are saved as
    `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json` mapping each
    tensor name to its file, as Hugging Face does.

    Returns:
        The weight files written.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards = _plan_shards(shapes, dtype.itemsize, max_shard_bytes)
    for stale in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous write with another sharding

    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = out_dir / ("model.safetensors" if len(shards) == 1
                          else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {name: make_tensor(name, shape) for name, shape in shard}
        save_file(tensors, str(file), metadata={"format": "pt"})
        del tensors  # only one shard's tensors are alive at a time
        weight_map.update({name: file.name for name, _ in shard})
        files.append(file)
    if len(shards) > 1:
        total = sum(math.prod(shape) for _, shape in shapes) * dtype.itemsize
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


def _added_tokens(tokenizer_json: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from sorted(tokenizer_json["added_tokens"], key=lambda t: t["id"])


def write_tokenizer_files(out_dir: Path, model_max_length: int) -> None:
    """Copy the shipped `tokenizer.json` and write a Qwen3-style `tokenizer_config.json`."""
    tokenizer_json = json.loads(TOKENIZER_FILE.read_text(encoding="utf-8"))
    shutil.copyfile(TOKENIZER_FILE, out_dir / "tokenizer.json")
    added = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                         "single_word", "special")}
        for t in _added_tokens(tokenizer_json)
    }
    _write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": _ADDITIONAL_SPECIAL_TOKENS,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })


def _tokenizer_ids(tokenizer_json: dict[str, Any]) -> set[int]:
    return set(tokenizer_json["model"]["vocab"].values()) | {
        t["id"] for t in tokenizer_json["added_tokens"]}


# --8<-- [start:cover_vocabulary]
def cover_vocabulary(model_dir: str | Path) -> int:
    """Give every id of the model's vocabulary a text; return how many ids gained one.

    The shipped tokenizer has 2,331 tokens; a checkpoint in a real model's shape has a
    vocabulary of 151,936 ids. A random-weight model samples ids from all of them, and
    without this 98.5 % of what it generates would decode to no text at all (a stream
    would carry a chunk only every 60 tokens or so). So each id the tokenizer lacks
    becomes an added, non-special token whose text is `" w<id>"`: every sampled id
    reads as a word, as with a real tokenizer that covers its vocabulary. Encoding is
    unchanged for any text that does not spell those words, and ids the tokenizer
    already has keep their texts. `tokenizer_config.json`, where transformers looks for
    added tokens, lists them too.
    """
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    have = _tokenizer_ids(tokenizer)
    added = [{"id": i, "content": f" w{i}", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": False}
             for i in range(vocab_size) if i not in have]
    if not added:
        return 0
    tokenizer["added_tokens"] += added
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    config_path = model_dir / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        decoder = config.setdefault("added_tokens_decoder", {})
        for token in added:
            decoder[str(token["id"])] = {k: v for k, v in token.items() if k != "id"}
        config_path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return len(added)
# --8<-- [end:cover_vocabulary]


def _needs_covering(vocab_size: int) -> bool:
    """Whether a vocabulary reaches past the shipped tokenizer by more than the padding
    to a multiple of 64 (ids without text that the tiny presets keep, as Qwen3 does)."""
    tokens = len(_tokenizer_ids(json.loads(TOKENIZER_FILE.read_text(encoding="utf-8"))))
    return vocab_size > -(-tokens // 64) * 64


# --8<-- [start:make_model]
def make_model(out_dir: str | Path, preset: str = DEFAULT_PRESET, seed: int = 0,
               dtype: str | torch.dtype | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, weights: bool = True,
               overrides: Mapping[str, Any] | None = None,
               every_id_text: bool | None = None) -> Path:
    """Write a Hugging Face-format Qwen3 checkpoint with random weights.

    Args:
        out_dir: the directory to write (created if needed; weight files already in it
            are replaced).
        preset: a key of `PRESETS` (`tiny`, `tiny-untied`, `qwen3-0.6b`, `qwen3-8b`).
        seed: the weights are a deterministic function of (preset, seed, dtype).
        dtype: the stored dtype; None keeps the preset's (float32 for the tiny presets,
            bfloat16 for the real shapes).
        max_shard_bytes: largest safetensors file; bigger checkpoints are sharded with a
            `model.safetensors.index.json`.
        weights: False writes only the config and tokenizer files (fast, for checking a
            large preset's shapes without gigabytes of weights).
        overrides: `config.json` fields to change (e.g. `{"num_hidden_layers": 2}`).
        every_id_text: give every id of the vocabulary a text (`cover_vocabulary`);
            None does so where the vocabulary is much larger than the shipped tokenizer
            (the real shapes), so that what a random model generates reads as words.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: for an unknown preset or dtype, or a non-positive shard size.
    """
    # The other families (Llama, Mistral, Qwen2, GPT-2, Qwen3-MoE, Qwen3 with YaRN)
    # have presets of their own, written in their own formats.
    from mini_vllm.models.presets import FAMILY_PRESETS, make_family_model

    if preset in FAMILY_PRESETS:
        return make_family_model(out_dir, preset, seed, dtype, max_shard_bytes, weights,
                                 overrides)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of "
                         f"{sorted(PRESETS) + sorted(FAMILY_PRESETS)}")
    config = preset_config(preset, dtype, overrides)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    write_tokenizer_files(out, model_max_length=config["max_position_embeddings"])
    if every_id_text if every_id_text is not None else _needs_covering(config["vocab_size"]):
        cover_vocabulary(out)
    if weights:
        write_weights(out, config, seed, max_shard_bytes)
    return out
# --8<-- [end:make_model]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "GENERATION_CONFIG",
    "PRESETS",
    "cover_vocabulary",
    "make_model",
    "preset_config",
    "random_weight",
    "weight_shapes",
    "write_sharded",
    "write_tokenizer_files",
    "write_weights",
]
