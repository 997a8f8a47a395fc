"""`SpeculativeConfig`: the engine argument `speculative_config`, named as vLLM names it.

Two proposers, chosen by the keys given:

```
{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
{"model": "./qwen3-0.6b", "num_speculative_tokens": 4}        (method "draft_model")
```

The value may be a dict, its JSON text (the CLI's `--speculative-config`) or
a `SpeculativeConfig`. `"adaptive": false` keeps `num_speculative_tokens` for
every sequence, whatever its acceptance (`policy.SpeculationPolicy`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mini_vllm.model_config import ModelConfig

METHODS = ("ngram", "draft_model")
# The longest run of proposals one step may verify: more is never worth a
# verification step (each extra token is accepted with probability a^k).
MAX_SPECULATIVE_TOKENS = 16
# n-gram lengths when neither bound is given.
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
           "model", "adaptive")


# --8<-- [start:config]
@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes and verifies tokens.

    Attributes:
        method: `"ngram"` (prompt lookup) or `"draft_model"` (a smaller model
            with the same tokenizer, its own weights and KV cache).
        num_speculative_tokens: the most tokens proposed per sequence and step (k).
        prompt_lookup_min / prompt_lookup_max: the shortest and longest
            suffix the n-gram proposer looks up in the sequence's history.
        model: the draft model's checkpoint directory (`draft_model` only).
        draft_model_config: its `config.json`, read once.
        adaptive: lower k, or stop speculating, for a sequence whose drafts
            are mostly rejected (`policy.SpeculationPolicy`).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_model_config: ModelConfig | None = None
    adaptive: bool = True

    @classmethod
    def from_user(cls, value: Any, target: ModelConfig) -> SpeculativeConfig | None:
        """Validate the engine argument against the target model.

        Args:
            value: None, a dict, its JSON text, or a `SpeculativeConfig`.
            target: the target model's configuration (the draft must share its vocabulary).

        Raises:
            ValueError: naming the field that is missing, unknown or out of range.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):  # (ValueError for every bad value, types included)
            raise ValueError("speculative_config must be a JSON object (a dict), "  # noqa: TRY004
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; "
                             f"the fields are {list(_FIELDS)}")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)} "
                             f"(or give 'model' for a draft model), got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(  # noqa: TRY004
                f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        if method == "ngram":
            if value.get("model") is not None:
                raise ValueError("speculative_config.model is for method 'draft_model', "
                                 "not 'ngram'")
            lo, hi = _lookup_bounds(value.get("prompt_lookup_min"), value.get("prompt_lookup_max"))
            return cls("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi, adaptive=adaptive)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if value.get(name) is not None:
                raise ValueError(f"speculative_config.{name} is for method 'ngram'")
        return cls("draft_model", k, model=_draft_dir(value.get("model")),
                   draft_model_config=_draft_config(value.get("model"), target),
                   adaptive=adaptive)
    # --8<-- [end:config]

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise unless the draft can compute every position a sequence may reach.

        Raises:
            ValueError: the draft's `max_position_embeddings` is below `max_model_len`.
        """
        cfg = self.draft_model_config
        if cfg is not None and cfg.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's max_position_embeddings "
                f"({cfg.max_position_embeddings}) is below max_model_len ({max_model_len})")

    # --8<-- [start:draft_memory]
    def draft_kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes the draft's KV cache adds to each block (0 without a draft).

        The draft keeps its own K/V in blocks numbered as the target's: one
        block id names a slot range in both caches, so one block table, one
        allocation and one rollback serve both models.
        """
        cfg = self.draft_model_config
        if cfg is None:
            return 0
        return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * (
            block_size * dtype.itemsize)

    def draft_weight_bytes(self, dtype: torch.dtype) -> int:
        """About what the draft's weights take in memory (0 without a draft)."""
        cfg = self.draft_model_config
        if cfg is None:
            return 0
        h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
        embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
        return (cfg.num_hidden_layers * layer + embeddings) * dtype.itemsize
    # --8<-- [end:draft_memory]


def _lookup_bounds(lo: Any, hi: Any) -> tuple[int, int]:
    """The n-gram bounds: one given sets the other; neither gives the defaults."""
    if lo is None and hi is None:
        return DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed "
                         f"prompt_lookup_max ({hi})")
    return lo, hi


def _draft_dir(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config.model must be the draft model's checkpoint "
                         f"directory, got {model!r}")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {model} has no config.json "
                         "(a Hugging Face checkpoint directory is needed)")
    return str(Path(model).resolve())


def _draft_config(model: str, target: ModelConfig) -> ModelConfig:
    """The draft's `config.json`, which must share the target's vocabulary."""
    draft = ModelConfig.from_pretrained(model)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size ({draft.vocab_size}) differs "
            f"from the target's ({target.vocab_size}); a draft must share the tokenizer")
    return draft


__all__ = ["DEFAULT_PROMPT_LOOKUP_MAX", "DEFAULT_PROMPT_LOOKUP_MIN", "MAX_SPECULATIVE_TOKENS",
           "METHODS", "SpeculativeConfig"]
