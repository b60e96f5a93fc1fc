"""Short passes through all the blocks in one C call (speculant/kernels/blocks.c).

The C loop runs the kernels Transformer.forward's Python path calls, in the same order, so the
result is bit-identical (tests/test_fused.py, for every architecture's switches); it saves the Python a
decode step otherwise spends between kernels, about a tenth of a step of the 1.5B target and of the 0.5B
draft (`scripts/step_timing.py`), and more of Gemma 3's (docs/measurements.md "Gemma 3 270M against
llama.cpp (AVX2 host)"). It applies where every block's linears are `GGMLLinear`s on the CPU and the x86
kernels are built; anything else keeps the Python path, whose row-wise attention is `attend_rows` here. Tree passes
(an [S, S] ancestor mask) and taps (the residual after chosen blocks, copied out in C) take it too.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from . import native
from .cache import KVCache
from .formats import GGMLLinear

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def bind_tree_kernels(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the argument types of the masked attention and the blocks loop with mask and taps
    (attention.c, blocks.c) set; the plain entry points are those with no mask and no taps."""
    lib.attn_rows_masked.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _i64, _p, _p, ctypes.c_int,
                                     ctypes.c_int]
    lib.attn_rows_masked.restype = ctypes.c_int
    lib.attn_rows_ex.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _i64, _p, _p, _i64, ctypes.c_float,
                                 _p, ctypes.c_int, ctypes.c_int]
    lib.attn_rows_ex.restype = ctypes.c_int
    lib.gq_blocks_ex.argtypes = [_p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _p, _p, _p, _p,
                                 _i64, _i64, _p, _p, ctypes.c_int, ctypes.c_int]
    lib.gq_blocks_ex.restype = ctypes.c_int
    return lib


def attend_rows(lib: ctypes.CDLL, block, qkv: Tensor, cache: KVCache, layer: int, start: int, cos: Tensor,
                sin: Tensor, mask: Tensor | None, positions: Tensor | None) -> Tensor:
    """The per-layer path's attention of a short pass (Block._attention): attn_rows_ex on `block`'s heads, its
    sliding window applied by the rows' positions, its query scale. qkv [S, (H + 2 Hkv) hd] -> [S, H hd]."""
    S, H, Hkv, hd = qkv.shape[0], block.n_heads, block.n_kv, block.hd
    qkv = qkv.contiguous()
    out = torch.empty(S, H * hd, dtype=torch.float32)
    m = None if mask is None else mask.to(torch.bool).contiguous()
    pos = None if block.window is None or positions is None else positions.to(torch.int64).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    rc = lib.attn_rows_ex(qkv.data_ptr(), S, H, Hkv, hd, cos.data_ptr(), sin.data_ptr(), cache.k[layer].data_ptr(),
                          cache.v[layer].data_ptr(), cache.max_len, start, None if m is None else m.data_ptr(),
                          None if pos is None else pos.data_ptr(), block.window or 0, _scale(block), out.data_ptr(),
                          cache.c_type, torch.get_num_threads())
    if rc:
        raise MemoryError(f"native attention failed ({rc})")
    return out


def _scale(block) -> float:
    """A block's query scale as the C attention takes it: 0 for hd ** -0.5 (the kernel's own 1 / sqrtf(hd))."""
    return 0.0 if block.scale == block.hd**-0.5 else block.scale


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _p), ("nparts", _i64), ("bias", _p), ("n", _i64)]


class _Block(ctypes.Structure):  # blocks.c's gq_block
    _fields_ = [("attn_norm", _p), ("ffn_norm", _p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("q_norm", _p), ("k_norm", _p), ("post_attn_norm", _p), ("post_ffn_norm", _p),
                ("window", _i64), ("rope", _i64), ("gelu", _i64), ("scale", ctypes.c_float)]


class FusedBlocks:
    """The blocks' weights as the C loop reads them; valid while the model's tensors stay put
    (Transformer drops it whenever `.to()` & co. may move them)."""

    def __init__(self, blocks, fn) -> None:
        table = (_Block * len(blocks))()
        for row, b in zip(table, blocks):
            row.attn_norm, row.ffn_norm = b.attn_norm.data_ptr(), b.ffn_norm.data_ptr()
            for name, w in b.extras().items():  # q_norm, k_norm, post_attn_norm, post_ffn_norm where the arch has them
                setattr(row, name, w.data_ptr())
            row.window, row.rope, row.gelu = b.window or 0, b.rope_table, int(b.gelu)
            row.scale = _scale(b)
            for name in ("qkv", "o", "gate_up", "down"):
                lin: GGMLLinear = getattr(b, name)
                bias = None if lin.bias is None else lin.bias.data_ptr()
                setattr(row, name, _Linear(ctypes.cast(lin.table, _p), len(lin.parts), bias, lin.out_features))
        self.table, self.n = table, len(blocks)
        self._keep = [getattr(b, n) for b in blocks for n in ("qkv", "o", "gate_up", "down")]
        self._keep += [w for b in blocks for w in b.extras().values()]
        b0 = blocks[0]
        self.dims = (b0.n_heads, b0.n_kv, b0.hd, b0.hidden_dim)
        self.eps = b0.eps
        self._fn = fn

    @classmethod
    def build(cls, blocks) -> "FusedBlocks | None":
        """The fused loop for these blocks, or None where it does not apply."""
        if not blocks or not native.available():
            return None
        for b in blocks:
            lins = (b.qkv, b.o, b.gate_up, b.down)
            if not all(type(m) is GGMLLinear for m in lins) or b.attn_norm.device.type != "cpu":
                return None
        H, Hkv, hd, F = blocks[0].n_heads, blocks[0].n_kv, blocks[0].hd, blocks[0].hidden_dim
        if hd % 8 or F % 8 or blocks[0].attn_norm.shape[0] % 8:
            return None
        return cls(blocks, bind_tree_kernels(native.library()).gq_blocks_ex)

    def __call__(self, x: Tensor, cache: KVCache, start: int, tables: list[tuple[Tensor, Tensor]],
                 positions: Tensor | None = None, mask: Tensor | None = None,
                 taps: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """x [S, D] float32 residual stream -> (after the last block (in place), {layer: [S, D] after it}
        for the block ids in `taps`); writes the cache. tables: the rows' rotary (cos, sin) [S, hd/2], indexed by
        the blocks' rope_table; positions [S] long (needed where a block slides a window), mask: [S, S] bool over
        the pass rows, or None."""
        H, Hkv, hd, F = self.dims
        S, D = x.shape
        kept = [t.contiguous() for pair in tables for t in pair]
        rope = (_p * len(kept))(*[t.data_ptr() for t in kept])
        pos = None if positions is None else positions.to(torch.int64).contiguous()
        tapped = {layer: x.new_empty(S, D) for layer in taps if 0 <= layer < self.n}
        ptrs = None
        if tapped:
            ptrs = (_p * self.n)(*[tapped[i].data_ptr() if i in tapped else None for i in range(self.n)])
        if mask is not None:
            mask = mask.to(torch.bool).contiguous()
        rc = self._fn(ctypes.byref(self.table), self.n, x.data_ptr(), S, D, H, Hkv, hd, F, self.eps, rope,
                      None if pos is None else pos.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), cache.max_len, start,
                      None if mask is None else mask.data_ptr(), ptrs, cache.c_type, torch.get_num_threads())
        if rc:
            raise MemoryError(f"fused blocks failed ({rc}): out of memory for scratch")
        return x, tapped
