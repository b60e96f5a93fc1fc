"""Rotary position embeddings: the tables (float32, as HF computes them) and the rotate-half rotation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .config import ModelConfig


def rope_tables(cfg: ModelConfig, n: int, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos, sin [n, hd/2] for positions 0..n-1, in float32 the way HF computes them (local: the
    sliding-window layers' rotary)."""
    return tables(cfg.local_inv_freq() if local else cfg.inv_freq(), n)


def tables(inv_freq: Sequence[float], n: int) -> tuple[Tensor, Tensor]:
    """cos, sin [n, len(inv_freq)] of the given inverse frequencies for positions 0..n-1, in float32."""
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), torch.tensor(inv_freq, dtype=torch.float32))
    return freqs.cos(), freqs.sin()


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary embedding. x [S, heads, hd], cos/sin [S, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
