"""The gated delta rule of Qwen3.5's linear-attention layers over one pass: the states after each token and the
outputs, in C (kernels/delta.c) where the x86 kernels build, else in torch with the same arithmetic bit for bit.

Both run token by token with the same ops whatever the pass length, so a k-token verification pass leaves exactly
the states and outputs of k one-token passes. The sums over the key dimension run in one fixed order (i = 0, 1, ...),
one rounded multiply and one rounded add per term, which is what lets the two agree to the bit; torch's bmm (blocked
sums) would not.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from ..errors import SpeculantError
from . import native

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
MAX_V = 1024  # the kernel's per-head scratch


CHUNK = 32  # tokens per kernel call of a pass whose per-token states are not kept (a prompt): bounded memory


@functools.cache
def _library():
    """The kernels library with delta.c's entry points typed, or None where the x86 kernels do not run here."""
    try:
        lib = native.library()
    except SpeculantError:
        return None
    lib.delta_rule.argtypes = [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _p, ctypes.c_int]
    lib.qwen35_deltanet.argtypes = [_p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_int, _p, _p,
                                    _p, ctypes.c_float, _p, _p, _p, ctypes.c_int]
    lib.qwen35_attention.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, ctypes.c_float, _p, _p, _p, _p, _i64,
                                     _i64, ctypes.c_int, _p, ctypes.c_int]
    for fn in (lib.delta_rule, lib.qwen35_deltanet, lib.qwen35_attention):
        fn.restype = ctypes.c_int
    return lib


def _kernel():
    """delta.c's rule, or None where the x86 kernels do not run here (torch serves)."""
    lib = _library()
    return None if lib is None else lib.delta_rule


def layer_kernels():
    """delta.c's whole-layer entry points (qwen35_deltanet, qwen35_attention), or None where they do not run here:
    models/qwen35.py then takes its torch path."""
    return _library()


def delta_rule_reference(state: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor,
                         decay: Tensor) -> tuple[list[Tensor], Tensor]:
    """state [H, K, V], q/k [S, H, K], v [S, H, V], beta/decay [S, H] -> (the S states after each token,
    outputs [S, H, V])."""
    states, outs = [], []
    for t in range(q.shape[0]):
        cur = state * decay[t][:, None, None]
        kt, qt = k[t], q[t]
        mem = kt[:, 0, None] * cur[:, 0]
        for i in range(1, kt.shape[1]):
            mem = mem + kt[:, i, None] * cur[:, i]
        delta = (v[t] - mem) * beta[t][:, None]
        cur = cur + kt[:, :, None] * delta[:, None, :]
        o = qt[:, 0, None] * cur[:, 0]
        for i in range(1, qt.shape[1]):
            o = o + qt[:, i, None] * cur[:, i]
        states.append(cur)
        outs.append(o)
        state = cur
    return states, torch.stack(outs)


def delta_rule(state: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, decay: Tensor,
               every: bool = True) -> tuple[list[Tensor], Tensor]:
    """delta_rule_reference's result, from the C kernel where it runs (float32 CPU tensors); `every`: the states
    after each token, else the last alone (in chunks of CHUNK tokens, so a long prompt holds a few at a time)."""
    fn = _kernel()
    S, H, K = q.shape
    V = v.shape[-1]
    native_ok = fn is not None and state.device.type == "cpu" and state.dtype == torch.float32 and V <= MAX_V
    if every:
        return _run(fn if native_ok else None, state, q, k, v, beta, decay)
    outs = []
    for c in range(0, S, CHUNK):
        part = slice(c, c + CHUNK)
        states, o = _run(fn if native_ok else None, state, q[part], k[part], v[part], beta[part], decay[part])
        state = states[-1]
        outs.append(o)
    return [state], torch.cat(outs)


def _run(fn, state: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor,
         decay: Tensor) -> tuple[list[Tensor], Tensor]:
    if fn is None:
        return delta_rule_reference(state, q, k, v, beta, decay)
    S, H, K = q.shape
    V = v.shape[-1]
    args = [x.contiguous() for x in (state, q, k, v, beta, decay)]
    states = torch.empty(S, H, K, V)
    out = torch.empty(S, H, V)
    if fn(*(x.data_ptr() for x in args), S, H, K, V, states.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise SpeculantError(f"the delta-rule kernel refused a value head size of {V} (at most {MAX_V})")
    return list(states.unbind(0)), out


def deltanet_layer(lib, p: Tensor, xs: Tensor, conv: Tensor, state: Tensor, dims: tuple[int, int, int, int],
                   tiled: bool, neg_a: Tensor, dt_bias: Tensor, norm: Tensor, eps: float,
                   every: bool) -> tuple[list[Tensor], Tensor]:
    """delta.c's qwen35_deltanet over a pass: p [S, P] (in_proj's rows), xs [window + S, C] (the convolution window,
    then the pass's conv inputs), conv [K, C], state [hv, dk, dv] -> (the states after each row, or the last alone
    (`every` False: in chunks of CHUNK rows), out_proj's input [S, hv dv]). dims: hk, hv, dk, dv; C and dv
    multiples of 8, dv <= MAX_V."""
    S, P = p.shape
    K, C = conv.shape
    hk, hv, dk, dv = dims
    out = torch.empty(S, hv * dv)
    kept, step = [], S if every else CHUNK
    for c in range(0, S, step):
        n = min(step, S - c)
        states = torch.empty(n, hv, dk, dv)
        rc = lib.qwen35_deltanet(p[c].data_ptr(), P, xs[c].data_ptr(), conv.data_ptr(), K, n, C, hk, hv, dk, dv,
                                 int(tiled), neg_a.data_ptr(), dt_bias.data_ptr(), norm.data_ptr(), eps,
                                 state.data_ptr(), states.data_ptr(), out[c].data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError(f"the DeltaNet kernel failed ({rc})")
        kept = list(states.unbind(0)) if every else []
        state = states[-1]
    return kept if every else [state], out
