"""Weights and config from a Hugging Face model folder (config.json + *.safetensors).

Only safetensors are read (never pickle), so nothing in a model folder can execute code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from .config import ModelConfig, RopeScaling

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}


class HFSource:
    """A model's config and float32 tensors by canonical name, from an HF safetensors folder."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SpeculantError(f"cannot read {path / 'config.json'}: {e}") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SpeculantError(f"{path} has no *.safetensors files (only safetensors weights are loaded, never pickle)")
        self._where: dict[str, tuple[Path, object]] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise SpeculantError(f"cannot read {f}: corrupt or truncated safetensors ({e})") from None
            for k in h.keys():
                self._where[k] = (f, h)
        self.config = self._config(raw)

    def fingerprint(self) -> str:
        parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(self.path.glob("*.safetensors"))]
        return f"hf:{self.path.resolve()}:" + ",".join(parts)

    def _config(self, c: dict) -> ModelConfig:
        archs = c.get("architectures") or []
        arch = _ARCH.get(archs[0] if archs else "", c.get("model_type", "?"))
        if arch not in ("llama", "qwen2"):
            raise SpeculantError(f"unsupported architecture {archs or c.get('model_type')} in {self.path}: "
                                 "speculant runs llama and qwen2 models")
        rs = c.get("rope_scaling") or None
        scaling = None
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                                      int(rs["original_max_position_embeddings"]))
            elif kind not in (None, "default"):
                raise SpeculantError(f"unsupported rope scaling {kind!r} in {self.path / 'config.json'}")
        n_heads = int(c["num_attention_heads"])
        return ModelConfig(
            arch=arch,
            n_layers=int(c["num_hidden_layers"]),
            dim=int(c["hidden_size"]),
            n_heads=n_heads,
            n_kv_heads=int(c.get("num_key_value_heads", n_heads)),
            hidden_dim=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            context_length=int(c.get("max_position_embeddings", 4096)),
            norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            rope_base=float(c.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            head_dim=int(c.get("head_dim") or c["hidden_size"] // n_heads),
            qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)) or "lm_head.weight" not in self._where,
        )

    def has(self, name: str) -> bool:
        return self._hf_name(name) in self._where

    def get(self, name: str) -> Tensor:
        key = self._hf_name(name)
        if key not in self._where:
            raise SpeculantError(f"{self.path} has no tensor {key}; the model folder is incomplete")
        return self._where[key][1].get_tensor(key).to(torch.float32)

    @staticmethod
    def _hf_name(name: str) -> str:
        if name == "embed":
            return "model.embed_tokens.weight"
        if name == "norm":
            return "model.norm.weight"
        if name == "lm_head":
            return "lm_head.weight"
        _, i, part = name.split(".")
        return f"model.layers.{i}.{_LAYER_NAMES[part]}"
