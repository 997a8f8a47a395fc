"""Rotary position embedding (RoPE), and the scalings that stretch it to longer contexts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


# --8<-- [start:rope]
class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "neox" style (rotate the two halves of a head).

    For head size `D`, pair `(x[i], x[i + D/2])` of a head at position `p`
    is rotated by angle `p * theta^(-2i/D)`:

        x[:D/2]' = x[:D/2] * cos - x[D/2:] * sin
        x[D/2:]' = x[D/2:] * cos + x[:D/2] * sin

    cos/sin are precomputed in float32 for every position once
    (`cos_sin_cache [max_position, D]`: cos then sin), so a step only gathers
    the rows of its `positions`.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        inv_freq = self._inv_freq(device)  # [D/2]
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        # (`_mscale` is 1 but for YaRN, which scales cos and sin alike.)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self._mscale()
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_position, D]

    def _inv_freq(self, device: torch.device | str | None) -> torch.Tensor:
        """`theta^(-2i/D)` for `i = 0 .. D/2 - 1`: each pair's angle per position."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.base ** (exponents / self.head_dim))

    def _mscale(self) -> float:
        return 1.0

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `q [T, Hq, D]` and `k [T, Hkv, D]` to the tokens' `positions [T]`."""
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]: broadcast over heads
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the heads `x [T, H, D]` by `cos, sin [T, 1, D/2]`."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
# --8<-- [end:rope]


# --8<-- [start:llama3]
class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's RoPE scaling: slow the low frequencies, keep the high ones.

    A pair whose wavelength `2 pi / inv_freq` is longer than the pretraining
    context / `low_freq_factor` never completed a turn in training: its
    frequency is divided by `factor` (interpolated). A pair whose wavelength
    is shorter than context / `high_freq_factor` is kept. Between the two, a
    linear blend of both in the wavelength's inverse:

        wavelength:  short ───────── high_wl ─────── low_wl ───────── long
        inv_freq:    kept             blend           inv_freq / factor
    """

    def __init__(self, head_dim: int, max_position: int, base: float, factor: float,
                 low_freq_factor: float, high_freq_factor: float,
                 original_max_position: int, device: torch.device | str | None = None) -> None:
        self.factor = factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.original_max_position = original_max_position
        super().__init__(head_dim, max_position, base, device)

    def _inv_freq(self, device: torch.device | str | None) -> torch.Tensor:
        inv_freq = super()._inv_freq(device)
        wavelen = 2 * math.pi / inv_freq
        low_wl = self.original_max_position / self.low_freq_factor
        high_wl = self.original_max_position / self.high_freq_factor
        # 0 at the long-wavelength end (interpolate), 1 at the short end (keep).
        smooth = ((self.original_max_position / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(wavelen < high_wl, inv_freq,
                           torch.where(wavelen > low_wl, inv_freq / self.factor, blended))
# --8<-- [end:llama3]


# --8<-- [start:yarn]
class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN (Peng et al. 2023): interpolate the slow pairs, extrapolate the fast ones,
    and scale cos/sin by `mscale` to keep the attention's softmax as sharp.

    Pair `i` turns `r_i = L / (2 pi theta^(2i/D))` times over the pretraining
    context `L`. Pairs turning more than `beta_fast` (32) times are kept
    (extrapolated); pairs turning fewer than `beta_slow` (1) times are divided
    by `factor` (interpolated); between them a linear ramp over the pair index:

        pair index:   0 ───── low ────────── high ───── D/2
        inv_freq:     kept    ramp               inv_freq / factor

    `mscale = 0.1 ln(factor) + 1` multiplies cos and sin, so q.k grows by
    `mscale^2` (its "attention factor"), as the paper prescribes.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, factor: float,
                 original_max_position: int, beta_fast: float = 32, beta_slow: float = 1,
                 attention_factor: float | None = None, truncate: bool = True,
                 device: torch.device | str | None = None) -> None:
        self.factor = factor
        self.original_max_position = original_max_position
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.truncate = truncate
        self.attention_factor = (attention_factor if attention_factor is not None
                                 else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
        super().__init__(head_dim, max_position, base, device)

    def _correction_dim(self, num_rotations: float) -> float:
        """The (fractional) pair index that turns `num_rotations` times over the context."""
        return (self.head_dim * math.log(self.original_max_position / (num_rotations * 2 * math.pi))
                / (2 * math.log(self.base)))

    def _inv_freq(self, device: torch.device | str | None) -> torch.Tensor:
        extrapolated = super()._inv_freq(device)  # [D/2]
        interpolated = extrapolated / self.factor
        low, high = self._correction_dim(self.beta_fast), self._correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.head_dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width
        ramp = ((torch.arange(self.head_dim // 2, dtype=torch.float32, device=device) - low)
                / (high - low)).clamp(0, 1)  # 0 up to `low`, 1 from `high`
        keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
        return interpolated * (1 - keep) + extrapolated * keep

    def _mscale(self) -> float:
        return self.attention_factor
# --8<-- [end:yarn]


# --8<-- [start:get_rope]
def get_rope(head_dim: int, max_position: int, base: float,
             rope_scaling: Mapping[str, Any] | None = None,
             device: torch.device | str | None = None) -> RotaryEmbedding:
    """The rotary embedding a checkpoint asks for (`config.json`'s rope scaling).

    Args:
        head_dim: the rotated head size.
        max_position: positions to precompute (the model's `max_position_embeddings`).
        base: `rope_theta`.
        rope_scaling: None for plain RoPE, else a mapping with `rope_type`
            `"llama3"` (`factor`, `low_freq_factor`, `high_freq_factor`,
            `original_max_position_embeddings`) or `"yarn"` (`factor`,
            `original_max_position_embeddings`, optional `beta_fast`,
            `beta_slow`, `attention_factor`, `truncate`).
        device: where the cos/sin table lives.

    Raises:
        ValueError: naming an unknown rope type or a missing parameter.
    """
    if rope_scaling is None:
        return RotaryEmbedding(head_dim, max_position, base, device)
    params = dict(rope_scaling)
    rope_type = params.get("rope_type", "default")
    original = params.get("original_max_position_embeddings") or max_position
    try:
        if rope_type == "default":
            return RotaryEmbedding(head_dim, max_position, base, device)
        if rope_type == "llama3":
            return Llama3RotaryEmbedding(
                head_dim, max_position, base, float(params["factor"]),
                float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                int(original), device)
        if rope_type == "yarn":
            factor = params.get("factor") or max_position / original
            if params.get("mscale") or params.get("mscale_all_dim"):
                raise ValueError("rope_scaling: yarn's mscale / mscale_all_dim are not supported")
            return YaRNScalingRotaryEmbedding(
                head_dim, max_position, base, float(factor), int(original),
                float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                params.get("attention_factor"), bool(params.get("truncate", True)), device)
    except KeyError as e:
        raise ValueError(f"rope_scaling: rope type {rope_type!r} needs {e.args[0]!r}") from None
    raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported "
                     "(default, llama3, yarn)")
# --8<-- [end:get_rope]


__all__ = ["Llama3RotaryEmbedding", "RotaryEmbedding", "YaRNScalingRotaryEmbedding",
           "apply_rotary_emb", "get_rope"]
