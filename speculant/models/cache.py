"""A preallocated, position-indexed KV cache.

Slots 0..length-1 hold committed keys/values. A forward writes its S new tokens at slots
length..length+S-1 and advances `length`; `rollback(n)` is O(1) (it moves the length: the stale
slots are simply overwritten later); `keep(indices)` commits a subset of the last forward's slots
(a tree path) with one gather-copy per layer.

Keys and values are stored in float32 or float16 (`--kv-dtype`, KV_DTYPES): float16 rounds each
value once as it is written (to nearest even) and halves the cache's memory and what one-token
decoding streams of it; every computation on it stays float32. Speculative output is still the
target's: `ar` and every method read the same rounded keys and values. float16 is the default
(llama.cpp's too) except beside float32 weights, the reference, which keep a float32 cache
(default_kv_dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpeculantError


KV_DTYPES = {"f32": torch.float32, "f16": torch.float16}  # --kv-dtype choices


def default_kv_dtype(weights: str) -> str:
    """The cache type a model in weight format `weights` gets unless asked otherwise: f16 (2 Zen 4 cores,
    README "KV cache": mean KL to float32 0.001382 -> 0.001405, `ar` decode +10% on 600-1,000-token prompts,
    +17-27% after 3,000), f32 beside the float32 reference weights, so that the reference stays float32."""
    return "f32" if weights == "float32" else "f16"


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --kv-dtype choice; a clear error for anything else."""
    if name not in KV_DTYPES:
        raise SpeculantError(f"unknown --kv-dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-dtype choice naming a cache's torch dtype (kv_dtype's inverse)."""
    return next(name for name, d in KV_DTYPES.items() if d == dtype)


class KVCache:
    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if dtype not in KV_DTYPES.values():
            raise SpeculantError(f"a KV cache holds float32 or float16, not {dtype}")
        self.max_len = max_len
        # [layers, kv_heads, max_len, head_dim]: one block each so keep() gathers all layers at once.
        self.k = torch.zeros(n_layers, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @property
    def half(self) -> int:
        """The C kernels' kv16 flag: 1 for a float16 cache."""
        return int(self.k.dtype == torch.float16)

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
