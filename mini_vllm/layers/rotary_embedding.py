"""Rotary position embedding (RoPE)."""

from __future__ import annotations

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
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        )  # [D/2]
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, D]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

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


__all__ = ["RotaryEmbedding", "apply_rotary_emb"]
