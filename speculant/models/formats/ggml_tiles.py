"""GGML block weights repacked into 16-row tiles with one output per lane (gq_packed.h, gq_packed2.h,
gq_packed32.h), which every pass reads; the file's pages under them are released as they are repacked."""

from __future__ import annotations

import ctypes
import functools
import mmap

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...errors import SpeculantError
from .ggml_blocks import Part
from .ggml_routes import ggml_available

_PACK_ROWS = 4096  # rows repacked per step (a multiple of 16)
# the types repacked into 16-row tiles (gq_packed.h, gq_packed2.h, gq_packed32.h), where whole tiles fit (gq_packable)
PACKED_TYPES = (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_0,
                GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
                GGMLQuantizationType.Q8_0)


def packed_part(lib: ctypes.CDLL, p: Part, k: int, pack: bool | None = None) -> np.ndarray | None:
    """The part's rows repacked 16 at a time (one output per lane, read by every pass), for parts of
    PACKED_TYPES that make whole tiles (gq_packable: 16-row multiples; K a multiple of 256 for the K-quants,
    of 64 for the 32-blocks); None for the others, which the kernels read as the file stores them.
    pack=None repacks only parts memory-mapped from a file, whose pages are then released: blocks held in
    memory (an HF folder quantized on load) would stay beside their tiles, doubling their memory."""
    if pack is False or not ggml_available() or not lib.gq_packable(p.qtype, p.rows, k):
        return None
    if pack is None and _file_mapping(p.data) is None:
        return None
    # An anonymous mapping: page-aligned, and without the transparent huge pages numpy asks for on large
    # arrays, which made this stream slower (`scripts/linear_timing.py`; docs/measurements.md "Kernel choices")
    out = np.frombuffer(mmap.mmap(-1, lib.gq_packed_bytes(p.qtype, p.rows, k)), dtype=np.uint8)
    # A chunk of rows at a time, each chunk's file pages released before the next: the file's pages and the
    # tiles of a large tensor (the 1.5B's 191 MB output layer) are never resident together
    for r0 in range(0, p.rows, _PACK_ROWS):
        rows = p.data[r0:r0 + _PACK_ROWS]
        if lib.gq_pack(p.qtype, rows.ctypes.data, rows.shape[0], p.data.shape[1], k,
                       out.ctypes.data + lib.gq_packed_bytes(p.qtype, r0, k), torch.get_num_threads()):
            raise SpeculantError(f"repacking a {GGMLQuantizationType(p.qtype).name} tensor of {p.rows} rows of {k} "
                                 f"values failed")
        _release_file_pages(rows)
    _release_file_pages(p.data)  # the pages straddling two chunks
    return out


def _release_file_pages(a: np.ndarray) -> None:
    """Drops a memory-mapped file's pages under `a` from this process's resident set (the passes read the
    repacked copy; a later read of `a` faults them back in from the page cache). Arrays not backed by a
    file mapping are left alone: MADV_DONTNEED would zero anonymous memory."""
    if _file_mapping(a) is None or not hasattr(mmap, "MADV_DONTNEED") or not a.flags.c_contiguous:
        return
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page
    end = (a.ctypes.data + a.nbytes) // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def _file_mapping(a: np.ndarray) -> np.memmap | None:
    """The file mapping under `a` (a view of a numpy memmap, as the GGUF reader's tensors are), or None."""
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    return base


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
