"""Faults of the environment (issue 15): no C compiler, a compiler that fails, a CPU the x86 kernels do
not run on, a kernel folder that cannot be written, a conversion cache that cannot be written, two
processes converting one model at once, and what the conversion cache is keyed by.

Kernel faults run in child processes (a fresh SPECULANT_HOME, a fake compiler, platform.machine()
patched), so this process's built kernels and remembered failures are untouched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# A child: a tiny GGUF model generated from twice through the CLI (two loads); it prints the compiler's
# call count after each load and the kernel library's path where the kernels built.
_CHILD = """
import platform, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
if {machine!r}:
    platform.machine = lambda: {machine!r}
from test_cli import write_gguf
from speculant.cli import main
from speculant.models import native
count = Path(sys.argv[2])
path = write_gguf(Path(sys.argv[1]), dim=64, hidden=128)  # widths the block kernels take
for _ in range(2):
    assert main(["generate", "--model", str(path), "-n", "6", "--no-progress", "--threads", "1", "a b"]) == 0
    print("calls", len(count.read_text().split()) if count.exists() else 0, flush=True)
try:
    print("library", native.gq_library()._name)
except Exception as e:
    print("library none", type(e).__name__)
"""


def run_child(tmp_path: Path, *, machine: str = "", cc: str | None = None, home: Path | None = None):
    env = {**os.environ, "SPECULANT_HOME": str(home or tmp_path / "home"), "SPECULANT_THREADS": "1"}
    env.pop("SPECULANT_PORTABLE", None)
    env.pop("SPECULANT_ISA", None)
    if cc is not None:
        env["SPECULANT_CC"] = cc
    code = _CHILD.format(tests=str(TESTS), machine=machine)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny.gguf"), str(tmp_path / "cc-calls")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    texts = [line for line in lines if not line.startswith(("calls ", "library "))]
    calls = [int(line.split()[1]) for line in lines if line.startswith("calls ")]
    library = next(line.split(" ", 1)[1] for line in lines if line.startswith("library "))
    return texts, calls, library, out.stderr


def failing_compiler(tmp_path: Path) -> str:
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho call >> {tmp_path / 'cc-calls'}\necho 'cc1: error: this compiler is broken' >&2\n"
                  "exit 1\n")
    cc.chmod(0o755)
    return str(cc)


def fallback_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "runs in float32 instead" in line]


def test_failing_compiler_one_clear_line_per_load_and_gcc_runs_once(tmp_path):
    """A compiler that fails: each load says in one line why and what it runs instead (float32), the
    answer is generated, and the failed builds are remembered (gcc is not run again by the second load)."""
    texts, calls, library, stderr = run_child(tmp_path, cc=failing_compiler(tmp_path))
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0]
    assert calls[0] >= 1 and calls[1] == calls[0], calls  # remembered for the process
    lines = fallback_lines(stderr)
    assert len(lines) == 2 and all("compiling the native kernels" in s and "this compiler is broken" in s
                                   for s in lines), stderr
    assert library == "none SpeculantError"
    assert "Traceback" not in stderr


def test_no_compiler_on_a_non_x86_cpu_gives_advice_that_works_there(tmp_path):
    """No compiler on an ARM machine: the line says to install gcc or use --dtype float32 (never int8,
    which cannot run there either), and the float path runs."""
    texts, _, library, stderr = run_child(tmp_path, machine="aarch64", cc=str(tmp_path / "no-such-cc"))
    (line,) = fallback_lines(stderr)[:1]
    assert "no C compiler" in line and "--dtype float32" in line and "int8" not in line
    assert len(fallback_lines(stderr)) == 2 and texts[0] and library == "none SpeculantError"


def test_non_x86_cpu_runs_the_portable_kernels_from_an_unwritable_home(tmp_path):
    """platform.machine() = aarch64, and SPECULANT_HOME is a file (nothing can be written under it): the
    x86 kernels are refused, the portable ones build in a temporary folder, the GGUF model runs in its own
    block formats (no float32 fallback) and generates exactly what the x86 build generates here."""
    home = tmp_path / "home-is-a-file"
    home.write_text("not a folder")
    texts, _, library, stderr = run_child(tmp_path, machine="aarch64", home=home)
    assert fallback_lines(stderr) == [] and "Traceback" not in stderr, stderr
    assert Path(library).parent.name.startswith("speculant-kernels-") and not library.startswith(str(home))
    from speculant.models import native

    if not native.available():
        pytest.skip("the x86 kernels do not run on this machine: nothing to compare the portable build with")
    # The x86 side is only the reference: its child finds this process's build of the same sources and
    # flags (the cache is keyed by their hash) instead of compiling it again (where $SPECULANT_ISA made this
    # process pick another build, the child builds its own); the portable side above was built from source.
    built = Path(native.library()._name)
    (tmp_path / "x86" / "home" / "kernels").mkdir(parents=True)
    shutil.copy(built, tmp_path / "x86" / "home" / "kernels" / built.name)
    x86_texts, _, x86_library, _ = run_child(tmp_path / "x86")
    assert Path(x86_library).name != Path(library).name and x86_texts == texts


# ---------------------------------------------------------------------------------- conversion cache
def tiny_hf_folder(folder: Path) -> Path:
    from fuzzing_hf_config import SEEDS, _weights

    _, arch, tied, config = SEEDS[0]
    _weights(folder, arch, tied)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_unwritable_conversion_cache_still_loads_with_one_line(tmp_path, caplog):
    import torch

    from speculant.models.build import build_transformer
    from speculant.models.load_hf import HFSource

    src = HFSource(tiny_hf_folder(tmp_path / "model"))
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="speculant"):
        model = build_transformer(src, "float32", cache_dir=tmp_path / "file" / "converted", progress=False)
    assert torch.isfinite(model(torch.tensor([1, 2, 3]), model.new_cache(3)).logits).all()
    (record,) = caplog.records
    assert "cannot save the converted weights" in record.getMessage() and "SPECULANT_HOME" in record.getMessage()


_CONVERT = """
import sys, time
from pathlib import Path
import safetensors.torch
from speculant.models.build import build_transformer
from speculant.models.load_hf import HFSource
save = safetensors.torch.save_file
def slow_save(*a, **kw):  # hold the written file under its temporary name for a while
    save(*a, **kw)
    time.sleep(1.0)
