"""Rotary position embedding (RoPE), "rotate half" layout as in Hugging Face Llama checkpoints.

The inverse frequencies are computed once in float32 on the CPU; cos/sin are computed per step from
the flat `positions` tensor (cheap: `num_tokens x head_dim/2`), so no table is sized by the context
length. They are laid out once per step for every layer (full width, in the model's dtype, sin negated
on the first half), so a layer's rotation is four ops (`apply_rotary`): per-layer Python dispatch is
most of a batch-1 decode step outside its matmuls (docs/performance.md). Scaling types: plain,
"linear" (positions divided by `factor`) and "llama3" (long wavelengths divided by `factor`, short
ones kept, a smooth ramp between).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32 on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "llama3":
        return _llama3(inv_freq, factor, scaling)
    raise ValueError(f"unknown RoPE scaling type {scaling['rope_type']!r}")  # ModelConfig refuses it first


def _llama3(inv_freq: torch.Tensor, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long = wavelen > old_len / low  # low frequencies: fully scaled
    short = wavelen < old_len / high  # high frequencies: untouched
    scaled = torch.where(long, inv_freq / factor, inv_freq)
    ramp = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - ramp) * scaled / factor + ramp * scaled
    return torch.where(~long & ~short, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for a flat batch of positions. Not an nn.Module: it holds no weights and must
    stay float32 whatever dtype the model is cast to."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.head_dim = head_dim
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)

    @property
    def inv_freq(self) -> torch.Tensor:
        """`[head_dim // 2]` float32: the angle of position p at pair i is p * inv_freq[i] (in float32)."""
        return self._inv_freq

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[num_tokens]` long -> (cos, sin), each `[num_tokens, 1, head_dim]` in `dtype`
        (computed in float32): cos over both halves, sin negated over the first half (`apply_rotary`)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, num_heads, head_dim]`; cos/sin from `cos_sin` in x's dtype -> rotated x (a new
    contiguous tensor). Pairs dimension i with i + head_dim/2: the first half is `x1 * cos - x2 * sin`,
    the second `x2 * cos + x1 * sin`, bit for bit (`x2 * -sin` is `-(x2 * sin)` exactly); `roll` swaps
    the halves."""
    out = x * cos
    out += x.roll(x.shape[-1] // 2, -1) * sin
    return out
