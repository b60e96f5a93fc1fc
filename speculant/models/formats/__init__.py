"""Weight formats: how a linear layer's weights are stored and which kernel multiplies them.

One registry for every format (`FORMATS`). A format never imports the transformer and the transformer
never imports a concrete format: it only calls `QLinear.forward(x[M, K]) -> [M, N]`.

| `--dtype` | stored as | multiplied by |
|---|---|---|
| `gguf` (default for .gguf files) | each tensor in the block type the file stores (Q4_K, Q6_K, Q8_0, ...), memory-mapped | `kernels/gq.c`: int8 activations per row, integer dot products with the file's own (sub-)block scales |
| `q6_k`, `q4_k` | that GGML K-quant type (q4_k keeps the output layer in Q6_K, as llama.cpp's K mixes do; rows not a multiple of 256 wide fall back to Q5_0 / Q8_0, as in llama.cpp), quantized on load by `kernels/kquant.c` (llama.cpp's reference algorithms) | `kernels/gq.c` |
| `q8_0`, `q5_1`, `q5_0`, `q4_1`, `q4_0`, `bf16`, `f16` | that GGML block type, quantized on load by the `gguf` package's reference quantizers (for HF folders; on a .gguf file this requantizes it) | `kernels/gq.c` |
| `float32` | fp32 | `F.linear`: the reference |
| `int8` | per-channel int8, SmoothQuant-calibrated | FBGEMM (torch) |
"""

from __future__ import annotations

from .base import FloatLinear, QLinear, SHORT_PASS_MAX
from .ggml import GGMLEmbedding, GGMLLinear
from .ggml_blocks import GGML_TYPES
from .ggml_routes import ggml_available

__all__ = ["FORMATS", "FloatLinear", "GGMLEmbedding", "GGMLLinear", "GGML_TYPES", "QLinear", "SHORT_PASS_MAX",
           "HEAD_FORMAT", "KQUANT_FORMATS", "WEIGHT_FORMATS", "ggml_available", "linear_from_state", "make_linear"]

# name -> what it is (for --help and errors); "gguf" has no float source: it takes the file's blocks.
FORMATS: dict[str, str] = {
    "gguf": "the GGUF file's own block types, memory-mapped (default for .gguf files)",
    "float32": "float32, the reference",
    "bf16": "bfloat16",
    "f16": "float16",
    "q8_0": "GGML Q8_0 (8.5 bits/weight)",
    "q6_k": "GGML Q6_K (6.56 bits/weight)",
    "q5_1": "GGML Q5_1 (6 bits/weight)",
    "q5_0": "GGML Q5_0 (5.5 bits/weight)",
    "q4_1": "GGML Q4_1 (5 bits/weight)",
    "q4_k": "GGML Q4_K (4.5 bits/weight; the output layer Q6_K)",
    "q4_0": "GGML Q4_0 (4.5 bits/weight)",
    "int8": "per-channel int8 through FBGEMM, SmoothQuant-calibrated",
}
WEIGHT_FORMATS: tuple[str, ...] = tuple(FORMATS)
CALIBRATED = ("int8",)  # formats that want activation ranges from calibration text
# the output layer's format where it differs: llama.cpp's K mixes keep it in Q6_K (it is the layer
# most sensitive to quantization; ~15% of a 1.5B's weights)
HEAD_FORMAT = {"q4_k": "q6_k"}
KQUANT_FORMATS = ("q6_k", "q4_k")  # quantized by kernels/kquant.c


def make_linear(weight, bias, fmt: str, act_absmax=None) -> QLinear:
    """A linear layer in `fmt` from a float weight[N, K] (and bias[N])."""
    from ...errors import SpeculantError

    if fmt == "float32":
        return FloatLinear(weight, bias)
    if fmt == "int8":
        from .int8 import Int8Linear

        return Int8Linear.from_float(weight, bias, act_absmax)
    if fmt in GGML_TYPES:
        return GGMLLinear.from_float(weight, bias, fmt)
    raise SpeculantError(f"weight format {fmt!r} cannot be made from float weights; choose one of "
                         f"{', '.join(n for n in WEIGHT_FORMATS if n != 'gguf')}")


def linear_from_state(st, fmt: str) -> QLinear:
    if fmt == "int8":
        from .int8 import Int8Linear

        return Int8Linear.from_state(st)
    if fmt in GGML_TYPES:
        return GGMLLinear.from_state(st)
    return FloatLinear.from_state(st)