safetensors.torch.save_file = slow_save
src = HFSource(Path(sys.argv[1]))
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.005)
build_transformer(src, "float32", cache_dir=Path(sys.argv[2]), progress=False)
print("done")
"""


def test_two_processes_converting_one_model(tmp_path):
    """Both finish, one whole cache entry is left (no partial file), and it loads. (With one shared
    temporary name, the second rename found its file gone: FileNotFoundError.)"""
    import torch

    from speculant.models.build import build_transformer
    from speculant.models.load_hf import HFSource

    folder, cache, go = tiny_hf_folder(tmp_path / "model"), tmp_path / "converted", tmp_path / "go"
    env = {**os.environ, "SPECULANT_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERT, str(folder), str(cache), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.write_text("go")
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert all(out.strip() == "done" for out, _ in results)
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 1 and entries[0].endswith(".safetensors"), entries
    fresh = build_transformer(HFSource(folder), "float32", cache_dir=None, progress=False)
    cached = build_transformer(HFSource(folder), "float32", cache_dir=cache, progress=False)  # from the entry
    ids = torch.tensor([4, 5, 6])
    assert torch.equal(fresh(ids, fresh.new_cache(3)).logits, cached(ids, cached.new_cache(3)).logits)


def test_conversion_cache_key_covers_quantizer_and_calibration(tmp_path, monkeypatch):
    import importlib.metadata

    from speculant.models.build import cache_key
    from speculant.models.load_hf import HFSource

    src = HFSource(tiny_hf_folder(tmp_path / "model"))
    a, b = [1, 2, 3], [1, 2, 4]
    assert cache_key(src, "int8", a) == cache_key(src, "int8", list(a))
    assert cache_key(src, "int8", a) != cache_key(src, "int8", b)  # int8 is calibrated on these tokens
    assert cache_key(src, "q8_0", a) == cache_key(src, "q8_0", b)  # (q8_0 is not)
    assert len({cache_key(src, f, a) for f in ("float32", "q8_0", "int8", "bf16")}) == 4
    before = cache_key(src, "q8_0", a)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "gguf" else real(name))
    assert cache_key(src, "q8_0", a) != before  # another gguf package quantizes differently


def test_a_failed_x86_build_falls_back_to_the_portable_kernels_with_a_warning(monkeypatch, caplog):
    """An x86 CPU whose kernel builds fail (a broken compiler, a bad edit) still runs, on the portable build,
    and the user is told once instead of finding decoding many times slower."""
    from speculant.errors import SpeculantError
    from speculant.models import native

    def broken(isa=None):
        raise SpeculantError("compiling the native kernels with gcc failed: error: boom")

    monkeypatch.setattr(native, "library", broken)
    monkeypatch.setattr(native, "supported_isas", lambda: ["avx2"])
    monkeypatch.delenv("SPECULANT_PORTABLE", raising=False)
    monkeypatch.delenv("SPECULANT_ISA", raising=False)
    native._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="speculant"):
        first, second = native.gq_library(), native.gq_library()
    assert first is native.portable_library() and second is first
    warnings = [r.getMessage() for r in caplog.records if "portable C kernels run instead" in r.getMessage()]
    assert len(warnings) == 1 and "boom" in warnings[0]
