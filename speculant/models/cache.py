"""A preallocated, position-indexed KV cache.

Slots 0..length-1 hold committed keys/values. A forward writes its S new tokens at slots
length..length+S-1 and advances `length`; `rollback(n)` is O(1) (it moves the length: the stale
slots are simply overwritten later); `keep(indices)` commits a subset of the last forward's slots
(a tree path) with one gather-copy per layer.

Keys and values are stored in float32, float16 or q8_0 (`--kv-dtype`, KV_DTYPES): float16 rounds each
value once as it is written (to nearest even); q8_0 quantizes each 32 values of a head's row to llama.cpp's
block_q8_0 (an fp16 scale and 32 int8, 8.5 bits a value: q8_0_rows) after rotating the row by a Walsh-Hadamard
matrix (hadamard), a quarter of float32's memory and of what one-token decoding streams of it. Every read widens
exactly (q8_0: d * q is exact in float32), so every computation on the cache stays float32 (a q8_0 cache's
queries and outputs are rotated to match). Speculative output is still the target's: `ar` and every method
read the same rounded cache. float16 is the default (llama.cpp's too) except beside float32 weights, the
reference, which keep a float32 cache (default_kv_dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpeculantError


# --kv-dtype choices: the torch dtype of the cache's storage (q8_0: the blocks' bytes, as int8)
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8_0": torch.int8}
Q8_BLOCK = 32  # values per q8_0 block: an fp16 scale, then 32 int8 (Q8_BYTES)
Q8_BYTES = 34


def default_kv_dtype(weights: str) -> str:
    """The cache type a model in weight format `weights` gets unless asked otherwise: f16 (almost the same
    fidelity as f32 and faster decoding after long prompts: `scripts/kv_fidelity.py`, `scripts/kv_decode.py`,
    docs/measurements.md "KV cache"), f32 beside the float32 reference weights, so that the reference stays
    float32."""
    return "f32" if weights == "float32" else "f16"


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --kv-dtype choice; a clear error for anything else."""
    if name not in KV_DTYPES:
        raise SpeculantError(f"unknown --kv-dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-dtype choice naming a cache's torch dtype (kv_dtype's inverse)."""
    return next(name for name, d in KV_DTYPES.items() if d == dtype)


def check_kv_dtype(dtype: torch.dtype, head_dim: int) -> None:
    """A clear error for a cache type that cannot hold this model's heads (q8_0 needs whole 32-value blocks)."""
    if dtype not in KV_DTYPES.values():
        raise SpeculantError(f"a KV cache holds {', '.join(KV_DTYPES)}, not {dtype}")
    if dtype == torch.int8 and head_dim % Q8_BLOCK:
        raise SpeculantError(f"--kv-dtype q8_0 needs heads of whole {Q8_BLOCK}-value blocks; this model's heads have "
                             f"{head_dim} values: choose --kv-dtype f16 or f32")


def rot_size(hd: int) -> int:
    """Values per Walsh-Hadamard rotation of a q8_0 cache row: the largest power of 2 dividing hd, at most 128."""
    return min(hd & -hd, 128)


def hadamard(x: Tensor) -> Tensor:
    """x [..., hd] times the unnormalised Walsh-Hadamard matrix (entries +-1; H H = n I) on each block of
    n = rot_size(hd) values, butterflies in attention_cache.h's order (so the same bits). A q8_0 cache stores its rows
    rotated, as llama.cpp's quantized caches do: a channel far larger than its row's others (the 1.5B's layer-0
    keys reach ~300 beside values near 1) is spread over the block instead of setting a scale that drowns the
    rest (`scripts/kv_fidelity.py`: rotated, the 1.5B's mean KL to float32 with a q8_0 cache is about 2/3 of the
    unrotated one's; docs/measurements.md "KV cache")."""
    shape, n = x.shape, rot_size(x.shape[-1])
    y, h = x.float().reshape(-1, n), 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y, h = torch.stack((a + b, a - b), 2).view(-1, n), 2 * h
    return y.view(shape)


def q8_0_rows(x: Tensor) -> Tensor:
    """x [..., hd] (hd a multiple of 32) rotated (hadamard) and stored as q8_0 blocks (q8_0_blocks)."""
    return q8_0_blocks(hadamard(x))


def q8_0_values(r: Tensor) -> Tensor:
    """q8_0 rows [..., n * 34] int8 (q8_0_rows) -> the values [..., n * 32] float32 they hold, rotated back."""
    y = q8_0_dequantized(r)
    return hadamard(y) * (1.0 / rot_size(y.shape[-1]))  # a power of 2: exact


def q8_0_blocks(x: Tensor) -> Tensor:
    """x [..., hd] (hd a multiple of 32) as q8_0 blocks [..., hd / 32 * 34] int8: per 32 values d = amax / 127 as
    fp16, then q = round(x * (1 / d)) (0 where d is 0), as ggml's quantize_row_q8_0_ref but rounding halves to
    even. attention_cache.h's store_row makes the same bytes (tests/test_attention_kernel.py)."""
    lead, hd = x.shape[:-1], x.shape[-1]
    b = x.float().reshape(*lead, hd // Q8_BLOCK, Q8_BLOCK)
    d = b.abs().amax(-1, keepdim=True) / torch.full((), 127.0)
    inv = torch.where(d > 0, torch.ones(()) / d, torch.zeros(()))
    q = torch.round(b * inv).to(torch.int8)
    return torch.cat([d.half().view(torch.int8), q], -1).reshape(*lead, hd // Q8_BLOCK * Q8_BYTES)


def q8_0_dequantized(r: Tensor) -> Tensor:
    """q8_0 blocks [..., n * 34] int8 -> their values [..., n * 32] float32, exactly d * q."""
    lead, n = r.shape[:-1], r.shape[-1] // Q8_BYTES
    b = r.reshape(*lead, n, Q8_BYTES)
    return (b[..., 2:].float() * b[..., :2].contiguous().view(torch.float16).float()).reshape(*lead, n * Q8_BLOCK)


class KVCache:
    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        check_kv_dtype(dtype, head_dim)
        self.max_len = max_len
        self.head_dim = head_dim
        row = head_dim // Q8_BLOCK * Q8_BYTES if dtype == torch.int8 else head_dim
        # [layers, kv_heads, max_len, row]: one block each so keep() gathers all layers at once.
        self.k = torch.zeros(n_layers, n_kv_heads, max_len, row, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @property
    def dtype(self) -> torch.dtype:
        """KV_DTYPES' value of the cache type (the storage's dtype)."""
        return self.k.dtype

    @property
    def c_type(self) -> int:
        """The C kernels' cache type (attention_cache.h's KV_F32, KV_F16, KV_Q8): its place in KV_DTYPES."""
        return list(KV_DTYPES.values()).index(self.k.dtype)

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
        if self.dtype == torch.int8:
            self.k[layer, :, start:end] = q8_0_rows(k)
            self.v[layer, :, start:end] = q8_0_rows(v)
            return q8_0_values(self.k[layer, :, :end]), q8_0_values(self.v[layer, :, :end])
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
