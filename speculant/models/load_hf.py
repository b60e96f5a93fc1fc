"""Weights and config from a Hugging Face model folder (config.json + safetensors, one file or sharded).

Only safetensors are read (never pickle), so nothing in a model folder can execute code. A sharded
folder is read through `model.safetensors.index.json` (only the files it names, so stray files such as
Mistral's `consolidated.safetensors` or an adapter are never mixed in). Every tensor is checked up
front: a float dtype (float32, bfloat16, float16), a shape that matches the config, and a place in the
architecture's block; a tensor the block has no place for (an o_proj bias, a llama's q/k norms) is an error, because
dropping it would silently change the model's output.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import SpeculantError
from .config import ModelConfig
from .hf_config import config_from_hf

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
# The per-arch differences: Qwen3 and Gemma 3 norm each q/k head; Gemma 3 has norms after attention and the MLP,
# and its post_attention_layernorm is one of those (its pre-MLP norm is pre_feedforward_layernorm).
_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_ARCH_NAMES = {
    "qwen3": _QK_NORMS,
    "gemma3": _QK_NORMS | {"ffn_norm": "pre_feedforward_layernorm.weight",
                           "post_attn_norm": "post_attention_layernorm.weight",
                           "post_ffn_norm": "post_feedforward_layernorm.weight"},
}
# Gemma's RMSNorms multiply by (1 + weight): the weights are stored zero-centred.
_NORM_OFFSET_ARCHS = ("gemma3",)
_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_FLOAT = {"F32", "BF16", "F16"}
# Buffers some checkpoints carry that the model recomputes (old Llama conversions saved the rotary table).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_INDEX = "model.safetensors.index.json"


class HFSource:
    """A model's config and float32 tensors by canonical name, from an HF safetensors folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = _weight_files(path)
        self._where: dict[str, Any] = {}  # HF tensor name -> open safetensors handle
        for f in self.files:
            for key, handle in _open(f).items():
                if key in self._where:
                    raise SpeculantError(f"tensor {key} is in more than one file of {path}; keep one set of "
                                         f"weights (or add {_INDEX})")
                self._where[key] = handle
        raw = _read_config(path / "config.json")
        self.config = config_from_hf(raw, source=str(path / "config.json"), has_lm_head="lm_head.weight" in self._where)
        self._names = _LAYER_NAMES | _ARCH_NAMES.get(self.config.arch, {})
        self._shapes = _expected_shapes(self.config)
        self._check_tensors()

    def fingerprint(self) -> str:
        # The config is part of it: the conversion cache's quantized formats are calibrated through the
        # model, so an edited config.json (e.g. a corrected rotary base) must not reuse old conversions.
        parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in self.files]
        cfg = hashlib.sha256(repr(self.config).encode()).hexdigest()[:16]
        return f"hf:{self.path.resolve()}:{cfg}:" + ",".join(parts)

    def has(self, name: str) -> bool:
        return self._hf_name(name) in self._where

    def get(self, name: str) -> Tensor:
        key = self._hf_name(name)
        if key not in self._where:
            raise SpeculantError(f"{self.path} has no tensor {key}; the model folder is incomplete")
        w = self._where[key].get_tensor(key).to(torch.float32)
        if self.config.arch in _NORM_OFFSET_ARCHS and (name == "norm" or name.endswith("norm")):
            w = w + 1.0  # in float32, as transformers' Gemma3RMSNorm computes (1.0 + weight.float())
        return w

    def _check_tensors(self) -> None:
        """dtype, shape and purpose of every tensor, before any is read."""
        for key, handle in self._where.items():
            if _IGNORED.fullmatch(key) or (key == "lm_head.weight" and self.config.tie_embeddings):
                continue  # transformers ties the output layer to the embeddings then, whatever the file holds
            if key not in self._shapes:
                raise SpeculantError(
                    f"{self.path} has tensor {key}, which a {self.config.arch} model with num_hidden_layers "
                    f"{self.config.n_layers} has no place for (speculant runs the plain llama/qwen2 block); ignoring it would "
                    "change the model's output, so this checkpoint is not supported")
            info = handle.get_slice(key)
            dtype, shape = info.get_dtype(), tuple(info.get_shape())
            if dtype not in _FLOAT:
                raise SpeculantError(f"{self.path}: tensor {key} is stored as {dtype}; speculant reads float32, "
                                     "bfloat16 and float16 weights (quantized checkpoints are not loaded)")
            if shape != self._shapes[key]:
                c = self.config
                sizes = (f"hidden_size {c.dim}, intermediate_size {c.hidden_dim}, vocab_size {c.vocab_size}, "
                         f"num_attention_heads {c.n_heads}, num_key_value_heads {c.n_kv_heads}, head_dim {c.head_dim}")
                raise SpeculantError(f"{self.path}: tensor {key} has shape {shape} but config.json ({sizes}) implies "
                                     f"{self._shapes[key]}; config.json and the weights do not belong together")
        if self.config.tie_embeddings and "lm_head.weight" in self._where:
            # A "tied" file that also holds an lm_head: transformers 4 ties it to the embeddings, 5 keeps the
            # file's head when they differ. Equal tensors are unambiguous; different ones are refused.
            head, embed = (self._where[k].get_tensor(k).to(torch.float32)
                           for k in ("lm_head.weight", _GLOBAL_NAMES["embed"]))
            if not torch.equal(head, embed):
                raise SpeculantError(f"{self.path / 'config.json'} says tie_word_embeddings true, but the weights hold "
                                     "an lm_head.weight that differs from the embeddings; set tie_word_embeddings to "
                                     "false if the model has its own output layer")
        missing = [k for k in self._shapes if k not in self._where
                   and not (k == "lm_head.weight" and self.config.tie_embeddings)]
        if missing:
            raise SpeculantError(f"{self.path} lacks {len(missing)} tensor(s) that config.json (num_hidden_layers "
                                 f"{self.config.n_layers}, tie_word_embeddings {str(self.config.tie_embeddings).lower()}) "
                                 f"needs, e.g. {missing[0]}; the model folder is incomplete")

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        _, i, part = name.split(".")
        return f"model.layers.{i}.{self._names[part]}"


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor this config's model reads."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {"attn_norm": (cfg.dim,), "ffn_norm": (cfg.dim,), "q": (q, cfg.dim), "k": (kv, cfg.dim),
                 "v": (kv, cfg.dim), "o": (cfg.dim, q), "gate": (cfg.hidden_dim, cfg.dim),
                 "up": (cfg.hidden_dim, cfg.dim), "down": (cfg.dim, cfg.hidden_dim)}
    if cfg.qkv_bias:
        per_layer |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
    if cfg.qk_norm:
        per_layer |= {"q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    if cfg.post_norms:
        per_layer |= {"post_attn_norm": (cfg.dim,), "post_ffn_norm": (cfg.dim,)}
    names = _LAYER_NAMES | _ARCH_NAMES.get(cfg.arch, {})
    shapes = {_GLOBAL_NAMES["embed"]: (cfg.vocab_size, cfg.dim), _GLOBAL_NAMES["norm"]: (cfg.dim,),
              _GLOBAL_NAMES["lm_head"]: (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        shapes |= {f"model.layers.{i}.{names[p]}": s for p, s in per_layer.items()}
    return shapes


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold the model: those the shard index names, else model.safetensors,
    else every *.safetensors in the folder."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpeculantError(f"cannot read {index}: {e}; it needs a weight_map of tensor -> file") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SpeculantError(f"{path} lacks shard(s) {', '.join(missing)} named in {_INDEX}; "
                                 "download the whole model folder")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpeculantError(f"{path} has no *.safetensors files (only safetensors weights are loaded, never pickle)")
    return files


def _open(f: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(f), framework="pt")
    except Exception as e:  # safetensors raises its own error types for every kind of damage
        raise SpeculantError(f"cannot read {f}: corrupt or truncated safetensors ({e})") from None
    return {k: handle for k in handle.keys()}


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SpeculantError(f"cannot read {path}: {e}") from None
    except RecursionError:  # json nests one Python call per level
        raise SpeculantError(f"cannot read {path}: JSON nested too deeply; it is not a model config") from None
    if not isinstance(raw, dict):
        raise SpeculantError(f"{path} is not a JSON object; it is not a model config")
    return raw
