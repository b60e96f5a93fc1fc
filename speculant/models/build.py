"""Assemble a Transformer in a chosen weight format from a weight source (GGUF or HF folder).

`--dtype gguf` (the default for .gguf files) takes every tensor in the block type the file stores,
memory-mapped: nothing is converted or cached, and the model in memory is the model in the file.
Every other format is assembled one layer at a time from float32 tensors (dequantise, fuse q/k/v and
gate/up, convert), with a progress bar; the converted tensors are saved as safetensors in a
conversion cache keyed by everything its content depends on (the cache layout's version, the source's
fingerprint, the format, the gguf package's quantizers, the calibration tokens), so a second load skips
the work. A cache that cannot be written costs the next load a conversion, never this one: the model
is returned with one line on stderr. Concurrent conversions write under unique temporary names and
rename atomically, so no reader sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import SpeculantError
from .config import ModelConfig
from . import native
from .formats import (CALIBRATED, GGML_TYPES, HEAD_FORMAT, KQUANT_FORMATS, GGMLEmbedding, GGMLLinear, QLinear,
                      linear_from_state, make_linear)
from .block import Block
from .calibration import calibrate_layer
from .rotary import rope_tables
from .transformer import Transformer

_CACHE_VERSION = "3"
_LINEARS = ("qkv", "o", "gate_up", "down")


class WeightSource(Protocol):
    config: ModelConfig

    def has(self, name: str) -> bool: ...
    def get(self, name: str) -> Tensor: ...
    def fingerprint(self) -> str: ...


@contextmanager
def _progress(label: str, total: int, enabled: bool) -> Iterator[callable]:
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as p:
        task = p.add_task(label, total=total)
        yield lambda: p.advance(task)


def _float_layer(src: WeightSource, i: int) -> dict[str, Tensor]:
    """Canonical float tensors of layer i, with q/k/v and gate/up fused into one matrix each."""
    p = f"layers.{i}."
    qkv_w = torch.cat([src.get(p + "q"), src.get(p + "k"), src.get(p + "v")])
    qkv_b = None
    if src.config.qkv_bias:
        qkv_b = torch.cat([src.get(p + "q_bias"), src.get(p + "k_bias"), src.get(p + "v_bias")])
    return {
        "attn_norm": src.get(p + "attn_norm"), "ffn_norm": src.get(p + "ffn_norm"),
        "qkv": qkv_w, "qkv_bias": qkv_b, "o": src.get(p + "o"),
        "gate_up": torch.cat([src.get(p + "gate"), src.get(p + "up")]), "down": src.get(p + "down"),
        "extra": _extra_norms(src, i),
    }


def extra_norm_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The canonical names of a layer's norms beyond attn_norm / ffn_norm (block.Block's `extra`)."""
    return (("q_norm", "k_norm") if cfg.qk_norm else ()) + (("post_attn_norm", "post_ffn_norm") if cfg.post_norms else ())


def _extra_norms(src: WeightSource, i: int) -> dict[str, Tensor]:
    return {n: src.get(f"layers.{i}.{n}") for n in extra_norm_names(src.config)}


def build_native(src, label: str = "model") -> Transformer:
    """The model as the GGUF file stores it: block-format linears over the memory-mapped tensors.

    `src` is a GGUFSource (its `part(name)` gives a tensor's raw blocks; `get(name)` float32 tensors
    for the small ones: norms and biases)."""
    cfg = src.config
    blocks: list[Block] = []
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        qkv_b = None
        if cfg.qkv_bias:
            qkv_b = torch.cat([src.get(p + "q_bias"), src.get(p + "k_bias"), src.get(p + "v_bias")])
        qkv = GGMLLinear([src.part(p + "q"), src.part(p + "k"), src.part(p + "v")], cfg.dim, qkv_b)
        o = GGMLLinear([src.part(p + "o")], cfg.n_heads * cfg.head_dim)
        gate_up = GGMLLinear([src.part(p + "gate"), src.part(p + "up")], cfg.dim)
        down = GGMLLinear([src.part(p + "down")], cfg.hidden_dim)
        blocks.append(Block(cfg, src.get(p + "attn_norm"), qkv, o, src.get(p + "ffn_norm"), gate_up, down, layer=i,
                            extra=_extra_norms(src, i)))
    embed = GGMLEmbedding(src.part("embed"), cfg.dim)
    if embed.num_embeddings != cfg.vocab_size:
        raise SpeculantError(f"{label}: the embedding table has {embed.num_embeddings} rows, the config says "
                             f"vocab_size {cfg.vocab_size}")
    lm_head = embed.as_linear() if cfg.tie_embeddings else GGMLLinear([src.part("lm_head")], cfg.dim)
    return Transformer(cfg, embed, blocks, src.get("norm"), lm_head)


