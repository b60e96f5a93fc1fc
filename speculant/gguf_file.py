"""A GGUF file's metadata and tensor directory, read fast; tensor data dequantised by the `gguf` package.

`gguf.GGUFReader` decodes every metadata value into numpy views one element at a time: for a
Qwen2.5 file (151k vocabulary strings and 151k merges) that takes 10-15 s on a 2-core machine, on
every model load. The header format is small and fixed (magic, version, key/value pairs, tensor
infos; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), so it is parsed here with
`struct` in well under a second. The constants (value types, quantisation block sizes) and the
dequantisation kernels stay the `gguf` package's.

Every count and length in the header is checked against the bytes left before it is used, so a
damaged or hostile file fails at once with a SpeculantError instead of looping or allocating for
ages (tests/test_fuzz.py feeds it tens of thousands of damaged headers).
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
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: real files have none, llama.cpp reads any; deeper is damage
_MIN_SIZE = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}  # bytes of the smallest value (else its scalar)
# Bounds on what a header may make us decode. The data region after a damaged count reads as
# plausible zero-length strings, so "fits in the file" alone would let a 1 GB file decode into
# 134 million Python objects. Real headers hold ~0.6 M array items (Qwen2.5: 151,936 tokens, token
# types and 151,387 merges) and no string over a few hundred kB (chat templates).
_MAX_ITEMS = 1 << 23
_MAX_STRING = 16 << 20
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
        self.items_left = _MAX_ITEMS  # array items still allowed in this header

    def unpack(self, fmt: str) -> object:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, which must fit in the bytes left."""
        n = self.unpack("<Q")
        if n * item_bytes > len(self.buf) - self.pos:
            raise ValueError(f"{what} count {n:,} does not fit in the {len(self.buf) - self.pos:,} bytes left")
        return n

    def string(self) -> str:
        n = self.count("string byte", 1)
        if n > _MAX_STRING:
            raise ValueError(f"a {n:,}-byte string (more than {_MAX_STRING:,} bytes)")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0) -> object:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        if depth >= _MAX_NESTING:
            raise ValueError(f"arrays nested more than {_MAX_NESTING} deep")
        etype = GGUFValueType(self.unpack("<I"))
        count = self.count("array", _MIN_SIZE.get(etype) or struct.calcsize(_SCALARS[etype]))
        self.items_left -= count
        if self.items_left < 0:
            raise ValueError(f"the metadata arrays hold more than {_MAX_ITEMS:,} items in all")
        if etype in _NUMPY:  # numbers in one numpy read
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        if etype == GGUFValueType.STRING:  # the vocabulary and merges: the hot loop of this module
            out, buf, pos, unpack = [], self.buf, self.pos, struct.unpack_from
            for _ in range(count):
                (n,) = unpack("<Q", buf, pos)
                if n > _MAX_STRING:
                    raise ValueError(f"a {n:,}-byte string in an array (more than {_MAX_STRING:,} bytes)")
                out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"))
                pos += 8 + n
            if pos > len(buf):
                raise struct.error("string array runs past the end of the file")
            self.pos = pos
            return out
        return [self.value(etype, depth + 1) for _ in range(count)]  # nested arrays: rare, kept simple


class _Unsupported(Exception):
    """A well-formed file this reader does not handle (as opposed to a damaged one)."""


class GGUFFile:
    """Metadata (`fields`, decoded to Python values; `field_types`, their GGUF types) and tensors of one
    GGUF file; data memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
            self.fields, self.field_types, self.tensors = _parse(memoryview(self._data), size)
        except _Unsupported as e:
            raise SpeculantError(f"cannot read GGUF file {self.path}: {e}") from None
        except (OSError, ValueError, struct.error, KeyError, OverflowError) as e:
            raise SpeculantError(f"cannot read GGUF file {self.path}: it is corrupt or truncated "
                                 f"({type(e).__name__}: {e}); delete it and pull or download it again") from None

    @cached_property
    def by_name(self) -> dict[str, GGUFTensor]:
        return {t.name: t for t in self.tensors}

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the memory map (no copy)."""
        return self._data[t.data_offset : t.data_offset + t.n_bytes]

    def dequantize(self, t: GGUFTensor) -> np.ndarray:
        """Float32 array of tensor t in numpy order (outermost dimension first), writable."""
        raw = self.raw(t)
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


FieldType = tuple[GGUFValueType, GGUFValueType | None]  # value type, and the element type of an array


def _parse(buf: memoryview, size: int) -> tuple[dict[str, object], dict[str, FieldType], list[GGUFTensor]]:
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"it starts with {bytes(buf[:4])!r}, not {_MAGIC!r}")
    c = _Cursor(buf)
    c.pos = 4
    version = c.unpack("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise _Unsupported(f"GGUF version {version}{hint} is not supported; speculant reads versions 2 and 3")
    n_tensors = c.count("tensor", 8 + 4 + 8 + 4 + 8)  # name length, n_dims, one dim, type, offset
    n_kv = c.count("metadata key", 8 + 4 + 1)  # key length, value type, the smallest value
    fields: dict[str, object] = {}
    types: dict[str, FieldType] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in fields:
            raise ValueError(f"metadata key {key!r} appears twice")
        vtype = GGUFValueType(c.unpack("<I"))
        etype = GGUFValueType(struct.unpack_from("<I", buf, c.pos)[0]) if vtype == GGUFValueType.ARRAY else None
        types[key] = (vtype, etype)
        fields[key] = c.value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        dims = tuple(c.unpack("<Q") for _ in range(n_dims))
        infos.append((name, dims, GGMLQuantizationType(c.unpack("<I")), c.unpack("<Q")))
    align = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment must be a power of two, got {align!r}")
    start = -(-c.pos // align) * align
    tensors, seen = [], set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        if ttype not in GGML_QUANT_SIZES:
            raise _Unsupported(f"tensor {name} has type {ttype.name}, which has no known block size")
        block, type_size = GGML_QUANT_SIZES[ttype]
        n = 1
        for d in dims:  # Python ints: a damaged dimension cannot wrap around
            n *= d
        if n == 0 or dims[0] % block or offset % align:
            raise ValueError(f"tensor {name} has shape {dims}, type {ttype.name} and offset {offset}, which do not fit "
                             f"(empty, rows not a whole number of {block}-element blocks, or offset not {align}-aligned)")
        t = GGUFTensor(name, dims, ttype, start + offset, n // block * type_size)
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"tensor {name} ends past the end of the file")
        tensors.append(t)
    return fields, types, tensors


def architecture(path: Path) -> str | None:
    """A GGUF file's `general.architecture`, None where the file is no GGUF. Read from the first metadata entry, where
    llama.cpp's writer puts it, without parsing the whole header (a vocabulary of 150k strings) unless it is not
    there."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if head[:4] != b"GGUF":
        return None
    try:
        n = struct.unpack_from("<Q", head, 24)[0]  # after magic, version, tensor count, metadata count
        key = head[32 : 32 + n].decode()
        vtype, length = struct.unpack_from("<IQ", head, 32 + n)
        if key == "general.architecture" and vtype == 8:  # 8: string
            return head[44 + n : 44 + n + length].decode()
    except (struct.error, UnicodeDecodeError):
        pass
    return str(GGUFFile(path).fields.get("general.architecture"))
