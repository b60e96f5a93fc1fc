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
from .formats.ggml_blocks import dequantize

_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight",
}
_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "smollm3")
_PERMUTED = ("llama", "smollm3")  # the archs whose q/k rows llama.cpp's converter permutes
_NOPE_STEP = 4  # llama.cpp's smollm3: no rotary in every fourth layer (src/models/smollm3.cpp)
# llama.cpp's gemma3 defaults (src/models/gemma3.cpp, llama-hparams.h): 5 sliding-window layers then a
# global one, and a rotary base of 10000 in the sliding-window layers. Its converter stores Gemma's
# zero-centred norm weights with the 1 already added, so they are used as they are.
_GEMMA_PATTERN = 6
_GEMMA_LOCAL_BASE = 10000.0


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
        if arch not in _ARCHS:
            raise SpeculantError(f"unsupported architecture {arch!r} in {self.path}: speculant runs "
                                 f"{', '.join(_ARCHS)} models")

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
        n_layers = int(need("block_count"))
        if n_heads < 1:
            raise SpeculantError(f"GGUF file {self.path}: {arch}.attention.head_count is {n_heads}; it must be >= 1")
        head_dim = int(f.get(f"{arch}.attention.key_length", dim // n_heads))
        if head_dim < 1:
            raise SpeculantError(f"GGUF file {self.path}: the head size ({arch}.attention.key_length, or "
                                 f"embedding_length / head_count) is {head_dim}; it must be >= 1")
        freq_factors = None if factors is None else tuple(float(x) for x in self._load(factors))
        scaling = str(f.get(f"{arch}.rope.scaling.type", "none"))
        if scaling == "linear":  # positions divided by the factor == every frequency divided by it
            if freq_factors is not None:
                raise SpeculantError(f"GGUF file {self.path} has both rope_freqs and linear rotary scaling; "
                                     "speculant runs one or the other")
            factor = float(f.get(f"{arch}.rope.scaling.factor", 0.0))
            if not 0.0 < factor < float("inf"):
                raise SpeculantError(f"GGUF file {self.path}: linear rotary scaling needs a {arch}.rope.scaling.factor "
                                     f"> 0, got {factor}")
            freq_factors = (factor,) * (head_dim // 2)
        elif scaling != "none":
            raise SpeculantError(f"GGUF file {self.path}: rotary scaling {scaling!r} is not supported (speculant "
                                 "runs none, linear and llama3's rope_freqs)")
        extra: dict = {}
        if arch in ("qwen3", "gemma3"):
            extra["qk_norm"] = True
        if arch == "gemma3":
            extra |= self._gemma3(arch, n_layers, dim, n_heads, head_dim)
        if arch == "smollm3":
            extra["nope_layers"] = tuple((i + 1) % _NOPE_STEP == 0 for i in range(n_layers))
        return ModelConfig(
            arch=arch,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", n_heads)),
            hidden_dim=int(need("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(need("context_length")),
            norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
            head_dim=head_dim,
            qkv_bias=f"blk.0.attn_q.bias" in self.tensors,
            tie_embeddings="output.weight" not in self.tensors,
            rope_freq_factors=freq_factors,
            **extra,
        )

    def _gemma3(self, arch: str, n_layers: int, dim: int, n_heads: int, head_dim: int) -> dict:
        """gemma3's switches as llama.cpp reads them from the file (src/models/gemma3.cpp)."""
        f = self.fields
        window = int(f.get(f"{arch}.attention.sliding_window", 0))
        local: tuple[bool, ...] = ()
        if window > 0:
            pattern = f.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN)
            if isinstance(pattern, (list, tuple)):
                local = tuple(bool(x) for x in pattern)
                if len(local) != n_layers:
                    raise SpeculantError(f"GGUF file {self.path}: {arch}.attention.sliding_window_pattern lists "
                                         f"{len(local)} layers, the model has {n_layers}")
            else:
                n = int(pattern)
                local = tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
        # llama.cpp's query scale: 1/sqrt(head_dim), but dim/n_heads for the 27B (62 layers), as Gemma's reference
        scalar = dim // n_heads if n_layers == 62 else head_dim
        softcap = float(f.get(f"{arch}.final_logit_softcapping", 0.0)) or None
        if f.get(f"{arch}.attn_logit_softcapping"):
            raise SpeculantError(f"GGUF file {self.path}: soft-capping of attention scores is not supported")
        return {"post_norms": True, "activation": "gelu_tanh", "embed_scale": float(np.float32(dim ** 0.5)),
                "attn_scale": float(np.float32(scalar ** -0.5)), "final_softcap": softcap,
                "local_layers": local if any(local) else (), "sliding_window": window if any(local) else None,
                "rope_local_base": float(f.get(f"{arch}.rope.freq_base_swa", _GEMMA_LOCAL_BASE))}

    def has(self, name: str) -> bool:
        return self._gguf_name(name) in self.tensors

    def get(self, name: str) -> Tensor:
        """Float32 tensor for a canonical name, in HF layout ([out, in] for projections)."""
        gname = self._gguf_name(name)
        if gname not in self.tensors:
            raise SpeculantError(f"GGUF file {self.path} has no tensor {gname}; the file is incomplete")
        w = torch.from_numpy(self._load(self.tensors[gname]))
        c = self.config
        if c.arch in _PERMUTED and name.rsplit(".", 1)[-1] in ("q", "k", "q_bias", "k_bias"):
            heads = c.n_heads if ".q" in name else c.n_kv_heads
            w = unpermute(w, heads)
        return w

    def part(self, name: str):
        """The raw blocks of a 2-D tensor by canonical name, memory-mapped: a formats.ggml_blocks.Part whose rows
        are the output features (llama q/k rows carry the permutation that `get` applies)."""
        from .formats.ggml_blocks import Part, check_type, row_bytes

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
        if c.arch in _PERMUTED and name.rsplit(".", 1)[-1] in ("q", "k"):
            heads = c.n_heads if name.endswith(".q") else c.n_kv_heads
            order = unpermute(torch.arange(rows), heads)  # new row i <- file row order[i]
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
        return dequantize(self.file, t)


def unpermute(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
