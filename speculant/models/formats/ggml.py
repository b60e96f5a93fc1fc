"""GGML block formats (the types a GGUF file stores), multiplied as stored by `kernels/gq.c`.

A `GGMLLinear` is one or more *parts* stacked along the output dimension, each a 2-D uint8 array of
whole rows in one GGML type ([rows, row_bytes], usually a read-only memory map of the GGUF file), so
q/k/v (say Q4_K, Q4_K and Q6_K) are still one call. A part may carry a row permutation (llama files
store q/k rows interleaved for llama.cpp's rotary layout; row r goes to output column perm[r]).

K-quant (Q2_K .. Q6_K) and 32-block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) parts memory-mapped from a file are repacked into
16-row tiles with one output per lane (ggml_tiles.py: `packed_part`; gq_packed.h, gq_packed2.h, gq_packed32.h),
which every pass reads; the file's pages under them are released. A layer repacks on its first use
(`GGMLLinear.tiles`): the blocks at load (load_model builds the fused block loop), an output layer in its first pass
with logits.
Passes of up to SHORT_PASS_MAX rows run the integer kernel, whose rows are batch-invariant (gq.c).
Prompts take the best of `prefill_routes()` (ggml_routes.py): on x86 builds without AMX, passes of SHORT_PASS_MAX
rows through the fused block loop (Transformer.forward; the short passes' kernel), so a layer sees no longer pass;
otherwise, and for a layer called with more rows (an output layer scoring a whole prompt), the block types
an integer GEMM with an output per lane on x86 builds (gq_gemm.h); float types, or every type on CPUs with
AMX, weights dequantized a chunk at a time into bf16 and multiplied by oneDNN (F32 and F16 parts in float32);
elsewhere the short passes' kernel.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor, nn

from ...errors import SpeculantError
from .. import native
from .base import QLinear, SHORT_PASS_MAX
from .ggml_blocks import GGML_TYPES, K_FALLBACK, Part, quantize_k, row_bytes
from .ggml_routes import LINEAR_ROUTES, prefill_routes
from .ggml_tiles import PACKED_TYPES as PACKED_TYPES  # re-exported: heads/ import it from here
from .ggml_tiles import packed_part

# prefill: dequantize at most this many bytes of bf16 weights at a time (4 MB keeps the chunk in cache and the
# buffer small, and was as fast as any size tried: `SPECULANT_PREFILL=bf16 scripts/step_timing.py`;
# docs/measurements.md "Kernel choices")
_CHUNK_BYTES = 4 << 20


class _Part(ctypes.Structure):  # gq_part in gq.c
    _fields_ = [("type", ctypes.c_int32), ("pad", ctypes.c_int32), ("w", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64), ("perm", ctypes.c_void_p), ("packed", ctypes.c_void_p)]


class GGMLLinear(QLinear):
    def __init__(self, parts: list[Part], in_features: int, bias: Tensor | None = None,
                 pack: bool | None = None, packed: list[np.ndarray | None] | None = None) -> None:
        """pack: see packed_part; packed: the parts' tiles, already repacked (first_rows' views). Parts are
        repacked on first use (`tiles`), so a layer never multiplied never holds tiles: a draft model's full
        output layer, whose first rows alone (`first_rows`) are its reduced head."""
        super().__init__()
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        for p in parts:
            if p.data.dtype != np.uint8 or p.data.ndim != 2 or p.data.shape[1] != row_bytes(p.qtype, in_features):
                raise SpeculantError(f"a {GGMLQuantizationType(p.qtype).name} part of shape {p.data.shape} does not "
                                     f"hold rows of {in_features} values")
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self._lib = native.gq_library()
        self._pack = pack
        self._packed: list[np.ndarray | None] | None = None
        self._table = (_Part * len(parts))()
        for row, p in zip(self._table, parts):
            row.type, row.w, row.n, row.row_bytes = p.qtype, p.data.ctypes.data, p.rows, p.data.shape[1]
            row.perm = None if p.perm is None else p.perm.ctypes.data
        if packed is not None:
            self._set_tiles(packed)
        # gq_gemm's parts: whole 16-row tiles of a type it multiplies here
        self._gemm = all(self._lib.gq_gemm_type(p.qtype) and p.rows % 16 == 0 for p in parts)

    def tiles(self) -> list[np.ndarray | None]:
        """The parts' repacked tiles (None: read in the file's layout), repacked now if not yet."""
        if self._packed is None:
            tiles = [packed_part(self._lib, p, self.in_features, self._pack) for p in self.parts]
            if self._packed is None:  # another thread may have packed meanwhile (gq_pack releases the GIL): keep theirs
                self._set_tiles(tiles)
        return self._packed

    def _set_tiles(self, tiles: list[np.ndarray | None]) -> None:
        for row, t in zip(self._table, tiles):
            row.packed = None if t is None else t.ctypes.data
        self._packed = tiles

    def extra_repr(self) -> str:
        kinds = "+".join(GGMLQuantizationType(p.qtype).name for p in self.parts)
        return f"{self.in_features} -> {self.out_features}, {kinds}"

    def _apply(self, fn, recurse=True):  # weights stay on the CPU, memory-mapped: only the bias may move
        out = super()._apply(fn, recurse)
        if self.bias is not None and (self.bias.device.type != "cpu" or self.bias.dtype != torch.float32):
            raise SpeculantError("GGML block formats run on the CPU only; use --dtype float32 on other devices")
        return out

    @property
    def table(self):
        """The parts as gq.c's gq_part array (for the fused block loop), their tiles repacked."""
        self.tiles()
        return self._table

    def forward(self, x: Tensor) -> Tensor:  # x [M, K] -> [M, N]
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        M, K = x.shape
        if K != self.in_features:
            raise SpeculantError(f"a GGML linear layer expects {self.in_features} input features, got {K}")
        y = torch.empty(M, self.out_features, dtype=torch.float32)
        if not M:  # no rows (a prefill that wants no logits): nothing to multiply, nothing to repack
            return y
        route = "rows" if M <= SHORT_PASS_MAX else self._long_route()
        table = self.table
        if route == "bf16":
            return self._forward_dequantized(x)
        bias = None if self.bias is None else self.bias.data_ptr()
        kernel = self._lib.gq_gemm if route == "gemm" else self._lib.gq_matmul
        rc = kernel(table, len(self.parts), x.data_ptr(), M, K, bias, y.data_ptr(), self.out_features,
                    torch.get_num_threads())
        if rc:
            raise SpeculantError(_ERRORS.get(rc, f"the GGML matmul failed ({rc})"))
        return y

    def _long_route(self) -> str:
        """The route of a pass of more than SHORT_PASS_MAX rows (a prompt's, an output layer's over a prompt)."""
        return next(r for r in prefill_routes() if r in LINEAR_ROUTES and (r != "gemm" or self._gemm))

    @property
    def thread_invariant(self) -> bool:
        """The integer kernels sum each output on one thread; oneDNN's matmul (the "bf16" route) splits a long K
        over its threads, so a prompt's bits there change with the thread count (an AMX host, where that route comes
        first: tests/test_threads.py). The engine then keeps its thread count (threads.ThreadShare)."""
        return self._long_route() != "bf16"

    def _forward_dequantized(self, x: Tensor) -> Tensor:  # x [M, K] fp32 -> [M, N]
        """The "bf16" route: block types' weights dequantized a chunk at a time into bf16 and multiplied by oneDNN.
        F32 and F16 parts multiply in float32 instead (an F32 part as the file stores it, an F16 one dequantized a
        chunk at a time): rounding them and the activations to bf16 would cost the file's precision (an F32 Gemma 4
        GGUF's prompt logits were 0.13 off, test_gemma4_gguf)."""
        K = self.in_features
        xs = {torch.float32: x}
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        threads = torch.get_num_threads()
        col = 0
        for p in self.parts:
            out = y[:, col:col + p.rows] if p.perm is None else torch.empty(x.shape[0], p.rows)
            if p.qtype == GGMLQuantizationType.F32:
                with warnings.catch_warnings():  # the file's read-only map, only read here
                    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                    w = torch.from_numpy(p.data.view(np.float32))
                out[:] = torch.mm(x, w.T)
            else:
                dtype = torch.float32 if p.qtype == GGMLQuantizationType.F16 else torch.bfloat16
                if dtype not in xs:
                    xs[dtype] = x.to(dtype)
                step = max(16, _CHUNK_BYTES // (dtype.itemsize * K))
                buf = torch.empty(min(step, p.rows), K, dtype=dtype)
                for r0 in range(0, p.rows, step):
                    r1 = min(r0 + step, p.rows)
                    rc = self._lib.gq_dequant_range(p.qtype, p.data.ctypes.data, p.data.shape[1], K, r0, r1,
                                                    buf.data_ptr(), int(dtype == torch.bfloat16), threads)
                    if rc:
                        raise SpeculantError(_ERRORS.get(rc, f"dequantizing a GGML tensor failed ({rc})"))
                    out[:, r0:r1] = torch.mm(xs[dtype], buf[: r1 - r0].T)
            if p.perm is not None:
                y[:, col + torch.from_numpy(p.perm).long()] = out
            col += p.rows
        if self.bias is not None:
            y += self.bias
        return y

    def weight_bytes(self) -> int:
        return sum(p.data.nbytes for p in self.parts)

    def dequantized(self) -> Tensor:
        """The weight[N, K] in float32 that this layer multiplies (tests, float32 fallbacks)."""
        out = torch.empty(self.out_features, self.in_features)
        col = 0
        for p in self.parts:
            w = torch.empty(p.rows, self.in_features)
            self._lib.gq_dequant_range(p.qtype, p.data.ctypes.data, p.data.shape[1], self.in_features, 0, p.rows,
                                       w.data_ptr(), 0, 1)
            idx = torch.arange(p.rows) if p.perm is None else torch.from_numpy(p.perm).long()
            out[col + idx] = w
            col += p.rows
        return out

    def first_rows(self, n: int) -> "GGMLLinear":
        """Output rows [0, n) (a draft head over a reduced vocabulary): a view, no copy; of the layer's tiles
        where it is already repacked and n is a whole number of them (else the rows repack on their first use)."""
        if len(self.parts) != 1 or self.parts[0].perm is not None:
            raise SpeculantError("only a single unpermuted GGML layer can be cut to its first rows")
        p, tiles = self.parts[0], None if self._packed is None else self._packed[0]
        n = min(n, p.rows)
        bias = None if self.bias is None else self.bias.data[:n]
        part = Part(p.qtype, p.data[:n])
        if tiles is not None and n % 16 == 0:
            return GGMLLinear([part], self.in_features, bias, packed=[tiles[: self._lib.gq_packed_bytes(p.qtype, n, self.in_features)]])
        return GGMLLinear([part], self.in_features, bias, self._pack)

    def state(self) -> dict[str, Tensor]:
        if len(self.parts) != 1 or self.parts[0].perm is not None:
            raise SpeculantError("only a single unpermuted GGML layer can be saved")
        p = self.parts[0]
        data = np.ascontiguousarray(p.data)
        if not data.flags.writeable:  # a file's read-only map (an embedding table kept in its type): torch wants a copy
            data = data.copy()
        out = {"ggml_type": torch.tensor([p.qtype]), "ggml_data": torch.from_numpy(data),
               "ggml_k": torch.tensor([self.in_features])}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out

    @classmethod
    def from_state(cls, st: dict[str, Tensor | np.ndarray]) -> "GGMLLinear":
        try:
            data = st["ggml_data"]  # a Tensor, or a view of the conversion cache's memory map (build._load_states)
            part = Part(int(st["ggml_type"][0]), data if isinstance(data, np.ndarray) else data.numpy())
            return cls([part], int(st["ggml_k"][0]), st.get("bias"))
        except KeyError as e:
            raise SpeculantError(f"a saved GGML layer lacks {e}") from None

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, fmt: str) -> "GGMLLinear":
        """Quantize weight[N, K] into the GGML type `fmt` names (kquant.c for the K-quants, else the
        gguf package's quantizers)."""
        from gguf import quants

        qtype = GGML_TYPES[fmt]
        if weight.shape[1] % 256 and qtype in K_FALLBACK:  # K-quant blocks are 256 wide (Qwen2.5-0.5B: 896)
            qtype = K_FALLBACK[qtype]
        block = GGML_QUANT_SIZES[qtype][0]
        if weight.shape[1] % block:  # the gguf quantizers' own error names neither the format nor the fix
            raise SpeculantError(f"cannot quantize a {tuple(weight.shape)} weight to {fmt}: its rows of "
                                 f"{weight.shape[1]} values are not whole {block}-value blocks; choose another --dtype "
                                 "(float32 runs any shape)")
        lib = native.gq_library()  # fail before the (slow) quantization where the kernels cannot run
        w = weight.detach().float().contiguous().numpy()
        if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
            return cls([Part(int(qtype), quantize_k(lib, w, qtype))], weight.shape[1], bias)
        try:
            data = quants.quantize(w, qtype)
        except (ValueError, NotImplementedError) as e:
            raise SpeculantError(f"cannot quantize a {tuple(weight.shape)} weight to {fmt}: {e}") from None
        # the float types come back as float16 values, not bytes: the layer holds rows of bytes
        return cls([Part(int(qtype), np.ascontiguousarray(data).view(np.uint8))], weight.shape[1], bias)




