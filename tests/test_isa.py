"""$SPECULANT_ISA and `bench speed|methods --isa` (models/native.py): the build asked for is the one loaded, on
every build this CPU runs, with the same results bit for bit; what this CPU cannot run, or an unknown name, is
refused with a message that says what to pick; two builds never share a cached library."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.errors import SpeculantError
from speculant.models import native

ROOT = Path(__file__).resolve().parent.parent
GQ_ISA = {"avx512vnni": 3, "avxvnni": 2, "avx2": 1, "portable": 0}  # gq.c's gq_isa() of each build

# In a process of its own (the build is chosen once per process): what was loaded, and a representative
# bit-identity check through the model's layer (GGMLLinear -> gq_library): three block families, repacked and
# in the file's layout, 11 rows at once (more than one 8-row pass) against each row alone.
_CHILD = r"""
import hashlib, json, sys
from pathlib import Path
import numpy as np, torch
from gguf import GGMLQuantizationType as T
sys.path.insert(0, sys.argv[1])
from tests.test_gguf_kernels import random_blocks
from speculant.models import native
from speculant.models.formats.ggml import GGMLLinear
from speculant.models.formats.ggml_blocks import Part
torch.set_num_threads(2)
K = 512
parts = [Part(int(t), random_blocks(t, n, K, seed=s))
         for s, (t, n) in enumerate([(T.Q4_K, 32), (T.Q6_K, 16), (T.Q5_0, 16), (T.Q8_0, 5)])]
x = torch.randn(11, K, generator=torch.Generator().manual_seed(5))
digests, invariant = [], True
for pack in (True, False):
    lin = GGMLLinear(parts, K, torch.randn(69, generator=torch.Generator().manual_seed(6)), pack=pack)
    y = lin(x)
    invariant &= all(torch.equal(y[i:i + 1], lin(x[i:i + 1])) for i in range(len(x)))
    digests.append(hashlib.sha256(y.numpy().tobytes()).hexdigest())
lib = native.gq_library()
print(json.dumps({"build": native.kernel_build(), "gq_isa": lib.gq_isa(), "file": Path(lib._name).name,
                  "x86": native.available(), "invariant": invariant, "digests": digests}))
