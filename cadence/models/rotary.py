"""Rotary position embedding in the Hugging Face "rotate_half" layout.

Each head vector of size D (or its first R = rotary_dim values, with partial
rotary) is split in two halves; dimension i of the first
half and dimension i of the second half form one rotating pair with angle
``position * inv_freq[i]``:

    x = [x1 | x2]            (x1, x2: D/2 each)
    out = [x1*cos - x2*sin | x2*cos + x1*sin]

The cos/sin tables are computed once for every position up to
``max_position_embeddings`` and indexed by each token's own position, so a
flattened batch of tokens from several sequences needs no extra bookkeeping.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cadence.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Rotation speed of each of the R/2 pairs (R = rotary_dim), after any rope scaling. float32 [R/2]."""
    exponents = torch.arange(0, config.rotary_dim, 2, dtype=torch.int64).float() / config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)  # [D/2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: slow down long wavelengths, keep short ones, blend between.

    wavelength < original_len / high_freq_factor  -> unchanged
    wavelength > original_len / low_freq_factor   -> divided by factor
    in between                                    -> linear blend in 1/wavelength
    """
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original_len = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_len / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    in_between = (wavelength >= original_len / high) & (wavelength <= original_len / low)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position, built once; ``forward`` looks tokens up.

    A row's two halves are equal (pair i's angle in both), so the tables keep one
    half, [P, R/2], and a lookup joins it to itself: Gemma 3's two pairs of
    tables for 32k positions of 256 values took 128 MiB whole.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, inverse_frequencies(config))  # [P, R/2]
        # Buffers (they follow model.to(device)) but not state: never saved or loaded.
        self.register_buffer("cos", angles.cos(), persistent=False)  # [P, R/2]
        self.register_buffer("sin", angles.sin(), persistent=False)  # [P, R/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, R] for tokens at ``positions`` [T], ready to broadcast over heads."""
        cos, sin = self.rows(positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def limit_positions(self, num_positions: int) -> None:
        """Keep the tables' first ``num_positions`` rows only (the engine's
        ``max_model_len``): a model trained for 32k positions need not hold
        32k rows per table for an engine that never goes past 2k."""
        if num_positions < self.cos.shape[0]:
            self.cos = self.cos[:num_positions].clone()
            self.sin = self.sin[:num_positions].clone()

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [T, R] for tokens at ``positions`` (what ``fused_ops.rotary_`` reads)."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] with cos/sin [T, 1, R] from ``RotaryEmbedding``.

    With partial rotary (R < D) only the first R values of each head turn;
    the other D - R pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned, passed = x.split([rotary_dim, x.shape[-1] - rotary_dim], dim=-1)
        return torch.cat([apply_rotary(turned, cos, sin), passed], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    rotated_half = torch.cat([-x2, x1], dim=-1)  # [T, H, D]
    return x * cos + rotated_half * sin