def build_transformer(src: WeightSource, fmt: str, *, cache_dir: Path | None, progress: bool = True,
                      label: str = "model", calibration_ids: list[int] | None = None) -> Transformer:
    """Assemble layer by layer. int8 uses `calibration_ids` (tokens of a fixed text) to smooth
    activation outliers; they flow through the float32 layers as the model is built."""
    if fmt == "gguf":
        if not hasattr(src, "part"):
            raise SpeculantError("--dtype gguf takes a .gguf file's own block types; for a Hugging Face folder "
                                 "choose bf16, f16, q8_0, q6_k, q5_1, q5_0, q4_k, q4_1, q4_0, int8 or float32")
        return build_native(src, label)
    cfg = src.config
    if fmt in CALIBRATED and not cfg.plain:
        raise SpeculantError(f"--dtype {fmt} calibrates the llama/qwen2 block only; for a {cfg.arch} model choose "
                             "bf16, f16, q8_0, q6_k, q5_1, q5_0, q4_k, q4_1, q4_0 or float32")
    cached = None
    if cache_dir is not None:
        cached = cache_dir / f"{cache_key(src, fmt, calibration_ids)}.safetensors"
        if _exists(cached):
            try:
                return _from_states(cfg, _load_states(cached), fmt)
            except SpeculantError:
                try:
                    cached.unlink(missing_ok=True)  # a damaged cache entry is rebuilt, never trusted
                except OSError:
                    pass

    states: dict[str, Tensor] = {}
    blocks: list[Block] = []
    with _progress(f"assembling {label} ({fmt})", cfg.n_layers + 1, progress) as advance:
        embed: Tensor | GGMLEmbedding | None = _file_embedding(src, fmt, cfg.dim)
        calib = fmt in CALIBRATED and bool(calibration_ids)
        # the float32 table, only where something reads it (dequantizing the 0.5B's took 2.2 s of its conversion)
        table = src.get("embed") if embed is None or calib or cfg.tie_embeddings else None
        if calib:
            x = table[torch.tensor(calibration_ids)]  # [T, D] calibration states, carried layer to layer
            cos, sin = rope_tables(cfg, x.shape[0])
        for i in range(cfg.n_layers):
            fl = _float_layer(src, i)
            absmax: dict[str, Tensor] = {}
            if calib:
                absmax, x = calibrate_layer(cfg, fl, x, cos, sin, _LINEARS)
            lin = {n: make_linear(fl[n], fl["qkv_bias"] if n == "qkv" else None, fmt, absmax.get(n)) for n in _LINEARS}
            blocks.append(Block(cfg, fl["attn_norm"], lin["qkv"], lin["o"], fl["ffn_norm"], lin["gate_up"], lin["down"],
                                layer=i, extra=fl["extra"]))
            _collect(states, f"layers.{i}.", fl, lin)
            advance()
        head_w = table if cfg.tie_embeddings else src.get("lm_head")
        norm = src.get("norm")
        head_absmax = None
        if calib:
            head_absmax = F.rms_norm(x, (cfg.dim,), norm, cfg.norm_eps).abs().amax(dim=0)
        lm_head = make_linear(head_w, None, HEAD_FORMAT.get(fmt, fmt), head_absmax)
        advance()
    shape = tuple(table.shape) if embed is None else (embed.num_embeddings, cfg.dim)
    if shape != (cfg.vocab_size, cfg.dim):
        raise SpeculantError(f"embedding shape {shape} does not match the config ({cfg.vocab_size}, {cfg.dim})")
    embed = table if embed is None else embed
    model = Transformer(cfg, embed, blocks, norm, lm_head)
    if cached is not None:
        if isinstance(embed, GGMLEmbedding):
            states.update({f"embed.{k}": v for k, v in embed.state().items()})
        else:
            states["embed"] = embed
        states["norm"] = norm
        states.update({f"lm_head.{k}": v for k, v in lm_head.state().items()})
        if _save_states(cached, states) and fmt in GGML_TYPES:
            del model, blocks, lm_head, states  # the blocks in memory give way to the file's mapping
            return _from_states(cfg, _load_states(cached), fmt)
    return model


def _file_embedding(src: WeightSource, fmt: str, dim: int) -> GGMLEmbedding | None:
    """A .gguf's embedding table in its own type, for a block format made on load (a draft model's default,
    models.draft_dtype), or None where it is kept as float32. Rows are dequantized on lookup as --dtype gguf
    does: the float32 table's values, a quarter of the cache entry (the 0.5B's Q8_0 table: 145 MB, not 545 MB).
    HF folders, other formats and a type the kernels do not read (the gguf package dequantizes it) keep
    the float32 table."""
    if fmt not in GGML_TYPES or not hasattr(src, "part"):
        return None
    try:
        return GGMLEmbedding(src.part("embed"), dim)
    except SpeculantError:
        return None


