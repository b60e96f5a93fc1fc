"""A preallocated, position-indexed KV cache.

Slots 0..length-1 hold committed keys/values. A forward writes its S new tokens at slots
length..length+S-1 and advances `length`; `rollback(n)` is O(1) (it moves the length: the stale
slots are simply overwritten later); `keep(indices)` commits a subset of the last forward's slots
(a tree path) with one gather-copy per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpeculantError


class KVCache:
    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_len = max_len
        # [layers, kv_heads, max_len, head_dim]: one block each so keep() gathers all layers at once.
        self.k = torch.zeros(n_layers, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def reserve(self, s: int) -> tuple[int, int]:
        """Slots [start, end) for s new tokens; raises if the context is full."""
        start, end = self.length, self.length + s
        if end > self.max_len:
            raise SpeculantError(
                f"context full: {end} tokens exceed the cache of {self.max_len}; use a shorter prompt or fewer new tokens"
            )
        return start, end

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [kv_heads, S, head_dim] at `start`; return the layer's keys/values up to the new end."""
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def keep(self, base: int, indices: Tensor) -> None:
        """Keep slots base+indices (ascending, relative to base) as base..base+n-1; drop the rest."""
        n = indices.numel()
        src = indices + base
        self.k[:, :, base : base + n] = self.k.index_select(2, src)
        self.v[:, :, base : base + n] = self.v.index_select(2, src)
        self.length = base + n
