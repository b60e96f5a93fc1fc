"""int4 weights: 4-bit groups of 32 with an fp16 scale each, multiplied by an AVX2 kernel.

Format (like llama.cpp's Q4_0, 4.5 bits per weight): every output row is cut into groups of 32
input channels; a group stores 32 signed 4-bit values q in [-8, 7] (as the unsigned nibble q + 8)
and one fp16 scale d (times a per-matrix power of two, `gscale`, so fp16's range never matters).
The scale is chosen per group among a few candidates to minimise the squared rounding error,
weighted by the calibration activations' per-channel magnitude when those are known.

The matmul (speculant/kernels/q4.c) quantises each activation row per group of 32 to int8 (like
Q8_0), computes exact integer group sums with AVX2 and accumulates them in float32. Every row goes
through the same instructions whatever the number of rows M, so a row's output is bit-identical
whether it is computed alone or with others (speculative verification reproduces one-token decoding).

Prompt prefill (more than BF16_MIN_ROWS rows) multiplies the same weights in bf16 instead (below).
The C sources are compiled with gcc on first use (see native.py).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor, nn

from ..errors import SpeculantError
from . import native
from .quant import QLinear
from .transformer import ROW_WISE_MAX

GROUP = 32  # input channels per scale
ROWS = 8  # output rows interleaved per block (must match RB in q4.c)
_CANDIDATES = (7.0, 7.25, 7.5, 7.75, 8.0, 8.5, 9.0)  # |extreme| / scale tried per group
_REFINE = 2  # least-squares refinements of the best candidate


def _library(isa: str | None = None) -> ctypes.CDLL:
    lib = native.library(isa)
    if lib.q4_block_rows() != ROWS or lib.q4_group_size() != GROUP:
        raise SpeculantError("the int4 kernel does not match speculant/models/int4.py; delete "
                             f"{native.kernel_dir()} to rebuild it")
    return lib


def int4_available() -> bool:
    """Whether the int4 kernel runs here (CPU features and a compiler; builds it on first call)."""
    try:
        _library()
    except SpeculantError:
        return False
    return True


# Passes of more rows than this (prompt prefill) are multiplied in bf16, closer to the stored weights
# than the integer kernel (no 8-bit activations) and several times faster for 33-1000 rows. Every
# weight becomes bf16(q * d * gscale). On CPUs with AMX (Sapphire Rapids and later) q4_amx.c expands
# 64 output rows at a time into L2 and multiplies them on the tiles with fp32 sums: the 1.5B model's
# 130-token prefill took 356 ms against 534 ms through oneDNN, and its HumanEval greedy acceptance
# rose (draft-model tokens per round 3.9 -> 4.4), oneDNN's bf16 outputs having blurred the prompt's
# keys and values. Elsewhere with AVX512-BF16, oneDNN's GEMM gets the weights expanded a few
# thousand rows at a time. Shorter passes (decoding, speculative verification) always use the
# integer kernel, whose rows are batch-invariant. The same number bounds the transformer's row-wise
# attention: both separate "prefill" from "decode".
BF16_MIN_ROWS = ROW_WISE_MAX
_BF16_CHUNK_BYTES = 32 << 20  # expand at most this much bf16 weight at a time


@functools.cache
def bf16_prefill_available() -> bool:
    """Whether long passes take oneDNN's bf16 GEMM (AVX512-BF16; $SPECULANT_INT4_PREFILL=int8 turns it off)."""
    if os.environ.get("SPECULANT_INT4_PREFILL", "").lower() == "int8":
        return False
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= native.cpu_flags()


@functools.cache
def amx_prefill_available() -> bool:
    """Whether long passes run on AMX tiles (q4_amx.c; $SPECULANT_INT4_PREFILL=onednn or int8 turn it off)."""
    if os.environ.get("SPECULANT_INT4_PREFILL", "").lower() in ("int8", "onednn"):
        return False
    need = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
    return need <= native.cpu_flags() and _library().q4_amx_init() == 0


# ---------------------------------------------------------------------------------------------
# quantisation and layout (pure torch)


