"""The compiled C kernels (speculant/kernels/*.c): built with gcc on first use, loaded with ctypes.

On x86-64 CPUs with AVX2, one shared library holds the GGML block-format matmul (gq.c), the
short-pass attention (attention.c), the per-row element-wise ops (rows.c) and the loop over a
model's blocks (blocks.c), built for the widest instruction set the CPU has (ISAS). Elsewhere (ARM,
older x86) `gq_library()` builds gq.c alone in portable C: the same results bit for bit, slower, and
the rest falls back to torch. Libraries are compiled into `$SPECULANT_HOME/kernels/` (default
`~/.cache/speculant/kernels/`; a temporary folder where that is not writable) under a name that
includes a hash of the sources and flags, so an edited source is rebuilt and a damaged file is never
trusted. A failed build is remembered for the process, not retried on every load.

$SPECULANT_ISA (avx512vnni, avxvnni, avx2 or portable; `speculant bench speed --isa`) forces one build, so any
host can measure a narrower build than its best; a build this CPU cannot run is refused, not emulated.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import SpeculantError

_KERNELS = Path(__file__).resolve().parent.parent / "kernels"
KQUANT_SOURCE = _KERNELS / "kquant.c"
SOURCES = (_KERNELS / "gq.c", KQUANT_SOURCE, _KERNELS / "attention.c", _KERNELS / "rows.c", _KERNELS / "blocks.c",
           _KERNELS / "delta.c")
PORTABLE_SOURCES = (_KERNELS / "gq.c", KQUANT_SOURCE)
# the headers the sources include (gq.c's and attention.c's parts, simd.h), every one: part of the build's hash,
# so an edited header is rebuilt too
HEADERS = tuple(sorted(_KERNELS.glob("*.h")))
_BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
_FLAGS = _BASE_FLAGS + ("-mavx2", "-mfma", "-mf16c")
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


def bf16_native(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX; `flags`: another CPU's). Without it oneDNN
    emulates bf16 matmuls, many times slower than float32 ones (an AVX2 Zen 3 core: about 12x on a training step's
    shapes). On this CPU, also whether torch may use them: $ATEN_CPU_CAPABILITY=avx2 or $ONEDNN_MAX_CPU_ISA=AVX2
    (a larger CPU measuring its AVX2 speed) cap its kernels below them, and bf16 is emulated again."""
    if flags is None:
        if not _torch_reaches_avx512():
            return False
        flags = cpu_flags()
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags or "amx_bf16" in flags


def _torch_reaches_avx512() -> bool:
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        return False
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return isa == "ALL" or isa.startswith(("AVX512", "AVX10", "AMX"))


def cpu_ok() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def kernel_dir() -> Path:
    env = os.environ.get("SPECULANT_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "speculant"
    return home / "kernels"


@functools.cache
def _writable_kernel_dir() -> Path:
    """kernel_dir(), or a private temporary folder where that cannot be written (read-only homes)."""
    d = kernel_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d)
        os.close(fd)
        os.unlink(probe)
        return d
    except OSError:
        return Path(tempfile.mkdtemp(prefix="speculant-kernels-"))


