"""Weight formats for the Transformer's linear layers.

Every projection is a `QLinear`: `forward(x[M, K]) -> y[M, N]` for M = 1..few hundred rows. The
float32 format is the reference precision; int8 stores per-output-channel symmetric int8 weights
and multiplies with FBGEMM (through torch's quantized ops), which on AVX2 is ~6x faster than fp32
for one row and stays cheap for 2-16 rows, the regime speculative verification lives in.

Batch invariance matters for exactness: FBGEMM's dynamic linear quantizes the *whole* activation
matrix with one scale, so row i's result would depend on the other rows, and scoring k drafted
tokens together would not give the logits that scoring them one by one gives. We normalise every
row to max|x| = 1 and append the two constant columns (+1, -1) (with zero weights) so that the
activation range is exactly [-1, 1] in every call: the quantisation parameters never change, the
integer GEMM is exact, and each row's output depends on that row alone.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpeculantError

WeightFormat = Literal["float32", "int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("float32", "int8", "int4")


class QLinear(nn.Module):
    """Common interface: a linear map stored in some format."""

    in_features: int
    out_features: int

    def weight_bytes(self) -> int:
        """Bytes of weight data read by one forward (for bandwidth accounting)."""
        raise NotImplementedError

    def state(self) -> dict[str, Tensor]:
        """Plain tensors that `from_state` rebuilds this layer from (for the conversion cache)."""
        raise NotImplementedError

    def first_rows(self, n: int) -> "QLinear":
        """The layer restricted to output rows [0, n) (a draft head over a reduced vocabulary)."""
        st = {k: (v[:n] if k in ("weight", "qweight", "scale", "bias") else v) for k, v in self.state().items()}
        return type(self).from_state(st)


class FloatLinear(QLinear):
    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:  # x [M, K] -> [M, N]
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return self.weight.numel() * 4

    def state(self) -> dict[str, Tensor]:
        out = {"weight": self.weight.data}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out

    @classmethod
    def from_state(cls, st: dict[str, Tensor]) -> "FloatLinear":
        return cls(st["weight"], st.get("bias"))


# FBGEMM's AVX2 kernel adds pairs of uint8 x int8 products in int16 with saturation. Full 8-bit
# activations (0..255) with weights limited to +-63 can never saturate (2 * 255 * 63 < 32767),
# and measured closer to float32 than 7-bit activations with +-127 weights.
WEIGHT_MAX = 63
REDUCE_RANGE = False


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric: weight[N, K] -> (q[N, K] int8 in +-WEIGHT_MAX, scale[N] fp32)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / WEIGHT_MAX).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
    return q, scale


def smoothing_scales(act_absmax: Tensor, weight: Tensor, alpha: float = 0.5) -> Tensor:
    """SmoothQuant (Xiao et al. 2023) per-input-channel factors s[K]: x/s and W*s are easier to quantise.

    Activation outlier channels are divided down and the weights' matching columns scaled up, so the
    per-row activation range is no longer set by a few huge channels.
    """
    w_max = weight.float().abs().amax(dim=0).clamp_min(1e-5)  # [K]
    a_max = act_absmax.float().clamp_min(1e-5)
    return (a_max.pow(alpha) / w_max.pow(1 - alpha)).clamp_min(1e-5)


class Int8Linear(QLinear):
    """int8 weights, FBGEMM dynamic-quantised matmul, batch-invariant (see module docstring)."""

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None, in_scale: Tensor | None = None) -> None:
        super().__init__()
        # in_scale[K] = 1/s of SmoothQuant, applied to the input (the weights were multiplied by s).
        self.register_buffer("in_scale", None if in_scale is None else in_scale.float().contiguous(), persistent=False)
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise SpeculantError("--dtype int8 needs torch's FBGEMM backend (x86 CPUs); use --dtype float32")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        n = self.out_features
        padded = torch.cat([qweight, torch.zeros(n, 2, dtype=torch.int8)], dim=1)  # [N, K+2]
        with warnings.catch_warnings():  # torch deprecates quantized tensors; the kernels remain
            warnings.simplefilter("ignore")
            qt = torch._make_per_channel_quantized_tensor(
                padded, scale.double(), torch.zeros(n, dtype=torch.long), 0
            )
            self._packed = torch.ops.quantized.linear_prepack(qt, None)
        self.register_buffer("_pm", torch.tensor([[1.0, -1.0]]), persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x [M, K] -> [M, N]
        if self.in_scale is not None:
            x = x * self.in_scale
        m = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)  # [M, 1]
        xa = torch.cat([x / m, self._pm.expand(x.shape[0], 2)], dim=-1)  # [M, K+2], range exactly [-1, 1]
        y = torch.ops.quantized.linear_dynamic(xa, self._packed, REDUCE_RANGE)
        y = y * m
        if self.bias is not None:
            y = y + self.bias
        return y

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def state(self) -> dict[str, Tensor]:
        out = {"qweight": self.qweight, "scale": self.scale}
        if self.bias is not None:
            out["bias"] = self.bias.data
        if self.in_scale is not None:
            out["in_scale"] = self.in_scale
        return out

    @classmethod
    def from_state(cls, st: dict[str, Tensor]) -> "Int8Linear":
        return cls(st["qweight"], st["scale"], st.get("bias"), st.get("in_scale"))

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, act_absmax: Tensor | None = None) -> "Int8Linear":
        if act_absmax is None:
            q, s = quantize_int8(weight)
            return cls(q, s, bias)
        smooth = smoothing_scales(act_absmax, weight)
        q, s = quantize_int8(weight * smooth)
        return cls(q, s, bias, 1.0 / smooth)


def make_linear(weight: Tensor, bias: Tensor | None, fmt: str, act_absmax: Tensor | None = None) -> QLinear:
    """Build a linear layer in `fmt` from a float weight[N, K] (and bias[N]).

    `act_absmax[K]`, the largest |input| per channel seen on calibration text, lets int8 smooth
    activation outliers into the weights.
    """
    if fmt == "float32":
        return FloatLinear(weight, bias)
    if fmt == "int8":
        return Int8Linear.from_float(weight, bias, act_absmax)
    if fmt == "int4":
        from .int4 import Int4Linear  # lazy: int4 imports this module

        return Int4Linear.from_float(weight, bias, act_absmax)
    raise SpeculantError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


def linear_from_state(st: dict[str, Tensor], fmt: str) -> QLinear:
    if fmt == "int4":
        from .int4 import Int4Linear

        return Int4Linear.from_state(st)
    return {"float32": FloatLinear, "int8": Int8Linear}[fmt].from_state(st)
