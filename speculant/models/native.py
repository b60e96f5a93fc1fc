"""The compiled C kernels (speculant/kernels/*.c): built with gcc on first use, loaded with ctypes.

One shared library holds the int4 matmul (q4.c) and the short-pass attention (attention.c). It is
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
SOURCES = (_KERNELS / "q4.c", _KERNELS / "attention.c")
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


@functools.cache
def library(vnni: bool | None = None) -> ctypes.CDLL:
    """The compiled kernels (built on first use; SpeculantError where they cannot run here).

    With AVX-VNNI (`vnni`, default: where the CPU has it) the int4 kernel's integer dot products
    use vpdpbusd; the sums are exact either way, so both builds give bit-identical results.
    """
    if not cpu_ok():
        raise SpeculantError(f"{NEEDS}; this CPU lacks AVX2/FMA/F16C; use --dtype int8")
    gcc = shutil.which(os.environ.get("SPECULANT_CC", "gcc"))
    if gcc is None:
        raise SpeculantError(f"{NEEDS}; gcc was not found on PATH; install gcc or use --dtype int8")
    try:
        code = b"".join(src.read_bytes() for src in SOURCES)
    except OSError as e:
        raise SpeculantError(f"{NEEDS}; a source is missing ({e}); use --dtype int8") from None
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the kernels share its libgomp
    lib = None
    if vnni is None:
        vnni = "avx_vnni" in cpu_flags()
    if vnni:
        try:
            lib = _load(gcc, code, _FLAGS + ("-mavxvnni",))
        except SpeculantError:
            lib = None  # an older gcc: the AVX2 build is as exact, only slower
    if lib is None:
        lib = _load(gcc, code, _FLAGS)
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.q4_matmul.argtypes = [p, i64, i64, p, p, i64, p, f32, p, i32]
    lib.q4_matmul.restype = i32
    lib.q4_dequant_bf16.argtypes = [p, p, i64, i64, i64, f32, p, i32]
    lib.q4_dequant_bf16.restype = None
    lib.attn_rows.argtypes = [p, i64, i64, i64, i64, p, p, p, p, i64, i64, p, i32]
    lib.attn_rows.restype = i32
    return lib


def available() -> bool:
    """Whether the kernels run here (CPU features and a compiler; builds them on first call)."""
    try:
        library()
    except SpeculantError:
        return False
    return True
