"""The compiled C kernels (speculant/kernels/*.c): built with gcc on first use, loaded with ctypes.

One shared library holds the int4 matmul (q4.c), the short-pass attention (attention.c), the
per-row element-wise ops (rows.c) and the loop over an int4 model's blocks (blocks.c). It is
compiled into `$SPECULANT_HOME/kernels/` (default `~/.cache/speculant/kernels/`) under a name that
includes a hash of the sources and flags, so an edited source is rebuilt and a damaged file is
never trusted. Where it cannot be built (no x86-64 AVX2/FMA/F16C, no gcc) `library()` raises
SpeculantError and callers fall back to torch (attention) or say which --dtype to use (int4).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import SpeculantError

_KERNELS = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = (_KERNELS / "q4.c", _KERNELS / "attention.c", _KERNELS / "rows.c", _KERNELS / "blocks.c",
           _KERNELS / "q4_amx.c")
HEADERS = (_KERNELS / "simd.h",)  # included by the sources: part of the build's hash
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
NEEDS = "the native kernels need an x86-64 CPU with AVX2, FMA and F16C and gcc to build them"


def cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_ok() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def kernel_dir() -> Path:
    env = os.environ.get("SPECULANT_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "speculant"
    return home / "kernels"


def _build(gcc: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([gcc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()[-5:]
            raise SpeculantError(f"{NEEDS}; compiling them failed: {' | '.join(msg)}; use --dtype int8")
        os.replace(tmp, out)  # atomic: a concurrent build or load sees the old file or the whole new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(gcc: str, code: bytes, flags: tuple[str, ...]) -> ctypes.CDLL:
    digest = hashlib.sha256(code + "\0".join(flags).encode()).hexdigest()[:16]
    out = kernel_dir() / f"speculant-{digest}.so"
    for attempt in range(2):
        if not out.exists():
            _build(gcc, flags, out)
        try:
            return ctypes.CDLL(str(out))
        except OSError as e:
            if attempt:
                raise SpeculantError(f"{NEEDS}; loading {out} failed ({e}); use --dtype int8") from None
            out.unlink(missing_ok=True)  # a damaged cache entry is rebuilt, never trusted
    raise AssertionError("unreachable")


# Instruction sets the int4 kernel can be built for, fastest first: (name, cpuinfo flags, gcc flags).
# All of them compute the same exact integer sums and the same float operations per output row,
# so every build gives bit-identical results (tests/test_int4.py checks the ones this CPU runs).
ISAS = (
    ("avx512vnni", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    ("avxvnni", {"avx_vnni"}, ("-mavxvnni",)),
    ("avx2", set(), ()),
)


def supported_isas() -> list[str]:
    """The ISAS this CPU runs, fastest first ("avx2" always last)."""
    flags = cpu_flags()
    return [name for name, need, _ in ISAS if need <= flags]


@functools.cache
def library(isa: str | None = None) -> ctypes.CDLL:
    """The compiled kernels (built on first use; SpeculantError where they cannot run here).

    `isa` picks a build from ISAS (default: the fastest this CPU runs whose build succeeds; an older
    gcc without the flag falls back to the next). The results do not depend on the choice.
    """
    if not cpu_ok():
        raise SpeculantError(f"{NEEDS}; this CPU lacks AVX2/FMA/F16C; use --dtype int8")
    gcc = shutil.which(os.environ.get("SPECULANT_CC", "gcc"))
    if gcc is None:
        raise SpeculantError(f"{NEEDS}; gcc was not found on PATH; install gcc or use --dtype int8")
    try:
        code = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    except OSError as e:
        raise SpeculantError(f"{NEEDS}; a source is missing ({e}); use --dtype int8") from None
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the kernels share its libgomp
    names = supported_isas() if isa is None else [isa]
    lib = None
    for name in names:
        extra = next(flags for n, _, flags in ISAS if n == name)
        try:
            lib = _load(gcc, code, _FLAGS + extra)
            break
        except SpeculantError:
            if name == names[-1]:
                raise
    assert lib is not None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.q4_matmul.argtypes = [p, i64, i64, p, p, i64, p, f32, p, i32]
    lib.q4_matmul.restype = i32
    lib.q4_dequant_bf16.argtypes = [p, p, i64, i64, i64, f32, p, i32]
    lib.q4_dequant_bf16.restype = None
    lib.attn_rows.argtypes = [p, i64, i64, i64, i64, p, p, p, p, i64, i64, p, i32]
    lib.attn_rows.restype = i32
    lib.rms_norm_rows.argtypes = [p, p, i64, i64, f32, p]
    lib.rms_norm_rows.restype = None
    lib.silu_mul_rows.argtypes = [p, i64, i64, p]
    lib.silu_mul_rows.restype = None
    lib.q4_blocks.argtypes = [p, i64, p, i64, i64, i64, i64, i64, i64, f32, p, p, p, p, i64, i64, i32]
    lib.q4_blocks.restype = i32
    lib.q4_amx_init.argtypes = []
    lib.q4_amx_init.restype = i32
    lib.q4_matmul_amx.argtypes = [p, i64, i64, p, p, i64, p, f32, p, i32]
    lib.q4_matmul_amx.restype = i32
    return lib


def available() -> bool:
    """Whether the kernels run here (CPU features and a compiler; builds them on first call)."""
    try:
        library()
    except SpeculantError:
        return False
    return True
