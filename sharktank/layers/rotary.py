"""Rotary position embeddings (half-rotation layout, as Hugging Face Llama), with the llama3
frequency scaling variant. Angles are computed in float32."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import ops

__all__ = ["rope_inv_freq", "rotary_angles", "rotary_cos", "rotary_sin", "rotary_cos_sin", "apply_rotary"]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for i < head_dim / 2 (float32).

    llama3 scaling keeps high frequencies, divides low ones by ``factor`` and blends the band
    between by the wavelength's position in the original context. ``{"rope_type": "factors",
    "factors": [...]}`` divides frequency ``i`` by ``factors[i]`` (llama.cpp's ``rope_freqs``
    tensor: the same scaling, precomputed per frequency).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv
    if scaling.get("rope_type") == "factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope factors: {factors.numel()} given, head_dim {head_dim} has {inv.numel()} frequencies")
        return inv / factors
    factor = scaling["factor"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    blend = ((context / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    # blend is 0 for long wavelengths (scaled by 1/factor) and 1 for short ones (kept).
    return inv / factor * (1 - blend) + inv * blend


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``positions[..., None] * inv_freq`` in float32, doubled to the head dim and shaped
    ``[*positions.shape, 1, head_dim]`` to broadcast over heads."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return torch.cat([angles, angles], dim=-1)[..., None, :]


def rotary_cos(angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos of :func:`rotary_angles`, in ``dtype``."""
    return angles.cos().to(dtype)


def rotary_sin(angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sin of :func:`rotary_angles`, in ``dtype``."""
    return angles.sin().to(dtype)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of :func:`rotary_angles` of ``positions``, in ``dtype``."""
    angles = rotary_angles(positions, inv_freq)
    return rotary_cos(angles, dtype), rotary_sin(angles, dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_rotary(x, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``x`` (``[B, S, heads, head_dim]``, plain or split on heads) by the angles."""
    return ops.elementwise(_rotate, x, cos, sin)