"""


def _child(build: str) -> dict:
    env = {**os.environ, "SPECULANT_ISA": build, "SPECULANT_THREADS": "2"}
    env.pop("SPECULANT_PORTABLE", None)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_each_build_is_the_one_loaded_and_gives_the_same_bits():
    runs = {b: _child(b) for b in native.supported_isas() + ["portable"]}
    for build, r in runs.items():
        assert r["build"] == build and r["gq_isa"] == GQ_ISA[build], r
        assert r["file"].startswith(f"speculant-{build}-"), r  # its own cache entry
        assert r["x86"] == (build != "portable"), r  # portable: the fused loop and attention kernels are off too
        assert r["invariant"], build
    assert len({tuple(r["digests"]) for r in runs.values()}) == 1, runs
    assert len({r["file"] for r in runs.values()}) == len(runs)


def test_two_builds_never_share_a_cached_library():
    paths = {name: native.library_path(name, native.SOURCES, native._FLAGS + extra) for name, _, extra in native.ISAS}
    paths["portable"] = native.library_path("portable", native.PORTABLE_SOURCES, native._BASE_FLAGS)
    assert len(set(paths.values())) == len(paths) == len(native.BUILDS)
    assert all(p.name.startswith(f"speculant-{name}-") for name, p in paths.items())
    for name in native.supported_isas():  # the loaded file is that build's entry
        assert Path(native.library(name)._name) == paths[name]


def test_every_included_header_is_part_of_the_build_hash():
    todo, included = list(native.SOURCES), set()
    while todo:  # the sources' includes, and theirs
        for h in re.findall(r'^#include "(\w+\.h)"', todo.pop().read_text(), re.MULTILINE):
            if h not in included:
                included.add(h)
                todo.append(native.SOURCES[0].parent / h)
    assert {"attention_cache.h", "attention_group.h", "simd.h"} <= included  # the scan reads the includes
    assert included <= {h.name for h in native.HEADERS}, included - {h.name for h in native.HEADERS}


def test_unknown_builds_are_refused_listing_the_choices(monkeypatch):
    monkeypatch.delenv("SPECULANT_PORTABLE", raising=False)
    monkeypatch.setenv("SPECULANT_ISA", "avx9")
    for call in (native.forced_build, native.gq_library, native.library):  # never a silent fallback
        with pytest.raises(SpeculantError, match="avx512vnni, avxvnni, avx2, portable") as e:
            call()
        assert "'avx9'" in str(e.value)


def test_a_build_this_cpu_lacks_is_refused_naming_what_it_runs(monkeypatch):
    monkeypatch.delenv("SPECULANT_PORTABLE", raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse4_2"})  # an AVX2-only x86
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    assert native.check_build("avx2") == "avx2" and native.check_build("portable") == "portable"
    monkeypatch.setenv("SPECULANT_ISA", "avx512vnni")
    for call in (native.forced_build, native.gq_library):
        with pytest.raises(SpeculantError, match=r"cannot run the avx512vnni build") as e:
            call()
        assert "lacks avx512_vnni, avx512bw, avx512f, avx512vl" in str(e.value)
        assert "the builds it runs: avx2, portable" in str(e.value)
    with pytest.raises(SpeculantError, match=r"cannot run the avxvnni build .* lacks avx_vnni"):
        native.check_build("avxvnni")
    monkeypatch.setattr(native, "cpu_flags", lambda: set())  # no AVX2 (or not x86): only the portable build
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    with pytest.raises(SpeculantError, match=r"\(aarch64\) cannot run the avx2 build .* lacks avx2, f16c, fma; "
                                             r"the builds it runs: portable"):
        native.check_build("avx2")
    monkeypatch.setenv("SPECULANT_ISA", "Portable")  # case and spaces do not matter
    assert native.forced_build() == "portable"


def test_the_isa_and_the_older_portable_switch_must_agree(monkeypatch):
    monkeypatch.setenv("SPECULANT_PORTABLE", "1")
    monkeypatch.setenv("SPECULANT_ISA", "")
    assert native.forced_build() == "portable"
    with pytest.raises(SpeculantError, match="x86 kernels are off"):
        native.library()
    assert native.gq_library() is native.portable_library()
    monkeypatch.setenv("SPECULANT_ISA", "avx2")
    with pytest.raises(SpeculantError, match="ask for two builds"):
        native.forced_build()


def test_bench_isa_is_checked_before_loading_models(monkeypatch, tmp_path, capsys):
    from speculant.cli import main

    monkeypatch.delenv("SPECULANT_PORTABLE", raising=False)
    monkeypatch.setenv("SPECULANT_ISA", "")  # restored after the test: --isa sets it for the process
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    out = str(tmp_path / "out")
    for mode in ("speed", "methods"):
        assert main(["bench", mode, "--isa", "avxvnni", "--out", out]) == 2
        assert "cannot run the avxvnni build" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "speed", "--isa", "sse2", "--out", out])
    err = capsys.readouterr().err
    assert "invalid choice: 'sse2'" in err and all(b in err for b in native.BUILDS)
    monkeypatch.setenv("SPECULANT_ISA", "sse2")
    assert main(["bench", "speed", "--models", "m", "--out", out]) == 2
    assert "unknown kernel build 'sse2'" in capsys.readouterr().err
    # a good --isa becomes the process's build: what every later kernel load reads
    monkeypatch.setenv("SPECULANT_ISA", "")
    assert main(["bench", "speed", "--isa", "portable", "--tokens", "0", "--out", out]) == 2  # --tokens: refused later
    assert os.environ["SPECULANT_ISA"] == "portable" and native.kernel_build() == "portable"
