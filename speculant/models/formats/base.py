"""The linear-layer interface every weight format implements, and the float32 reference.

Every projection is a `QLinear`: `forward(x[M, K]) -> y[M, N]` for M = 1..few hundred rows. The
float32 format is the reference precision; the others live beside this file (see __init__.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Passes of up to this many tokens (decoding, speculative verification) are "short": every row goes
# through the same per-row kernels, so a token's logits do not depend on how many tokens share the
# pass. Longer passes (prompt prefill) may take faster batched routes.
SHORT_PASS_MAX = 32


class QLinear(nn.Module):
    """Common interface: a linear map stored in some format."""

    in_features: int
    out_features: int
    # Whether a row's output is the same bits with any CPU thread count (each output summed by one thread),
    # so the thread count may change between passes without changing a token (runtime.ThreadShare)
    thread_invariant: bool = True

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
    # torch's float32 matmul splits short passes across threads by the thread count: the 0.5B's logits of
    # 1- and 5-token passes differ in their last bits between 1 and 2 threads (tests/test_threads.py runs
    # the engine at several thread counts)
    thread_invariant = False

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.float().contiguous()
        if weight.device.type == "cpu" and weight.data_ptr() % 64:
            # MKL's one-row product sums in an order that depends on where the weight starts (16-, 32- and
            # 64-byte offsets give different last bits): a weight read from a safetensors file (8-byte
            # aligned) and the same weight converted in memory gave different logits. A fresh allocation is
            # 64-byte aligned, so a model's float32 results do not depend on where its weights came from.
            weight = weight.clone()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:  # x [M, K] -> [M, N]
        M = x.shape[0]
        if x.device.type != "cpu" and x.dim() == 2 and 0 < M < SHORT_PASS_MAX:
            # Off the CPU a short pass multiplies SHORT_PASS_MAX rows (zeros past M): cuBLAS picks its kernel,
            # and so its order of summation, by the shape, so a row's result would depend on how many rows
            # share the pass (M = 1 decoding vs M = 1 + k verification), and greedy speculative output could
            # leave `ar`'s at a near tie. One shape for every short pass keeps them batch-invariant; decoding
            # reads the weights either way, so the extra rows cost next to nothing.
            return F.linear(F.pad(x, (0, 0, 0, SHORT_PASS_MAX - M)), self.weight, self.bias)[:M]
        if x.dim() == 2 and 1 < M <= SHORT_PASS_MAX:
            # On the CPU MKL rounds a pass of M > 1 rows differently from M = 1, so a short pass goes row by
            # row through the M = 1 call a decode step makes: bit-identical to it. It reads the weights once a
            # row, at about the cost of MKL's own small-M GEMM (docs/measurements.md "float32 passes").
            w, b = self.weight, self.bias  # looked up once, not twice a row (nn.Module attribute lookups are slow)
            return torch.cat([F.linear(x[i : i + 1], w, b) for i in range(M)])
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
