"""Models: one Transformer for the Llama family, its KV cache, weight formats and loaders.

`load_model(spec)` is the single entry point: a preset name, a .gguf path or an HF folder in,
a ready `LoadedModel` (weights in the chosen format + the model's tokenizer) out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..tokenizer import Tokenizer
from .build import build_transformer
from .calibration import CALIBRATION_TEXT
from .cache import KVCache
from .config import ModelConfig
from .quant import WEIGHT_FORMATS
from .transformer import Output, Transformer

__all__ = ["KVCache", "LoadedModel", "ModelConfig", "Output", "Transformer", "default_dtype", "load_model"]


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    model: Transformer
    tokenizer: Tokenizer
    dtype: str

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


def default_dtype(device: str = "cpu") -> str:
    """The fastest format that tracks float32 closely (measurements in the README): int4 where its AVX2
    kernel can be built, else int8 on x86 (FBGEMM), else float32."""
    if device != "cpu":
        return "float32"
    from .int4 import int4_available

    if int4_available():
        return "int4"
    return "int8" if "fbgemm" in torch.backends.quantized.supported_engines else "float32"


def load_model(spec: str, dtype: str | None = None, *, device: str = "cpu", progress: bool = True,
               use_cache: bool = True) -> LoadedModel:
    from ..hub import resolve_model, speculant_home
    from .load_gguf import GGUFSource
    from .load_hf import HFSource

    dtype = dtype or default_dtype(device)
    if dtype not in WEIGHT_FORMATS:
        raise SpeculantError(f"unknown --dtype {dtype!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if device != "cpu" and dtype != "float32":
        raise SpeculantError(f"--dtype {dtype} runs on the CPU only; use --dtype float32 on {device}")
    path = resolve_model(spec)
    if path.is_dir():
        src = HFSource(path)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        src = GGUFSource(path)
        tokenizer = Tokenizer.from_gguf(src.fields)
    cache_dir = speculant_home() / "converted" if use_cache else None
    calib = tokenizer.encode(CALIBRATION_TEXT, add_special=False)
    model = build_transformer(src, dtype, cache_dir=cache_dir, progress=progress, label=path.name,
                              calibration_ids=calib)
    return LoadedModel(name=spec, path=path, model=model.to(device), tokenizer=tokenizer, dtype=dtype)
