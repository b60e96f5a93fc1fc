"""int8 weights: per-output-channel symmetric int8, multiplied by FBGEMM through torch's quantized ops.

FBGEMM on AVX2 is several times faster than fp32 for one row and stays cheap for 2-16 rows. Batch invariance:
FBGEMM's dynamic linear quantizes the *whole* activation matrix with one scale, so row i's result would
depend on the other rows. We normalise every row to max|x| = 1 and append the two constant columns
(+1, -1) (with zero weights) so that the activation range is exactly [-1, 1] in every call: the
quantisation parameters never change and each row's output depends on that row alone.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from ...errors import SpeculantError
from .base import QLinear

# FBGEMM's AVX2 kernel adds pairs of uint8 x int8 products in int16 with saturation. Full 8-bit
# activations (0..255) with weights limited to +-63 can never saturate (2 * 255 * 63 < 32767),
# and measured closer to float32 than 7-bit activations with +-127 weights.
WEIGHT_MAX = 63
REDUCE_RANGE = False


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric: weight[N, K] -> (q[N, K] int8 in +-WEIGHT_MAX, scale[N] fp32)."""
    w = weight.float()
    scale = (_absmax(w, 1) / WEIGHT_MAX).clamp_min(1e-12)
    q = torch.div(w, scale[:, None]).round_().clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)  # one temporary, not two
    return q, scale


def _absmax(w: Tensor, dim: int) -> Tensor:
    """w.abs().amax(dim), without the |w| temporary the size of the weight (a conversion allocates gigabytes)"""
    return torch.maximum(w.amax(dim=dim), w.amin(dim=dim).neg())


def smoothing_scales(act_absmax: Tensor, weight: Tensor, alpha: float = 0.5) -> Tensor:
    """SmoothQuant (Xiao et al. 2023) per-input-channel factors s[K]: x/s and W*s are easier to quantise.

    Activation outlier channels are divided down and the weights' matching columns scaled up, so the
    per-row activation range is no longer set by a few huge channels.
    """
    w_max = _absmax(weight.float(), 0).clamp_min(1e-5)  # [K]
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


