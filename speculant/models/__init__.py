"""Models: one Transformer for the Llama family, its KV cache, weight formats and loaders.

`load_model(spec)` is the single entry point: a preset name, a .gguf path or an HF folder in,
a ready `LoadedModel` (weights in the chosen format + the model's tokenizer) out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculantError
from ..gguf_file import GGUFTensor
from ..text.tokenizer import Tokenizer
from .build import build_transformer
from .calibration import CALIBRATION_TEXT
from .cache import KVCache
from .cache import check_kv_dtype, default_kv_dtype, kv_dtype as kv_dtype_of
from .config import ModelConfig
from .formats import WEIGHT_FORMATS
from .transformer import Output, Transformer

__all__ = ["KVCache", "LoadedModel", "ModelConfig", "Output", "Transformer", "default_dtype", "load_model",
           "resolve_device"]


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


def default_dtype(path: Path | None = None, device: str = "cpu") -> str:
    """The format the model file stores: `gguf` (its own block types) for a .gguf file, the stored float
    type (bf16, f16) for a Hugging Face folder where the block-format kernels run; float32 otherwise."""
    from .formats import ggml_available

    if device != "cpu" or not ggml_available():
        return "float32"
    if path is None or not path.is_dir():
        return "gguf"
    return {"BF16": "bf16", "F16": "f16"}.get(_stored_dtype(path), "float32")


def resolve_device(device: str | torch.device) -> torch.device:
    """`--device` as a torch.device: cpu or cuda[:N] (float32 only there), checked before any weights load."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpeculantError(f"unknown --device {device!r}; use cpu or cuda (cuda:N for another GPU)") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise SpeculantError(f"--device {device} is not supported; use cpu or cuda (cuda:N for another GPU)")
    if not torch.cuda.is_available():
        raise SpeculantError(f"--device {device}: this torch build ({torch.__version__}) sees no CUDA GPU; "
                             "install a CUDA build of torch, or use --device cpu")
    n = torch.cuda.device_count()
    index = 0 if dev.index is None else dev.index
    if not 0 <= index < n:
        raise SpeculantError(f"--device {device}: there is no GPU {index} (this machine has {n}: cuda:0..cuda:{n - 1})")
    return torch.device("cuda", index)


# A draft model's format when none is asked for: drafting streams all of the draft's weights for every
# token it drafts, and a draft's format moves only how often the target agrees, never the output. Q4_0 made
# the 0.5B Qwen2.5 draft's step about a quarter cheaper and greedy `hybrid` faster than the file's own
# Q5_0 or Q4_1 (`scripts/draft_formats.py --formats gguf q4_0 q4_1`; docs/measurements.md "Draft format").
DRAFT_DTYPE = "q4_0"
# Bits per weight of the blocks' matrices above which a draft is requantized: the 0.5B's 5.52 (Q5_0 with
# some Q4_K/Q6_K) is; a 4-bit file (Q4_K_M's 4.81, Q4_1's 5.0) keeps its own format: Q4_0's 4.5 would save
# less and stack a second rounding onto the first (not measured).
DRAFT_REQUANT_BITS = 5.25


