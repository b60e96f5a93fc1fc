"""Weights and config from a GGUF file (llama.cpp's format), read by `speculant.gguf_file`.

Tensors are dequantised to float32 by the `gguf` package one at a time, on demand, so
assembling a quantised model never holds the whole float32 model in memory. Names are mapped to
the canonical names `build.py` expects. GGUF llama files store q/k rows permuted for llama.cpp's
interleaved rotary layout; we undo that so one rotate-half rotary serves every architecture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import SpeculantError
from ..gguf_file import GGUFFile, GGUFTensor
from .config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
}


class GGUFSource:
    """A model's config and float32 tensors by canonical name, read lazily from a GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        self.fields = self.file.fields
        self.tensors = self.file.by_name
        self.config = self._config()

    def fingerprint(self) -> str:
        st = self.path.stat()
        return f"gguf:{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"

    def _config(self) -> ModelConfig:
        try:
            return self._read_config()
        except (TypeError, ValueError, OverflowError) as e:  # a list or string where a number belongs, ...
            raise SpeculantError(f"GGUF file {self.path} has malformed model metadata ({e}); "
                                 "it is not a usable model file") from None

    def _read_config(self) -> ModelConfig:
        f = self.fields
        arch = str(f.get("general.architecture", "?"))
        if arch not in ("llama", "qwen2"):
            raise SpeculantError(f"unsupported architecture {arch!r} in {self.path}: speculant runs llama and qwen2 models")

        def need(key: str) -> object:
            if f"{arch}.{key}" not in f:
                raise SpeculantError(f"GGUF file {self.path} lacks metadata {arch}.{key}; it is not a complete model file")
            return f[f"{arch}.{key}"]

        n_heads = int(need("attention.head_count"))
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise SpeculantError(f"GGUF file {self.path} has no token_embd.weight tensor")
        dim = int(need("embedding_length"))
        vocab = int(f.get(f"{arch}.vocab_size", int(embd.shape[1])))
        factors = self.tensors.get("rope_freqs.weight")
        return ModelConfig(
            arch=arch,
            n_layers=int(need("block_count")),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", n_heads)),
            hidden_dim=int(need("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(need("context_length")),
            norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
            head_dim=int(f.get(f"{arch}.attention.key_length", dim // n_heads)),
            qkv_bias=f"blk.0.attn_q.bias" in self.tensors,
            tie_embeddings="output.weight" not in self.tensors,
            rope_freq_factors=None if factors is None else tuple(float(x) for x in self._load(factors)),
        )

    def has(self, name: str) -> bool:
        return self._gguf_name(name) in self.tensors

    def get(self, name: str) -> Tensor:
        """Float32 tensor for a canonical name, in HF layout ([out, in] for projections)."""
        gname = self._gguf_name(name)
        if gname not in self.tensors:
            raise SpeculantError(f"GGUF file {self.path} has no tensor {gname}; the file is incomplete")
        w = torch.from_numpy(self._load(self.tensors[gname]))
        c = self.config
        if c.arch == "llama" and name.rsplit(".", 1)[-1] in ("q", "k", "q_bias", "k_bias"):
            heads = c.n_heads if ".q" in name else c.n_kv_heads
            w = _unpermute(w, heads)
        return w

    def part(self, name: str):
        """The raw blocks of a 2-D tensor by canonical name, memory-mapped: a formats.ggml.Part whose rows
        are the output features (llama q/k rows carry the permutation that `get` applies)."""
        from .formats.ggml import Part, check_type, row_bytes

        gname = self._gguf_name(name)
        t = self.tensors.get(gname)
        if t is None:
            raise SpeculantError(f"GGUF file {self.path} has no tensor {gname}; the file is incomplete")
        if len(t.shape) != 2:
            raise SpeculantError(f"tensor {gname} in {self.path} has shape {t.shape}; a 2-D matrix was expected")
        qtype = check_type(int(t.tensor_type), gname)
        k, rows = t.shape
        rb = row_bytes(qtype, k)
        if rb * rows != t.n_bytes:
            raise SpeculantError(f"tensor {gname} in {self.path}: {t.n_bytes} bytes do not hold {rows} rows of "
                                 f"{k} {qtype.name} values; the file is corrupt")
        data = self.file.raw(t).reshape(rows, rb)
        perm = None
        c = self.config
        if c.arch == "llama" and name.rsplit(".", 1)[-1] in ("q", "k"):
            heads = c.n_heads if name.endswith(".q") else c.n_kv_heads
            order = _unpermute(torch.arange(rows), heads)  # new row i <- file row order[i]
            perm = torch.empty(rows, dtype=torch.int32)
            perm[order] = torch.arange(rows, dtype=torch.int32)
            perm = perm.numpy()
        return Part(int(qtype), data, perm)

    def _gguf_name(self, name: str) -> str:
        if name == "embed":
            return "token_embd.weight"
        if name == "norm":
            return "output_norm.weight"
        if name == "lm_head":
            return "output.weight"
        _, i, part = name.split(".")
        return f"blk.{i}.{_LAYER_NAMES[part]}"

    def _load(self, t: GGUFTensor) -> np.ndarray:
        return self.file.dequantize(t)


def _unpermute(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
