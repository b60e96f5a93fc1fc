"""Calibration for int8: the per-channel activation ranges that SmoothQuant folds into the weights.

A short fixed text (prose, code, a chat turn, numbers) is run through each float32 layer while the
model is assembled; the largest |input| per channel of every linear layer is recorded. The text is
fixed so that conversions are reproducible and cacheable.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache import KVCache
from .config import ModelConfig
from .formats.base import FloatLinear
from .block import Block

CALIBRATION_TEXT = """<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Write a Python function that returns the n-th Fibonacci number, and explain its complexity.<|im_end|>
<|im_start|>assistant
Here is an iterative version:

```python
def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number (fibonacci(0) == 0).\"\"\"
    if n < 0:
        raise ValueError("n must be non-negative")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
```

It runs in O(n) time and O(1) memory. For n = 90 it returns 2880067194370816120.
<|im_end|>
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined
movable metal type, oil-based ink and a wooden press. Within fifty years, presses operated in more than
two hundred cities across Europe; books became cheaper, literacy spread, and ideas travelled faster.
import numpy as np
x = np.linspace(0, 1, 100)
print(f"mean={x.mean():.3f}, std={x.std():.3f}")
SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;
Résumé: la méthode est simple, rapide et exacte. 简单的例子。 1 + 2 = 3; 17 * 23 = 391.
"""


class _Recorder(nn.Module):
    """Wraps a linear layer and records the largest |input| per channel."""

    def __init__(self, inner: FloatLinear) -> None:
        super().__init__()
        self.inner = inner
        self.absmax: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:  # x [S, K]
        a = x.abs().amax(dim=0)
        self.absmax = a if self.absmax is None else torch.maximum(self.absmax, a)
        return self.inner(x)


def calibrate_layer(cfg: ModelConfig, fl: dict[str, Tensor], x: Tensor, cos: Tensor, sin: Tensor,
                    names: tuple[str, ...]) -> tuple[dict[str, Tensor], Tensor]:
    """Run one float32 layer on calibration states x [T, D]; return ({linear: absmax[K]}, output [T, D])."""
    rec = {n: _Recorder(FloatLinear(fl[n], fl["qkv_bias"] if n == "qkv" else None)) for n in names}
    blk = Block(cfg, fl["attn_norm"], rec["qkv"], rec["o"], fl["ffn_norm"], rec["gate_up"], rec["down"])
    T = x.shape[0]
    cache = KVCache(1, cfg.n_kv_heads, cfg.head_dim, T, torch.float32, x.device)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.inference_mode():
        out = blk(x, cache, 0, 0, cos, sin, causal, row_wise=False)
    return {n: r.absmax for n, r in rec.items()}, out