_ERRORS = {
    -1: "the GGML matmul ran out of memory for its activation scratch",
    -2: "a GGML tensor type the kernels do not support reached the matmul",
    -3: "the input width is not a multiple of the weights' block size",
    -4: "a GGML weight's byte size does not match its type and shape",
}


class GGMLEmbedding(nn.Module):
    """A token embedding table kept in its GGML type; rows are dequantized on lookup."""

    def __init__(self, part: Part, dim: int) -> None:
        super().__init__()
        if part.data.shape[1] != row_bytes(part.qtype, dim):
            raise SpeculantError("the embedding table's row size does not match its type and width")
        self.part, self.dim = part, dim
        self._lib = native.gq_library()

    @property
    def num_embeddings(self) -> int:
        return self.part.rows

    def row_bytes(self) -> int:
        return self.part.data.shape[1]

    def forward(self, tokens: Tensor) -> Tensor:  # [S] long -> [S, D]
        ids = tokens.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.part.rows):
            raise SpeculantError(f"token id out of range for an embedding table of {self.part.rows} rows")
        out = torch.empty(ids.shape[0], self.dim)
        p = self.part
        self._lib.gq_dequant_rows(p.qtype, p.data.ctypes.data, p.data.shape[1], self.dim, ids.data_ptr(),
                                  ids.shape[0], out.data_ptr())
        return out

    def as_linear(self) -> GGMLLinear:
        """The same tensor as an output layer (tied embeddings): no copy."""
        return GGMLLinear([self.part], self.dim)

    def state(self) -> dict[str, Tensor]:
        """As GGMLLinear.state (the conversion cache keeps a GGUF's embedding table in its own type)."""
        return self.as_linear().state()

    @classmethod
    def from_state(cls, st: dict[str, Tensor | np.ndarray]) -> "GGMLEmbedding":
        lin = GGMLLinear.from_state(st)
        return cls(lin.parts[0], lin.in_features)