def quantize_q4(weight: Tensor, act_absmax: Tensor | None = None, chunk_rows: int = 1024
                ) -> tuple[Tensor, Tensor, float]:
    """weight[N, K] -> (q[N, K] int8 in [-8, 7], d[N, K/32] fp16, gscale) with w ~ q * d * gscale."""
    N, K = weight.shape
    if K % GROUP:
        raise SpeculantError(f"--dtype int4 needs input sizes that are multiples of {GROUP}; got a {N}x{K} matrix")
    G = K // GROUP
    imp = None
    if act_absmax is not None:
        imp = act_absmax.float().clamp_min(1e-6).square().reshape(1, G, GROUP)
        imp = imp / imp.mean()
    q = torch.empty(N, K, dtype=torch.int8)
    d = torch.empty(N, G, dtype=torch.float32)
    for n0 in range(0, N, chunk_rows):
        w = weight[n0 : n0 + chunk_rows].float().reshape(-1, G, GROUP)
        idx = w.abs().argmax(dim=-1, keepdim=True)
        extreme = w.gather(-1, idx)  # signed value of largest magnitude; it goes to the -8 side
        best_err = best_d = None
        for c in _CANDIDATES:
            dc = -extreme / c  # [n, G, 1]
            inv = torch.where(dc == 0, 0.0, 1.0 / dc)
            qc = torch.round(w * inv).clamp_(-8, 7)
            e = (qc * dc - w).square_()
            if imp is not None:
                e = e * imp
            e = e.sum(dim=-1, keepdim=True)
            if best_err is None:
                best_err, best_d = e, dc
            else:
                better = e < best_err
                best_err = torch.where(better, e, best_err)
                best_d = torch.where(better, dc, best_d)
        for _ in range(_REFINE):  # least-squares scale for the chosen integers, kept where it helps
            qb = torch.round(w * torch.where(best_d == 0, 0.0, 1.0 / best_d)).clamp_(-8, 7)
            wq = qb if imp is None else qb * imp
            num, den = (wq * w).sum(-1, keepdim=True), (wq * qb).sum(-1, keepdim=True)
            dn = torch.where(den > 0, num / den.clamp_min(1e-30), best_d)
            qn = torch.round(w * torch.where(dn == 0, 0.0, 1.0 / dn)).clamp_(-8, 7)
            e = (qn * dn - w).square_()
            if imp is not None:
                e = e * imp
            e = e.sum(dim=-1, keepdim=True)
            better = e < best_err
            best_err = torch.where(better, e, best_err)
            best_d = torch.where(better, dn, best_d)
        d[n0 : n0 + chunk_rows] = best_d.squeeze(-1)
    # scales as fp16 times a power of two that maps the largest into [1, 2)
    dmax = float(d.abs().max()) if d.numel() else 0.0
    gscale = 2.0 ** torch.floor(torch.log2(torch.tensor(dmax))).item() if dmax > 0 else 1.0
    d16 = (d / gscale).to(torch.float16)
    for n0 in range(0, N, chunk_rows):
        w = weight[n0 : n0 + chunk_rows].float().reshape(-1, G, GROUP)
        de = d16[n0 : n0 + chunk_rows].float()[..., None] * gscale  # the scale actually used
        inv = torch.where(de == 0, 0.0, 1.0 / de)
        q[n0 : n0 + chunk_rows] = torch.round(w * inv).clamp_(-8, 7).to(torch.int8).reshape(-1, K)
    return q, d16, gscale


