"""GGML block types as speculant holds them: a tensor's rows in one type (`Part`), a row's bytes, whether the
kernels multiply a type, the --dtype names quantized on load, and the K-quants' quantizer (`kernels/kquant.c`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...errors import SpeculantError
from ...gguf_file import GGUFFile, GGUFTensor
from .. import native

# --dtype names that quantize float weights into a GGML type on load: the K-quants by kernels/kquant.c
# (llama.cpp's reference algorithms), the others by the gguf package's reference quantizers
GGML_TYPES: dict[str, GGMLQuantizationType] = {
    "q6_k": GGMLQuantizationType.Q6_K, "q4_k": GGMLQuantizationType.Q4_K, "q8_0": GGMLQuantizationType.Q8_0, "q5_1": GGMLQuantizationType.Q5_1, "q5_0": GGMLQuantizationType.Q5_0,
    "q4_1": GGMLQuantizationType.Q4_1, "q4_0": GGMLQuantizationType.Q4_0, "bf16": GGMLQuantizationType.BF16,
    "f16": GGMLQuantizationType.F16,
}
# what llama.cpp's quantizer uses for a tensor whose rows are not whole 256-value K-quant blocks
K_FALLBACK = {GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K: GGMLQuantizationType.Q8_0}


def check_type(qtype: int, name: str) -> GGMLQuantizationType:
    """The tensor's type if the kernels multiply it, else a clear error naming the tensor."""
    lib = native.gq_library()
    try:
        t = GGMLQuantizationType(qtype)
    except ValueError:
        raise SpeculantError(f"tensor {name} has unknown GGML type id {qtype}") from None
    if not lib.gq_supported(int(t)):
        ok = ", ".join(sorted(t.name for t in GGMLQuantizationType if lib.gq_supported(int(t))))
        raise SpeculantError(f"tensor {name} is stored as {t.name}, which speculant's kernels do not multiply "
                             f"(supported: {ok}); use --dtype float32 to dequantize the file instead")
    return t


@dataclass(frozen=True, slots=True)
class Part:
    qtype: int
    data: np.ndarray  # [rows, row_bytes] uint8, C-contiguous (may be a read-only memory map)
    perm: np.ndarray | None = None  # [rows] int32: row r -> output column perm[r] within the part

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def dequantize(file: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """Float32 array of tensor t as `file.dequantize(t)` gives it (the gguf package's values, bit for bit:
    tests/test_gguf_kernels.py). A 2-D tensor of a type the kernels read is dequantized by them on torch's threads,
    much faster than the gguf package's numpy, which took a quarter of a float32 or int8 conversion's time
    (docs/measurements.md, "Test suite time"); the rest goes to the gguf package."""
    if len(t.shape) == 2:
        try:
            lib = native.gq_library()
        except SpeculantError:  # no kernels at all (no compiler): the float32 load that was already announced
            lib = None
        qtype, (k, rows) = int(t.tensor_type), t.shape
        if lib is not None and lib.gq_supported(qtype) and k % GGML_QUANT_SIZES[t.tensor_type][0] == 0:
            data = file.raw(t).reshape(rows, row_bytes(qtype, k))
            out = np.empty((rows, k), np.float32)
            if lib.gq_dequant_range(qtype, data.ctypes.data, data.shape[1], k, 0, rows, out.ctypes.data, 0,
                                    torch.get_num_threads()) == 0:
                return out
    return file.dequantize(t)


def row_bytes(qtype: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if k % block:
        raise SpeculantError(f"a row of {k} values is not a whole number of {GGMLQuantizationType(qtype).name} "
                             f"blocks ({block} values each)")
    return k // block * size



def quantize_k(lib: ctypes.CDLL, w: np.ndarray, qtype: GGMLQuantizationType, threads: int | None = None) -> np.ndarray:
    """w[N, K] float32 -> [N, row bytes] uint8 in Q4_K or Q6_K (kernels/kquant.c)."""
    n, k = w.shape
    out = np.empty((n, row_bytes(int(qtype), k)), dtype=np.uint8)
    w = np.ascontiguousarray(w, dtype=np.float32)
    rc = lib.gq_quantize_k(int(qtype), w.ctypes.data, n, k, out.ctypes.data, threads or torch.get_num_threads())
    if rc == -5:
        raise SpeculantError(f"cannot quantize a {tuple(w.shape)} weight to {qtype.name}: it holds NaN or infinite values")
    if rc:
        raise SpeculantError(f"cannot quantize a {tuple(w.shape)} weight to {qtype.name} (error {rc})")
    return out