def cache_key(src: WeightSource, fmt: str, calibration_ids: list[int] | None) -> str:
    """The conversion cache's name for `src` in `fmt`: it changes with anything that changes the content."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        quantizer = version("gguf")  # its reference quantizers make the block formats
    except PackageNotFoundError:
        quantizer = "none"
    calib = ""
    if fmt in CALIBRATED and calibration_ids:
        calib = hashlib.sha256(",".join(map(str, calibration_ids)).encode()).hexdigest()[:16]
    if fmt in KQUANT_FORMATS:  # quantized by kernels/kquant.c: its source is the quantizer's version
        quantizer += "|kquant " + hashlib.sha256(native.KQUANT_SOURCE.read_bytes()).hexdigest()[:16]
    text = f"{_CACHE_VERSION}|{src.fingerprint()}|{fmt}|gguf {quantizer}|calibration {calib}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder that cannot be searched: treated as an empty cache
        return False


def _collect(states: dict[str, Tensor], prefix: str, fl: dict[str, Tensor], lin: dict[str, QLinear]) -> None:
    states[prefix + "attn_norm"] = fl["attn_norm"]
    states[prefix + "ffn_norm"] = fl["ffn_norm"]
    for n, w in fl["extra"].items():
        states[prefix + n] = w
    for n, layer in lin.items():
        for k, v in layer.state().items():
            states[f"{prefix}{n}.{k}"] = v


def _from_states(cfg: ModelConfig, st: dict[str, Tensor], fmt: str) -> Transformer:
    def sub(prefix: str) -> dict[str, Tensor]:
        return {k[len(prefix):]: v for k, v in st.items() if k.startswith(prefix) and "." not in k[len(prefix):]}

    try:
        blocks = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            lin = {n: linear_from_state(sub(f"{p}{n}."), fmt) for n in _LINEARS}
            blocks.append(Block(cfg, st[p + "attn_norm"], lin["qkv"], lin["o"], st[p + "ffn_norm"], lin["gate_up"], lin["down"],
                                layer=i, extra={n: st[p + n] for n in extra_norm_names(cfg)}))
        embed = st["embed"] if "embed" in st else GGMLEmbedding.from_state(sub("embed."))
        return Transformer(cfg, embed, blocks, st["norm"], linear_from_state(sub("lm_head."), fmt))
    except KeyError as e:
        raise SpeculantError(f"conversion cache entry is incomplete (missing {e})") from None


def _load_states(path: Path) -> dict[str, Tensor | np.ndarray]:
    """The cache entry's tensors; GGML blocks (`*.ggml_data`) as numpy views of a read-only memory map
    of the file, as a GGUF file's tensors are, so their layers repack them into 16-row tiles on first use
    and release the file's pages (GGMLLinear): a converted model runs the kernels a .gguf runs. Read as
    tensors, the blocks ran the slower unpacked kernels (`speculant generate -m qwen2.5-coder-0.5b-instruct
    --dtype q4_0 --method ar -n 64 --stats`; docs/measurements.md "Kernel choices")."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:  # validates the header against the file's size
            blocks = [k for k in f.keys() if k.endswith(".ggml_data")]
            st: dict[str, Tensor | np.ndarray] = {k: f.get_tensor(k) for k in f.keys() if k not in blocks}
        if blocks:
            # safetensors' layout: an 8-byte little-endian header size, the JSON header, then the data
            mm = np.memmap(path, dtype=np.uint8, mode="r")
            n = int.from_bytes(mm[:8].tobytes(), "little")
            header = json.loads(mm[8:8 + n].tobytes())
            for k in blocks:  # uint8 [rows, row bytes]
                begin, end = header[k]["data_offsets"]
                st[k] = mm[8 + n + begin:8 + n + end].reshape(header[k]["shape"])
        return st
    except Exception as e:
        raise SpeculantError(f"unreadable conversion cache {path}: {e}") from None


def _save_states(path: Path, states: dict[str, Tensor]) -> bool:
    """Whether the entry was written (a failure is a warning: the model runs, the next load converts again)."""
    from safetensors import SafetensorError  # (what save_file raises for I/O errors: no space left, ...)
    from safetensors.torch import save_file

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # unique per writer: two processes converting the same model never write into one file
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".partial", dir=path.parent)
        os.close(fd)
        # Tied embeddings share storage with lm_head in fp32; safetensors refuses shared tensors.
        save_file({k: v.contiguous().clone() if k.startswith("lm_head") else v.contiguous()
                   for k, v in states.items()}, tmp)
        os.replace(tmp, path)  # atomic: readers see no file or the whole file
        return True
    except (OSError, SafetensorError) as e:
        logging.getLogger("speculant").warning(
            f"speculant: cannot save the converted weights in {path.parent} ({getattr(e, 'strerror', None) or e}); the model runs, "
            "but the next load converts it again (set SPECULANT_HOME to a writable folder to keep them)")
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