def draft_dtype(tensors: Sequence[GGUFTensor]) -> str:
    """The format a draft model whose .gguf holds `tensors` loads in where `gguf` would be the default: Q4_0
    where its blocks' weights take more than DRAFT_REQUANT_BITS per weight and Q4_0's 32-value blocks divide
    their rows (requantized once, then read from the conversion cache), else `gguf`."""
    mats = [t for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    n = sum(t.n_elements for t in mats)
    if not n or any(t.shape[0] % 32 for t in mats):  # shape[0]: a row's length (GGUF order)
        return "gguf"
    return DRAFT_DTYPE if 8 * sum(t.n_bytes for t in mats) / n > DRAFT_REQUANT_BITS else "gguf"


def _kernels_missing() -> str | None:
    """Why the block-format kernels cannot run here (their build failure, remembered), or None."""
    from . import native

    try:
        native.gq_library()
    except SpeculantError as e:
        return str(e)
    return None


def _stored_dtype(folder: Path) -> str | None:
    """The safetensors dtype ("BF16", "F16", "F32", ...) of a model folder's first weight, if readable."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    return h.get_slice(k).get_dtype()
        except Exception:  # an unreadable file is reported by the loader with its own message
            return None
    return None


def load_model(spec: str, dtype: str | None = None, *, device: str | torch.device = "cpu", progress: bool = True,
               use_cache: bool = True, draft: bool = False, kv_dtype: str | None = None) -> LoadedModel:
    """A model by preset name, .gguf path or Hugging Face folder, in `dtype` (None: the file's own format;
    for a `draft` model, `draft_dtype`'s choice); its KV caches in `kv_dtype` (f32, f16 or q8_0, cache.KV_DTYPES; None:
    cache.default_kv_dtype of the weight format, f16 but for float32 weights)."""
    from ..hub import resolve_model, speculant_home
    from .load_gguf import GGUFSource
    from ..gguf_file import architecture
    from .gemma4_gguf import ARCH as GEMMA4, load_gemma4_gguf
    from .gemma4_load import is_gemma4_folder, load_gemma4
    from .load_hf import HFSource

    if kv_dtype is not None:
        kv_dtype_of(kv_dtype)  # before any loading: a typo is an error at once
    if dtype is not None and dtype not in WEIGHT_FORMATS:
        raise SpeculantError(f"unknown --dtype {dtype!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    dev = resolve_device(device)
    if dev.type != "cpu" and dtype not in (None, "float32"):
        raise SpeculantError(f"--dtype {dtype} runs on the CPU only (its kernels are C); "
                             f"use --dtype float32 on {device}")
    path = resolve_model(spec)
    chosen = dtype is None
    if chosen:
        dtype = default_dtype(path, dev.type)
        why = _kernels_missing() if dev.type == "cpu" else None
        if why is not None:  # one line, not a silent slowdown
            logging.getLogger("speculant").warning(
                f"speculant: {why}; {path.name} runs in float32 instead of its block formats (slower, more memory)")
    from .load_qwen35 import is_qwen35_folder, load_qwen35
    from .qwen35_gguf import Qwen35GGUFSource, is_qwen35_gguf

    # hybrid linear attention: its own model class (models/qwen35.py), from an HF folder or a qwen35 GGUF
    if is_qwen35_folder(path) or is_qwen35_gguf(path):
        q35 = Qwen35GGUFSource(path) if path.is_file() else None
        model = load_qwen35(path, dtype, dev, kv_dtype_of(kv_dtype or default_kv_dtype(dtype)), q35)
        tokenizer = Tokenizer.from_hf_dir(path) if q35 is None else Tokenizer.from_gguf(q35.fields)
        return LoadedModel(name=spec, path=path, model=model, tokenizer=tokenizer, dtype=dtype)
    gemma4 = is_gemma4_folder(path)  # its own model class (models/gemma4.py)
    gemma4_file = not path.is_dir() and architecture(path) == GEMMA4  # the same class from llama.cpp's gemma4 file
    if path.is_dir():
        src = None if gemma4 else HFSource(path)
        tokenizer = Tokenizer.from_hf_dir(path)
    elif gemma4_file:
        model, fields = load_gemma4_gguf(path, dtype)
        tokenizer = Tokenizer.from_gguf(fields)
    else:
        src = GGUFSource(path)
        tokenizer = Tokenizer.from_gguf(src.fields)
        if draft and chosen and dtype == "gguf":  # from the header just read, not a second parse of it
            dtype = draft_dtype(src.file.tensors)
    cache_dir = speculant_home() / "converted" if use_cache else None
    calib = tokenizer.encode(CALIBRATION_TEXT, add_special=False)
    if gemma4:
        model = load_gemma4(path, dtype)
    elif not gemma4_file:
        model = build_transformer(src, dtype, cache_dir=cache_dir, progress=progress, label=path.name,
                                  calibration_ids=calib)
    model = model.to(dev)
    model.kv_dtype = kv_dtype_of(kv_dtype or default_kv_dtype(dtype))
    check_kv_dtype(model.kv_dtype, model.cfg.head_dim)  # q8_0 needs whole blocks: said now, not at the first prompt
    if dev.type == "cpu":
        # The fused block loop, built now: its layers repack here (load time), not in the first request. The
        # output layer repacks on its first use, and never for a draft model, which runs its first rows only.
        model.fused_blocks()
    return LoadedModel(name=spec, path=path, model=model, tokenizer=tokenizer, dtype=dtype)