def pack_q4(q: Tensor, d16: Tensor) -> tuple[Tensor, Tensor]:
    """q[N, K] int8, d16[N, G] -> kernel layout (qw uint8 [NB, G, 128], sc fp16 [NB, G, 8]), see q4.c."""
    N, K = q.shape
    G, NB = K // GROUP, -(-N // ROWS)
    pad = NB * ROWS - N
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if pad:
        u = torch.cat([u, torch.full((pad, K), 8, dtype=torch.uint8)])  # zero weights
        d16 = torch.cat([d16, torch.zeros(pad, G, dtype=torch.float16)])
    # [NB, r, G, h, i, b] with k = 16 h + 4 i + b  ->  [NB, G, i, r, b, h]
    t = u.reshape(NB, ROWS, G, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    qw = (t[..., 0] | (t[..., 1] << 4)).reshape(NB, G, 128).contiguous()
    sc = d16.reshape(NB, ROWS, G).transpose(1, 2).contiguous()
    return qw, sc


def unpack_q4(qw: Tensor, sc: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Inverse of pack_q4 for the first n rows: (q[n, K] int8, d16[n, G])."""
    NB, G, _ = qw.shape
    t = qw.reshape(NB, G, 4, ROWS, 4)  # [NB, G, i, r, b]
    lo, hi = t & 0x0F, t >> 4
    u = torch.stack([lo, hi], dim=-1)  # [NB, G, i, r, b, h]
    u = u.permute(0, 3, 1, 5, 2, 4).reshape(NB * ROWS, G * GROUP)  # [NB, r, G, h, i, b]
    q = (u.to(torch.int16) - 8).to(torch.int8)[:n].contiguous()
    d16 = sc.transpose(1, 2).reshape(NB * ROWS, G)[:n].contiguous()
    return q, d16


class Int4Linear(QLinear):
    """4-bit grouped weights, int8 activations, AVX2 kernel; batch-invariant (see module docstring)."""

    def __init__(self, q4: Tensor, q4scale: Tensor, shape: tuple[int, int], gscale: float,
                 bias: Tensor | None) -> None:
        super().__init__()
        N, K = shape
        if K % GROUP:
            raise SpeculantError(f"--dtype int4 needs input sizes that are multiples of {GROUP}; got {N}x{K}")
        NB, G = -(-N // ROWS), K // GROUP
        if tuple(q4.shape) != (NB, G, 128) or tuple(q4scale.shape) != (NB, G, ROWS):
            raise SpeculantError(f"int4 weights have shapes {tuple(q4.shape)}/{tuple(q4scale.shape)}, "
                                 f"expected {(NB, G, 128)}/{(NB, G, ROWS)} for {N}x{K}")
        self._fn = _library().q4_matmul
        self.out_features, self.in_features = N, K
        self.gscale = float(gscale)
        self.register_buffer("q4", q4.to(torch.uint8).contiguous(), persistent=False)
        # fp16 scales kept as their int16 bits, so that module-wide .float()/.half() leave them alone
        bits = q4scale if q4scale.dtype == torch.int16 else q4scale.to(torch.float16).view(torch.int16)
        self.register_buffer("q4scale", bits.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self._bind()

    def _bind(self) -> None:
        # the constant arguments of q4_matmul, resolved once (forward runs ~200 times per token)
        bias = self.bias
        self._args = (self.q4.data_ptr(), self.q4scale.data_ptr(), self.out_features,
                      None if bias is None else bias.data_ptr(), self.gscale)

    def _apply(self, fn, recurse=True):  # .to() & co. may move the tensors: re-read the pointers
        out = super()._apply(fn, recurse)
        bias_ok = self.bias is None or self.bias.dtype == torch.float32
        if self.q4.dtype != torch.uint8 or self.q4scale.dtype != torch.int16 or not bias_ok \
                or self.q4.device.type != "cpu":
            raise SpeculantError("int4 layers stay on the CPU in their own dtypes")
        self._bind()
        return out

    def __getstate__(self):  # the ctypes function is not picklable: bind it again on unpickling
        st = self.__dict__.copy()
        st.pop("_fn", None)
        return st

    def __setstate__(self, st):
        self.__dict__.update(st)
        self._fn = _library().q4_matmul
        self._bind()

    def forward(self, x: Tensor) -> Tensor:  # x [M, K] -> [M, N]
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        M, K = x.shape
        if K != self.in_features:
            raise ValueError(f"int4 linear expects {self.in_features} input features, got {K}")
        if M > BF16_MIN_ROWS and amx_prefill_available():
            return self._forward_amx(x)
        if M > BF16_MIN_ROWS and bf16_prefill_available():
            return self._forward_bf16(x)
        y = torch.empty(M, self.out_features, dtype=torch.float32)
        if M:
            q, s, n, b, gs = self._args
            if self._fn(x.data_ptr(), M, K, q, s, n, b, gs, y.data_ptr(), torch.get_num_threads()):
                raise MemoryError("int4 matmul: out of memory for its activation scratch")
        return y

    def _forward_amx(self, x: Tensor) -> Tensor:  # x [M, K] fp32, M > BF16_MIN_ROWS -> [M, N]
        M, K = x.shape
        Mp = -(-M // 16) * 16
        xb = torch.zeros(Mp, K, dtype=torch.bfloat16)  # rows padded for the tiles
        xb[:M] = x
        xb = xb.view(Mp // 16, 16, K // GROUP, GROUP).transpose(1, 2).contiguous()  # [Mp/16, G, 16, 32]: A tiles
        y = torch.empty(M, self.out_features, dtype=torch.float32)
        q, s, n, b, gs = self._args
        rc = _library().q4_matmul_amx(xb.data_ptr(), M, self.in_features, q, s, n, b, gs, y.data_ptr(),
                                      torch.get_num_threads())
        if rc == -2:
            raise SpeculantError("Linux refused the AMX tile state; set SPECULANT_INT4_PREFILL=onednn")
        if rc:
            raise MemoryError("int4 matmul: out of memory for its weight scratch")
        return y

    def _forward_bf16(self, x: Tensor) -> Tensor:  # x [M, K] fp32, M > BF16_MIN_ROWS -> [M, N]
        N, K = self.out_features, self.in_features
        xb = x.to(torch.bfloat16)
        y = torch.empty(x.shape[0], N, dtype=torch.float32)
        step = max(ROWS, min(N, _BF16_CHUNK_BYTES // (2 * K)) // ROWS * ROWS)  # rows per chunk
        w = torch.empty(min(step, N + (-N) % ROWS), K, dtype=torch.bfloat16)  # [rows, K] expanded weights
        threads = torch.get_num_threads()
        dequant = _library().q4_dequant_bf16
        for n0 in range(0, N, step):
            n1 = min(n0 + step, N)
            nb0, nb1 = n0 // ROWS, -(-n1 // ROWS)
            dequant(self.q4.data_ptr(), self.q4scale.data_ptr(), K, nb0, nb1, self.gscale, w.data_ptr(), threads)
            y[:, n0:n1] = torch.mm(xb, w[: n1 - n0].T)
        if self.bias is not None:
            y += self.bias
        return y

    def weight_bytes(self) -> int:
        return self.q4.numel() + self.q4scale.numel() * 2

    def state(self) -> dict[str, Tensor]:
        out = {"q4": self.q4, "q4scale": self.q4scale.view(torch.float16),
               "q4shape": torch.tensor([self.out_features, self.in_features], dtype=torch.int64),
               "q4gscale": torch.tensor([self.gscale], dtype=torch.float32)}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out

    @classmethod
    def from_state(cls, st: dict[str, Tensor]) -> "Int4Linear":
        N, K = (int(v) for v in st["q4shape"])
        return cls(st["q4"], st["q4scale"], (N, K), float(st["q4gscale"][0]), st.get("bias"))

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, act_absmax: Tensor | None = None) -> "Int4Linear":
        _library()  # fail before the (slow) quantisation where the kernel cannot run
        q, d16, gscale = quantize_q4(weight, act_absmax)
        qw, sc = pack_q4(q, d16)
        return cls(qw, sc, tuple(weight.shape), gscale, bias)

    def first_rows(self, n: int) -> "Int4Linear":
        n = min(n, self.out_features)
        q, d16 = unpack_q4(self.q4, self.q4scale.view(torch.float16), n)
        qw, sc = pack_q4(q, d16)
        bias = None if self.bias is None else self.bias.data[:n]
        return Int4Linear(qw, sc, (n, self.in_features), self.gscale, bias)

    def dequantized(self) -> Tensor:
        """The weight[N, K] in float32 that this layer stores (for tests and error analysis)."""
        q, d16 = unpack_q4(self.q4, self.q4scale.view(torch.float16), self.out_features)
        G = self.in_features // GROUP
        w = q.float().reshape(-1, G, GROUP) * (d16.float()[..., None] * self.gscale)
        return w.reshape(self.out_features, self.in_features)
