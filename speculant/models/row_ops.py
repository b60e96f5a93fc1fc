"""The per-row ops of every layer (RMS norm, the gated MLP activations) as one C call each on the CPU (kernels/rows.c),
else torch's; and `native_kernels()`, the C kernels of short passes and per-row ops where they can be built. The C
kernels compute each row alone, so a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import SpeculantError


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [S, D] normalised per row, times weight [D]: one C call on CPU (torch's op is several; docs/measurements.md
    "Kernel choices", row kernels)."""
    fn = native_kernels()
    if fn is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] % 8:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    fn.rms_norm_rows(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
    return out


def _gated_rows(h: Tensor, hidden: int, kernel: str) -> Tensor | None:
    """rows.c's `kernel` on h [S, 2F] = gate | up -> [S, F] where the C kernels serve h, else None."""
    fn = native_kernels()
    if fn is None or h.device.type != "cpu" or h.dtype != torch.float32 or hidden % 8:
        return None
    h = h.contiguous()
    out = torch.empty(h.shape[0], hidden, dtype=h.dtype)
    getattr(fn, kernel)(h.data_ptr(), h.shape[0], hidden, out.data_ptr())
    return out


def swiglu(h: Tensor, hidden: int) -> Tensor:
    """h [S, 2F] = gate | up -> silu(gate) * up [S, F]: one C call on CPU."""
    out = _gated_rows(h, hidden, "silu_mul_rows")
    return F.silu(h[:, :hidden]) * h[:, hidden:] if out is None else out


def geglu(h: Tensor, hidden: int) -> Tensor:
    """h [S, 2F] = gate | up -> gelu_tanh(gate) * up [S, F] (Gemma's MLP): one C call on CPU."""
    out = _gated_rows(h, hidden, "gelu_tanh_mul_rows")
    return F.gelu(h[:, :hidden], approximate="tanh") * h[:, hidden:] if out is None else out


@functools.cache
def native_kernels():
    """The C kernels of short passes and per-row ops (speculant/kernels/), or None where they cannot be built."""
    from . import native
    from .fused import bind_tree_kernels

    try:
        return bind_tree_kernels(native.library())
    except SpeculantError:
        return None