def _build(gcc: str, flags: tuple[str, ...], sources: tuple[Path, ...], out: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([gcc, *flags, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()[-5:]
            raise SpeculantError(f"compiling the native kernels with {gcc} failed: {' | '.join(msg)}")
        os.replace(tmp, out)  # atomic: a concurrent build or load sees the old file or the whole new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(build: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> Path:
    """Where the build of these sources with these flags is cached: its name (from ISAS, or "portable") and a
    hash of the sources and flags, so two builds never share a file and an edited source is rebuilt."""
    try:
        code = b"".join(src.read_bytes() for src in sources + HEADERS)
    except OSError as e:
        raise SpeculantError(f"a kernel source is missing ({e}); reinstall speculant") from None
    digest = hashlib.sha256(code + "\0".join((build,) + flags).encode()).hexdigest()[:16]
    return _writable_kernel_dir() / f"speculant-{build}-{digest}.so"


def _load(gcc: str, build: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> ctypes.CDLL:
    out = library_path(build, sources, flags)
    for attempt in range(2):
        if not out.exists():
            _build(gcc, flags, sources, out)
        try:
            return ctypes.CDLL(str(out))
        except OSError as e:
            if attempt:
                raise SpeculantError(f"loading the native kernels {out} failed ({e})") from None
            out.unlink(missing_ok=True)  # a damaged cache entry is rebuilt, never trusted
    raise AssertionError("unreachable")


def _compiler() -> str:
    gcc = shutil.which(os.environ.get("SPECULANT_CC", "gcc"))
    if gcc is None:
        raise SpeculantError("no C compiler: gcc was not found on PATH (or $SPECULANT_CC); install gcc "
                             "(e.g. apt-get install gcc) or use --dtype float32")
    return gcc


# Instruction sets the x86 kernels can be built for, fastest first: (name, cpuinfo flags, gcc flags).
# All of them compute the same exact integer sums and the same float operations per output row,
# so every build gives bit-identical results (tests/test_gguf_kernels.py checks the ones this CPU runs).
ISAS = (
    ("avx512vnni", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    ("avxvnni", {"avx_vnni"}, ("-mavxvnni",)),
    ("avx2", set(), ()),
)


BUILDS = tuple(name for name, _, _ in ISAS) + ("portable",)  # what $SPECULANT_ISA and --isa accept


def supported_isas() -> list[str]:
    """The ISAS this CPU runs, fastest first ("avx2" always last); empty where AVX2 is missing."""
    if not cpu_ok():
        return []
    flags = cpu_flags()
    return [name for name, need, _ in ISAS if need <= flags]


def check_build(name: str) -> str:
    """`name` if it is a build (BUILDS) this CPU runs, else a SpeculantError saying what to pick instead."""
    if name not in BUILDS:
        raise SpeculantError(f"unknown kernel build {name!r} ($SPECULANT_ISA or --isa): choose one of "
                             f"{', '.join(BUILDS)}")
    runs = supported_isas()
    if name != "portable" and name not in runs:
        need = {"avx2", "fma", "f16c"} | next(need for n, need, _ in ISAS if n == name)
        lacks = sorted(need - cpu_flags())
        raise SpeculantError(f"this CPU ({platform.machine()}) cannot run the {name} build of the kernels: it lacks "
                             f"{', '.join(lacks)}; the builds it runs: {', '.join(runs + ['portable'])}")
    return name


def forced_build() -> str | None:
    """The build $SPECULANT_ISA forces (checked: check_build), "portable" for the older $SPECULANT_PORTABLE=1,
    or None: the fastest this CPU runs."""
    want = os.environ.get("SPECULANT_ISA", "").strip().lower()
    portable = os.environ.get("SPECULANT_PORTABLE") == "1"
    if not want:
        return "portable" if portable else None
    check_build(want)
    if portable and want != "portable":
        raise SpeculantError(f"SPECULANT_ISA={want} and SPECULANT_PORTABLE=1 ask for two builds; unset one")
    return want


def _bind(lib: ctypes.CDLL, full: bool) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.gq_matmul.argtypes = [p, i32, p, i64, i64, p, p, i64, i32]
    lib.gq_matmul.restype = i32
    lib.gq_gemm.argtypes = [p, i32, p, i64, i64, p, p, i64, i32]
    lib.gq_gemm.restype = i32
    lib.gq_pack.argtypes = [i32, p, i64, i64, i64, p, i32]
    lib.gq_pack.restype = i32
    lib.gq_packable.argtypes = [i32, i64, i64]
    lib.gq_packable.restype = i32
    lib.gq_packed_bytes.argtypes = [i32, i64, i64]
    lib.gq_packed_bytes.restype = i64
    lib.gq_gemm_type.argtypes = [i32]
    lib.gq_gemm_type.restype = i32
    lib.gq_dequant_rows.argtypes = [i32, p, i64, i64, p, i64, p]
    lib.gq_dequant_rows.restype = i32
    lib.gq_dequant_range.argtypes = [i32, p, i64, i64, i64, i64, p, i32, i32]
    lib.gq_dequant_range.restype = i32
    for name in ("gq_supported", "gq_block_bytes", "gq_block_values"):
        getattr(lib, name).argtypes = [i32]
        getattr(lib, name).restype = i32
    lib.gq_quantize_k.argtypes = [i32, p, i64, i64, p, i32]
    lib.gq_quantize_k.restype = i32
    lib.gq_isa.argtypes = []
    lib.gq_isa.restype = i32
    if full:
        lib.attn_rows.argtypes = [p, i64, i64, i64, i64, p, p, p, p, i64, i64, p, i32]
        lib.attn_rows.restype = i32
        lib.rms_norm_rows.argtypes = [p, p, i64, i64, f32, p]
        lib.rms_norm_rows.restype = None
        for name in ("silu_mul_rows", "gelu_tanh_mul_rows"):
            getattr(lib, name).argtypes = [p, i64, i64, p]
            getattr(lib, name).restype = None
        lib.gq_blocks.argtypes = [p, i64, p, i64, i64, i64, i64, i64, i64, f32, p, p, p, p, i64, i64, i32]
        lib.gq_blocks.restype = i32
    return lib


_FAILED: dict[str, SpeculantError] = {}  # builds that failed in this process: not retried on every load


def _remembered(key: str, make):
    if key in _FAILED:
        raise _FAILED[key]
    try:
        return make()
    except SpeculantError as e:
        _FAILED[key] = e
        raise


def library(isa: str | None = None) -> ctypes.CDLL:
    """The x86 kernels (built on first use; SpeculantError where they cannot run here).

    `isa` picks a build from ISAS (default: the one $SPECULANT_ISA forces, else the fastest this CPU runs whose
    build succeeds; an older gcc without the flag falls back to the next). The results do not depend on the
    choice. With $SPECULANT_ISA=portable there are none: the callers take the portable kernels and torch.
    """
    if isa is None:
        isa = forced_build()
        if isa == "portable":
            raise SpeculantError("the x86 kernels are off: $SPECULANT_ISA=portable (or $SPECULANT_PORTABLE=1) "
                                 "forces the portable build")
    elif isa == "portable" or isa not in BUILDS:
        raise SpeculantError(f"library() builds one of {', '.join(BUILDS[:-1])}, not {isa!r}")
    return _library(isa)


@functools.cache
def _library(isa: str | None) -> ctypes.CDLL:
    def make() -> ctypes.CDLL:
        if not cpu_ok():
            raise SpeculantError(f"{NEEDS}; this CPU ({platform.machine()}) lacks them: the portable kernels "
                                 "and torch serve instead")
        if isa is not None:
            check_build(isa)
        gcc = _compiler()
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the kernels share its libgomp
        names = supported_isas() if isa is None else [isa]
        for name in names:
            extra = next(flags for n, _, flags in ISAS if n == name)
            try:
                lib = _bind(_load(gcc, name, SOURCES, _FLAGS + extra), True)
                lib.speculant_isa = name  # (kernel_build)
                return lib
            except SpeculantError:
                if name == names[-1]:
                    raise
        raise AssertionError("unreachable")

    return _remembered(f"x86:{isa}", make)


@functools.cache
def portable_library() -> ctypes.CDLL:
    """gq.c alone in portable C (any CPU gcc targets): the block-format kernels, bit-identical, slower."""
    def make() -> ctypes.CDLL:
        gcc = _compiler()
        torch.get_num_threads()
        lib = _bind(_load(gcc, "portable", PORTABLE_SOURCES, _BASE_FLAGS), False)
        lib.speculant_isa = "portable"
        return lib

    return _remembered("portable", make)


def gq_library() -> ctypes.CDLL:
    """The block-format kernels: the x86 build where it runs, else the portable one
    ($SPECULANT_ISA picks one, for tests and comparisons: forced_build)."""
    forced = forced_build()  # a bad $SPECULANT_ISA is refused here, not taken as a failed build
    if forced == "portable":
        return portable_library()
    try:
        return library()
    except SpeculantError as e:
        if forced is not None:  # the build asked for by name: no silent substitute
            raise
        why = e
    lib = portable_library()  # said only once it runs: without a compiler neither build does
    if supported_isas():  # an x86 CPU whose builds failed: say so once, not a silent slowdown
        _warn_once(f"speculant: {why}; the portable C kernels run instead (the same results, many times slower)")
    return lib


def kernel_build() -> str:
    """The build gq_library() runs: a name from ISAS, "portable", or "none" (no compiler: torch only)."""
    try:
        lib = gq_library()
    except SpeculantError:
        return "none"
    return getattr(lib, "speculant_isa", "portable")


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger("speculant").warning(message)


def available() -> bool:
    """Whether the x86 kernels run here (CPU features and a compiler; builds them on first call)."""
    try:
        library()
    except SpeculantError:
        return False
    return True
