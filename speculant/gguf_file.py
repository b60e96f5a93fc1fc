"""A GGUF file's metadata and tensor directory, read fast; tensor data dequantised by the `gguf` package.

`gguf.GGUFReader` decodes every metadata value into numpy views one element at a time: for a
Qwen2.5 file (151k vocabulary strings and 151k merges) that takes 10-15 s on a 2-core machine, on
every model load. The header format is small and fixed (magic, version, key/value pairs, tensor
infos; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), so it is parsed here with
`struct` in well under a second. The constants (value types, quantisation block sizes) and the
dequantisation kernels stay the `gguf` package's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from .errors import SpeculantError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALARS = {  # value type -> struct format (little-endian)
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
          GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    tensor_type: GGMLQuantizationType
    data_offset: int  # absolute, in bytes
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Sequential little-endian reads over the header bytes; running past the end is a truncated file."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> object:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = bytes(self.buf[self.pos : end]).decode("utf-8", "replace")
        self.pos = end
        return s

    def value(self, vtype: int) -> object:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        etype, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if etype in _NUMPY:  # numbers in one numpy read
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        if etype == GGUFValueType.STRING:  # the vocabulary and merges: the hot loop of this module
            out, buf, pos, unpack = [], self.buf, self.pos, struct.unpack_from
            for _ in range(count):
                (n,) = unpack("<Q", buf, pos)
                out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"))
                pos += 8 + n
            if pos > len(buf):
                raise struct.error("string array runs past the end of the file")
            self.pos = pos
            return out
        return [self.value(etype) for _ in range(count)]  # nested arrays: rare, kept simple


class _Unsupported(Exception):
    """A well-formed file this reader does not handle (as opposed to a damaged one)."""


class GGUFFile:
    """Metadata (`fields`, decoded to Python values) and tensors of one GGUF file; data memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
            self.fields, self.tensors = _parse(memoryview(self._data), size)
        except _Unsupported as e:
            raise SpeculantError(f"cannot read GGUF file {self.path}: {e}") from None
        except (OSError, ValueError, struct.error, KeyError) as e:
            raise SpeculantError(f"cannot read GGUF file {self.path}: it is corrupt or truncated "
                                 f"({type(e).__name__}: {e}); delete it and pull or download it again") from None

    @cached_property
    def by_name(self) -> dict[str, GGUFTensor]:
        return {t.name: t for t in self.tensors}

    def dequantize(self, t: GGUFTensor) -> np.ndarray:
        """Float32 array of tensor t in numpy order (outermost dimension first), writable."""
        raw = self._data[t.data_offset : t.data_offset + t.n_bytes]
        shape = tuple(reversed(t.shape))
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            block, type_size = GGML_QUANT_SIZES[t.tensor_type]
            raw = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        try:
            arr = gguf_quants.dequantize(raw, t.tensor_type)
        except NotImplementedError:
            raise SpeculantError(f"tensor {t.name} in {self.path} has type {t.tensor_type.name}, "
                                 "which the gguf package cannot dequantize") from None
        return np.require(arr.reshape(shape), dtype=np.float32, requirements=["C", "W"])  # copy off the map


def _parse(buf: memoryview, size: int) -> tuple[dict[str, object], list[GGUFTensor]]:
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"it starts with {bytes(buf[:4])!r}, not {_MAGIC!r}")
    c = _Cursor(buf)
    c.pos = 4
    version = c.unpack("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise _Unsupported(f"GGUF version {version}{hint} is not supported; speculant reads versions 2 and 3")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    fields: dict[str, object] = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(c.unpack("<I")), c.unpack("<Q")))
    align = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    tensors, seen = [], set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        block, type_size = GGML_QUANT_SIZES[ttype]
        n = int(np.prod(dims, dtype=np.int64))
        t = GGUFTensor(name, dims, ttype, start + offset, n // block * type_size)
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"tensor {name} ends past the end of the file")
        tensors.append(t)
    return fields, tensors
