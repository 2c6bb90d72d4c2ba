"""Rotary position embeddings (the rotate-half layout of Llama/Qwen checkpoints), with the
`linear` and `llama3` frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from seedance.engine.errors import EngineError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `(head_dim // 2,)` in float32, scaled as the config says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        assert scaling is not None
        scaled: torch.Tensor = inv_freq / float(scaling["factor"])
        return scaled
    if rope_type == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise EngineError(
        "unknown_model",
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
    )


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to packed `(num_tokens, heads, head_dim)` queries and keys
    from a cos/sin table precomputed for every position."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        self.theta, self.scaling = theta, scaling
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)
        rope_inv_freq(head_dim, theta, scaling)  # reject unsupported scalings up front

    def build_tables(self, device: torch.device | str, max_position: int | None = None) -> None:
        """Compute the float32 cos/sin tables on `device` for positions below `max_position`
        (default: the model's maximum)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        count = self.max_position if max_position is None else min(max_position, self.max_position)
        positions = torch.arange(count, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
