"""Where heads live: SPECULANT_HOME/heads/NAME/ (config.json + model.safetensors), picked by name or path."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpeculantError
from ..hub import speculant_home
from .gguf_drafter import is_gguf


def heads_dir() -> Path:
    return speculant_home() / "heads"


def default_name(model_name: str, method: str) -> str:
    """`qwen2.5-coder-1.5b-instruct-eagle3` for a preset; a file or folder contributes its stem."""
    stem = Path(model_name).stem if model_name.endswith(".gguf") else Path(model_name).name
    return f"{stem}-{method}"


def list_heads() -> list[Path]:
    d = heads_dir()
    return sorted(p for p in d.iterdir() if (p / "config.json").is_file()) if d.is_dir() else []


def resolve_heads(spec: str | None, model_name: str, method: str) -> Path:
    """The checkpoint folder of `--heads spec`: a path, a name under heads_dir(), or (None) the
    default name for this model and method."""
    name = spec or default_name(model_name, method)
    p = Path(name).expanduser()
    if (p / "config.json").is_file() or is_gguf(p):  # a folder, or llama.cpp's EAGLE-3 drafter GGUF
        return p
    q = heads_dir() / name
    if (q / "config.json").is_file():
        return q
    have = ", ".join(h.name for h in list_heads()) or "none"
    how = f"speculant train-heads --method {method} --model {model_name}"
    if spec is None:
        raise SpeculantError(f"--method {method} needs draft heads for {model_name}: none found at {q}. Train them with "
                             f"`{how}` or pass --heads NAME|PATH (heads here: {have})")
    raise SpeculantError(f"--heads {spec}: no head checkpoint there (a folder with config.json, or a name in {heads_dir()}; "
                         f"heads here: {have}). Train one with `{how}`")
