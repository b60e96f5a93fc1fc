"""From logits to the distribution the user asked for, and draws from it.

`SamplingConfig` is the user's choice (temperature, top-k, top-p, seed). `probs` applies it to
logits in HF's order (temperature, then top-k, then top-p). Speculative decoding applies the same
transform to the target's and the draft's logits, so exactness holds for the chosen settings.
Draws take an explicit `torch.Generator`: seeded runs repeat exactly, and no global RNG is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SpeculantError


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise SpeculantError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SpeculantError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpeculantError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def top_token(logits: Tensor) -> Tensor:
    """The index of the largest logit per row, the first on ties: logits [..., V] -> [...] long.

    torch's max() does this ~2.5x faster than argmax() on CPU (80 vs 210 us for 151,936 logits), a
    cost every decoding round pays once per scored row.
    """
    return logits.max(-1).indices


def probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """logits [..., V] -> probabilities [..., V] under temperature / top-k / top-p (not for greedy)."""
    x = logits.float() / cfg.temperature
    V = x.shape[-1]
    if 0 < cfg.top_k < V:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        p_sorted = sorted_x.softmax(-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p; the most
        # likely token always stays.
        drop_sorted = (p_sorted.cumsum(-1) - p_sorted) >= cfg.top_p
        drop_sorted[..., 0] = False
        x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
    return x.softmax(-1)


def sample(p: Tensor, generator: torch.Generator) -> Tensor:
    """One draw per row: p [..., V] -> [...] long."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(p.shape[:-1])
