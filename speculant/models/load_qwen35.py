"""Qwen3.5 (models/qwen35.py) from an HF folder: `Qwen3_5ForCausalLM` (tensors `model.*`) or the text part of
`Qwen3_5ForConditionalGeneration` (`model.language_model.*`; the vision tower `model.visual.*` is not read).

The MTP layer (`mtp.*`) is kept aside for `--method mtp` (methods/mtp.py). Norm weights stored zero-centred get
their 1 added here, in float32 as transformers computes (1.0 + weight.float()); the DeltaNet's gated norm is a
plain weight. Linears take any weight format made from float weights (make_linear) except int8, whose calibration
runs the Llama block.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from .formats import HEAD_FORMAT, QLinear, make_linear
from .load_hf import _open, _read_config, _weight_files
from .qwen35 import DeltaNet, GatedAttention, Qwen35Block, Qwen35Model
from .qwen35_config import Qwen35Config, config_from_hf, is_qwen35_hf

_PREFIXES = ("model.language_model.", "model.")
# the norms stored zero-centred, by the name's last part before `.weight` (not the DeltaNet's gated `linear_attn.norm`)
_ZERO_CENTRED = frozenset({"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm",
                           "pre_fc_norm_embedding", "pre_fc_norm_hidden"})


def is_qwen35_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and is_qwen35_hf(_read_config(path / "config.json"))


def ships_mtp(path: Path) -> bool:
    """Whether `path` is a Qwen3.5 folder whose checkpoint carries its MTP layer (`mtp.fc.weight`), or a qwen35 GGUF
    file with its `nextn` layer: the model then drafts for itself (`--method mtp`, its default method)."""
    if path.is_file():
        from .qwen35_gguf import gguf_ships_mtp

        return gguf_ships_mtp(path)
    return is_qwen35_folder(path) and Qwen35Source(path).has("mtp.fc.weight")


class Qwen35Source:
    """Float32 tensors of a Qwen3.5 HF folder by their name below the text model (`layers.3.mlp.up_proj.weight`),
    or `mtp.*` by their full name."""

    native = False  # no blocks of its own: --dtype gguf is a GGUF file's
    v_tiled = False  # value heads grouped by key head, as transformers orders them

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config: Qwen35Config = config_from_hf(_read_config(path / "config.json"), str(path / "config.json"))
        self._where = {}
        for f in _weight_files(path):
            self._where |= _open(f)
        self.prefix = next((p for p in _PREFIXES if p + "embed_tokens.weight" in self._where), None)
        if self.prefix is None:
            raise SpeculantError(f"{path} has no model.embed_tokens.weight (or model.language_model.*); "
                                 "the model folder is incomplete")
        expected = set(_expected(self.config))
        for key in self._where:
            if key.startswith(("model.visual.", "mtp.")) or key == "lm_head.weight":
                continue
            if not key.startswith(self.prefix) or key[len(self.prefix):] not in expected:
                raise SpeculantError(f"{path} has tensor {key}, which a Qwen3.5 text model with num_hidden_layers "
                                     f"{self.config.n_layers} has no place for; this checkpoint is not supported")

    def has(self, name: str) -> bool:
        return self._key(name) in self._where

    def neg_a(self, prefix: str) -> Tensor:
        """The DeltaNet's -exp(A_log) [v_heads] under `prefix` (`layers.0.linear_attn.`), in float32 as transformers
        computes it."""
        return -self.get(prefix + "A_log").exp()

    def get(self, name: str) -> Tensor:
        key = self._key(name)
        if key not in self._where:
            raise SpeculantError(f"{self.path} has no tensor {key}; the model folder is incomplete")
        w = self._where[key].get_tensor(key).to(torch.float32)
        parts = name.split(".")
        zero_centred = len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _ZERO_CENTRED
        return w + 1.0 if zero_centred and "linear_attn" not in parts else w

    def _key(self, name: str) -> str:
        return name if name.startswith("mtp.") or name == "lm_head.weight" else self.prefix + name


def _expected(cfg: Qwen35Config) -> list[str]:
    names = ["embed_tokens.weight", "norm.weight"]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                                  "mlp.up_proj.weight", "mlp.down_proj.weight")]
        if cfg.is_linear(i):
            names += [p + "linear_attn." + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                                       "in_proj_a.weight", "conv1d.weight", "dt_bias", "A_log",
                                                       "norm.weight", "out_proj.weight")]
        else:
            names += [p + "self_attn." + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                                     "q_norm.weight", "k_norm.weight")]
    return names


def _linear(src, names: list[str], fmt: str) -> QLinear:
    """One linear over the rows of `names` (concatenated) in weight format `fmt`: a GGUF source's own blocks for
    `gguf`, else made from float weights."""
    if fmt == "gguf":
        return src.linear(names)
    return make_linear(torch.cat([src.get(n) for n in names]), None, fmt)


def layer(src, cfg: Qwen35Config, p: str, fmt: str, linear: bool) -> Qwen35Block:
    """One decoder layer from `src` (Qwen35Source, or qwen35_gguf's source, which takes the same names) under the
    name prefix `p` (`layers.3.`, or the MTP's `mtp.layers.0.`)."""
    def lin(*names: str) -> QLinear:
        return _linear(src, [p + n for n in names], fmt)

    if linear:
        a = "linear_attn."
        mixer = DeltaNet(cfg, lin(a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight",
                                  a + "in_proj_a.weight"), lin(a + "out_proj.weight"), src.get(p + a + "conv1d.weight"),
                         src.neg_a(p + a), src.get(p + a + "dt_bias"), src.get(p + a + "norm.weight"),
                         tiled=src.v_tiled)
    else:
        s = "self_attn."
        mixer = GatedAttention(cfg, lin(s + "q_proj.weight", s + "k_proj.weight", s + "v_proj.weight"),
                               lin(s + "o_proj.weight"), src.get(p + s + "q_norm.weight"), src.get(p + s + "k_norm.weight"))
    return Qwen35Block(cfg, mixer, src.get(p + "input_layernorm.weight"), src.get(p + "post_attention_layernorm.weight"),
                       lin("mlp.gate_proj.weight", "mlp.up_proj.weight"), lin("mlp.down_proj.weight"))


def build_qwen35(src, fmt: str) -> Qwen35Model:
    """The model in weight format `fmt`: float32 or a block format made from float weights, or (a GGUF source only)
    `gguf`, the file's own blocks."""
    if fmt == "int8" or (fmt == "gguf" and not src.native):
        what, own = ("GGUF file", "gguf (its own blocks), ") if src.native else ("HF folder", "")
        raise SpeculantError(f"--dtype {fmt} is not available for a Qwen3.5 {what}; choose {own}float32, bf16, f16 or "
                             "a GGML block format (q8_0, q4_k, ...)")
    cfg = src.config
    blocks = [layer(src, cfg, f"layers.{i}.", fmt, cfg.is_linear(i)) for i in range(cfg.n_layers)]
    if not cfg.tie_embeddings and not src.has("lm_head.weight"):
        raise SpeculantError(f"{src.path} lacks lm_head.weight and config.json does not tie the embeddings")
    tied = cfg.tie_embeddings
    if fmt == "gguf":
        embed = src.embedding()
        lm_head = embed.as_linear() if tied else src.linear(["lm_head.weight"])
    else:
        embed = src.get("embed_tokens.weight")
        lm_head = make_linear(embed if tied else src.get("lm_head.weight"), None, HEAD_FORMAT.get(fmt, fmt))
    model = Qwen35Model(cfg, embed, blocks, src.get("norm.weight"), lm_head)
    if src.has("mtp.fc.weight"):
        from .qwen35_mtp import MTPLayer

        if cfg.mtp_layers > 1:
            raise SpeculantError(f"{src.path}: {cfg.mtp_layers} MTP layers; speculant runs one (mtp_num_hidden_layers 1)")
        model.mtp = MTPLayer(_linear(src, ["mtp.fc.weight"], fmt), src.get("mtp.pre_fc_norm_embedding.weight"),
                             src.get("mtp.pre_fc_norm_hidden.weight"), layer(src, cfg, "mtp.layers.0.", fmt, False),
                             src.get("mtp.norm.weight"), cfg.norm_eps)
    return model


def load_qwen35(path: Path, fmt: str, device: torch.device, kv_dtype: torch.dtype, src=None) -> Qwen35Model:
    """The model of a Qwen3.5 HF folder, or of `src` (a qwen35_gguf source, read already), in weight format `fmt` on
    `device`, its caches in `kv_dtype`."""
    from .cache import check_kv_dtype

    model = build_qwen35(Qwen35Source(path) if src is None else src, fmt).to(device)
    check_kv_dtype(kv_dtype, model.cfg.head_dim)
    model.kv_dtype = kv_dtype
    return model
