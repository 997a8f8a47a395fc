"""A checkpoint's shape, read from its `config.json`: `ModelConfig`.

Each family names its fields its own way (GPT-2's `n_embd` is Llama's
`hidden_size`) and leaves out different defaults; `ModelConfig.from_dict` reads
them all into one small frozen dataclass with Hugging Face's Llama/Qwen3 names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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


# --8<-- [start:model_config]
@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model, as its `config.json` describes it.

    One dataclass for every family: the fields every decoder has, then what
    only some families set (each default is "this family does not have it").
    Names are Hugging Face's (`config.json` of Llama, Qwen2/3, Mistral); a
    family that names a field differently (GPT-2's `n_embd`, `n_layer` ...)
    is translated when it is read (`from_dict`). `head_dim` is independent of
    `hidden_size / num_attention_heads` (Qwen3-0.6B has hidden 1024, 16 heads
    and head_dim 128).

    Attributes:
        architecture: the registry's name of the model class (`config.json`'s
            `architectures`, e.g. `"LlamaForCausalLM"`).
        rope_scaling: `None` (plain RoPE) or the checkpoint's scaling
            parameters with their `rope_type` (`"llama3"`, `"yarn"`).
        attention_bias: biases on q, k, v and o (Llama's flag; Qwen2 has
            q/k/v biases whatever it says).
        sliding_window: the window of the layers whose `layer_types` entry is
            `"sliding_attention"` (Mistral: every layer), or None.
        layer_types: per layer, `"full_attention"` or `"sliding_attention"`.
        layer_norm_epsilon: GPT-2's LayerNorm epsilon (RMSNorm families use
            `rms_norm_eps`).
        scale_attn_weights, scale_attn_by_inverse_layer_idx: GPT-2's softmax
            scale: `head_dim ** -0.5`, further divided by `layer + 1`.
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
        decoder_sparse_step, mlp_only_layers: Qwen3-MoE's experts (0 experts:
            a dense model).
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
    architecture: str = "Qwen3ForCausalLM"
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
# --8<-- [end:model_config]

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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"config.json: sliding_window must be positive, "
                             f"got {self.sliding_window}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config.json: layer_types has {len(self.layer_types)} entries "
                             f"for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"config.json: layer_types {bad} are not supported "
                             "(full_attention, sliding_attention)")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"config.json: num_experts_per_tok must be in 1.."
                                 f"{self.num_experts}, got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("config.json: moe_intermediate_size and decoder_sparse_step "
                                 "must be positive")

    # --8<-- [start:per_layer]
    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer`, or None (the whole context)."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts (Qwen3-MoE's rule) or a dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)
    # --8<-- [end:per_layer]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed `config.json`, in its family's own field names.

        Raises:
            ValueError: for an architecture the registry does not know, a
                missing field, or a setting no model here implements (each
                message names the field).
        """
        from mini_vllm.models.registry import resolve_architecture

        archs = cfg.get("architectures") or [_ARCH_OF_MODEL_TYPE.get(
            cfg.get("model_type", "qwen3"), str(cfg.get("model_type")))]
        architecture = resolve_architecture(archs)
        read = _read_gpt2 if architecture == "GPT2LMHeadModel" else _read_decoder
        return cls(architecture=architecture,
                   torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
                   **read(architecture, cfg))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory.

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: naming the file when it is not valid JSON, or what the
                checkpoint asks for that is not supported.
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


_ARCH_OF_MODEL_TYPE = {
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel",
}
ROPE_TYPES = ("default", "llama3", "yarn")

# --8<-- [start:family_defaults]
# What each family's config class assumes when config.json leaves a field out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"rope_theta": 1_000_000.0, "max_position_embeddings": 40960,
                         "head_dim": 128},
    "Qwen3MoeForCausalLM": {"rope_theta": 10_000.0, "max_position_embeddings": 32768,
                            "head_dim": 128},
    "LlamaForCausalLM": {"rope_theta": 10_000.0, "max_position_embeddings": 2048},
    "MistralForCausalLM": {"rope_theta": 10_000.0, "max_position_embeddings": 4096 * 32,
                           "sliding_window": 4096},
    "Qwen2ForCausalLM": {"rope_theta": 10_000.0, "max_position_embeddings": 32768},
}
# --8<-- [end:family_defaults]


def _rope(cfg: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from either way config.json writes them: the
    classic `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", default_theta))
    scaling = dict(cfg.get("rope_scaling") or params)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _required(cfg: dict[str, Any], names: tuple[str, ...]) -> None:
    missing = [k for k in names if k not in cfg]
    if missing:
        raise ValueError(f"config.json: missing required fields {missing}")


def _read_decoder(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Llama-shaped decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE)."""
    _required(cfg, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"))
    defaults = _FAMILY_DEFAULTS[architecture]
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    theta, scaling = _rope(cfg, defaults["rope_theta"])
    window: int | None = cfg.get("sliding_window", defaults.get("sliding_window"))
    if architecture == "MistralForCausalLM":
        layer_types = ["sliding_attention"] * layers if window is not None else []
    elif cfg.get("use_sliding_window", False):  # Qwen2 / Qwen3: windows from a layer on
        if architecture != "Qwen2ForCausalLM":
            raise ValueError("config.json: use_sliding_window is supported for Qwen2 only")
        first = cfg.get("max_window_layers", 28)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    else:
        window, layer_types = None, []
    moe = architecture == "Qwen3MoeForCausalLM"
    if moe:
        if "num_experts" not in cfg and "num_local_experts" in cfg:  # transformers 5's name
            cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
        _required(cfg, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"))
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or defaults.get("head_dim") or cfg["hidden_size"] // heads,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings",
                                           defaults["max_position_embeddings"]),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "attention_bias": cfg.get("attention_bias", False),
        "mlp_bias": cfg.get("mlp_bias", False),
        "sliding_window": window if layer_types else None,
        "layer_types": tuple(layer_types),
        "num_experts": cfg["num_experts"] if moe else 0,
        "num_experts_per_tok": cfg["num_experts_per_tok"] if moe else 0,
        "moe_intermediate_size": cfg["moe_intermediate_size"] if moe else 0,
        "norm_topk_prob": cfg.get("norm_topk_prob", False) if moe else False,
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1) if moe else 1,
        "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()) if moe else (),
    }


def _read_gpt2(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's fields, under its own names (`n_embd`, `n_layer`, `n_head`, ...)."""
    _required(cfg, ("vocab_size", "n_embd", "n_layer", "n_head"))
    hidden, heads = cfg["n_embd"], cfg["n_head"]
    if hidden % heads:
        raise ValueError(f"config.json: n_embd ({hidden}) must be a multiple of n_head ({heads})")
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": cfg.get("n_inner") or 4 * hidden,
        "num_hidden_layers": cfg["n_layer"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # no grouped-query attention
        "head_dim": hidden // heads,
        "max_position_embeddings": cfg.get("n_positions", 1024),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        "hidden_act": cfg.get("activation_function", "gelu_new"),
        "layer_norm_epsilon": cfg.get("layer_norm_epsilon", 1e-5),
        "scale_attn_weights": cfg.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": cfg.get("scale_attn_by_inverse_layer_idx", False),
    }


__all__ = ["ROPE_TYPES", "ModelConfig", "resolve_dtype"]
