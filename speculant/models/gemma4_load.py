"""A Gemma 4 dense text model from its Hugging Face folder (safetensors only), in a chosen weight format;
`build_gemma4` assembles it from any source by canonical names (a GGUF file's: models/gemma4_gguf.py).

Names are transformers' (`model.layers.{i}...` for Gemma4ForCausalLM, `model.language_model.layers.{i}...` for
the multimodal class, whose vision/audio towers are left unread). Every text tensor is checked against the
config before any is used, as load_hf.py does: a tensor the model has no place for is an error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from .formats import CALIBRATED, HEAD_FORMAT, make_linear
from .gemma4 import Gemma4Block, Gemma4Model
from .gemma4_config import Gemma4Config, gemma4_config, is_gemma4
from .load_hf import _open, _read_config, _weight_files
from .transformer import FloatEmbedding

_PREFIXES = ("model.language_model.", "model.")
_LAYER = {"attn_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
          "ffn_norm": "pre_feedforward_layernorm.weight", "post_ffn_norm": "post_feedforward_layernorm.weight",
          "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight", "scalar": "layer_scalar",
          "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
          "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
          "down": "mlp.down_proj.weight", "ple_gate": "per_layer_input_gate.weight",
          "ple_proj": "per_layer_projection.weight", "ple_norm": "post_per_layer_input_norm.weight"}
_GLOBAL = {"embed": "embed_tokens.weight", "norm": "norm.weight", "ple_embed": "embed_tokens_per_layer.weight",
           "ple_model_proj": "per_layer_model_projection.weight", "ple_proj_norm": "per_layer_projection_norm.weight"}


def is_gemma4_folder(path: Path) -> bool:
    f = path / "config.json"
    return path.is_dir() and f.is_file() and is_gemma4(_read_config(f))


def expected_shapes(g: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every text tensor the model reads."""
    c, P, L = g.base, g.ple_dim, g.n_layers
    out: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.dim), "norm": (c.dim,)}
    if not c.tie_embeddings:
        out["lm_head"] = (c.vocab_size, c.dim)
    if P:
        out |= {"ple_embed": (c.vocab_size, L * P), "ple_model_proj": (L * P, c.dim), "ple_proj_norm": (P,)}
    for i in range(L):
        hd, kv, F = g.head_dims[i], g.kv_heads[i], g.mlp_hidden[i]
        layer = {"attn_norm": (c.dim,), "post_attn_norm": (c.dim,), "ffn_norm": (c.dim,), "post_ffn_norm": (c.dim,),
                 "q_norm": (hd,), "scalar": (1,), "q": (c.n_heads * hd, c.dim), "o": (c.dim, c.n_heads * hd),
                 "gate": (F, c.dim), "up": (F, c.dim), "down": (c.dim, F)}
        if g.kv_source[i] == i:
            layer |= {"k_norm": (hd,), "k": (kv * hd, c.dim)}
            if not g.k_eq_v[i]:
                layer["v"] = (kv * hd, c.dim)
        if P:
            layer |= {"ple_gate": (P, c.dim), "ple_proj": (c.dim, P), "ple_norm": (c.dim,)}
        out |= {f"layers.{i}.{k}": s for k, s in layer.items()}
    return out


class Gemma4Source:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = gemma4_config(_read_config(path / "config.json"), source=str(path / "config.json"))
        where = {}
        for f in _weight_files(path):
            where.update(_open(f))
        prefix = next((p for p in _PREFIXES if p + "embed_tokens.weight" in where), None)
        if prefix is None:
            raise SpeculantError(f"{path} has no embed_tokens.weight under {' or '.join(_PREFIXES)}")
        self._where = where
        self._names = {}
        for name in expected_shapes(self.config):
            if name == "lm_head":
                self._names[name] = "lm_head.weight"
            elif name.startswith("layers."):
                _, i, part = name.split(".")
                self._names[name] = f"{prefix}layers.{i}.{_LAYER[part]}"
            else:
                self._names[name] = prefix + _GLOBAL[name]
        self._check(prefix)

    def _check(self, prefix: str) -> None:
        shapes = expected_shapes(self.config)
        known = {self._names[n]: s for n, s in shapes.items()}
        for key, handle in self._where.items():
            text = key.startswith(prefix) or key == "lm_head.weight"
            if not text or key == "lm_head.weight" and self.config.base.tie_embeddings:
                continue  # the multimodal class's towers; a tied head saved beside the embeddings
            if key not in known:
                raise SpeculantError(f"{self.path} has tensor {key}, which this Gemma 4 text model has no place for "
                                     "(ignoring it would change the model's output)")
            shape = tuple(handle.get_slice(key).get_shape())
            if shape != known[key]:
                raise SpeculantError(f"{self.path}: tensor {key} has shape {shape}, config.json implies "
                                     f"{known[key]}; config.json and the weights do not belong together")
        missing = [k for k in known if k not in self._where]
        if missing:
            raise SpeculantError(f"{self.path} lacks {len(missing)} tensor(s) config.json needs, e.g. {missing[0]}")

    def get(self, name: str) -> Tensor:
        key = self._names[name]
        return self._where[key].get_tensor(key).to(torch.float32)

    def ple_table(self) -> Tensor:
        """The per-layer embedding table in its stored type where that is bf16/f16 (it is the largest tensor)."""
        key = self._names["ple_embed"]
        t = self._where[key].get_tensor(key)
        return t if t.dtype in (torch.bfloat16, torch.float16) else t.to(torch.float32)


def load_gemma4(path: Path, fmt: str) -> Gemma4Model:
    """The model of a Gemma 4 HF folder with its linears in `fmt` (float32, bf16, f16 or a block format)."""
    if fmt in CALIBRATED or fmt == "gguf":
        raise SpeculantError(f"--dtype {fmt} is not available for Gemma 4 folders; choose float32, bf16, f16, q8_0, "
                             "q6_k, q5_1, q5_0, q4_k, q4_1 or q4_0")
    return build_gemma4(Gemma4Source(path), fmt)


def build_gemma4(src, fmt: str) -> Gemma4Model:
    """The model of `src` (a Gemma4Source, or a gemma4_gguf.Gemma4GGUFSource: config, get and ple_table by
    canonical tensor names), its linears in `fmt`; `gguf` keeps a GGUF source's own block types (its `linear` and
    `embedding`)."""
    g = src.config
    native = fmt == "gguf"

    def lin(*names: str):
        if native:
            return src.linear(names)
        w = torch.cat([src.get(n) for n in names])
        try:
            return make_linear(w, None, fmt)
        except SpeculantError:
            if not names[0].endswith("ple_proj"):
                raise
            # the per-layer projection's rows are P values (256 in the published models); a P that is not whole
            # blocks keeps this small matrix in float32, batch-invariant too (FloatLinear)
            return make_linear(w, None, "float32")

    blocks = []
    for i in range(g.n_layers):
        p = f"layers.{i}."
        w = {n: src.get(p + n) for n in ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q_norm", "scalar")}
        kv = None
        if g.kv_source[i] == i:
            w["k_norm"] = src.get(p + "k_norm")
            kv = lin(p + "k") if g.k_eq_v[i] else lin(p + "k", p + "v")
        ple_gate = ple_proj = None
        if g.ple_dim:
            w["ple_norm"] = src.get(p + "ple_norm")
            ple_gate, ple_proj = lin(p + "ple_gate"), lin(p + "ple_proj")
        blocks.append(Gemma4Block(g, i, w, lin(p + "q"), kv, lin(p + "o"), lin(p + "gate", p + "up"), lin(p + "down"),
                                  ple_gate, ple_proj))
    if native:
        embed = src.embedding()
        lm_head = src.linear(("embed" if g.base.tie_embeddings else "lm_head",))  # a tied head maps the same blocks
    else:
        table = src.get("embed")
        embed = FloatEmbedding(table)
        lm_head = make_linear(table if g.base.tie_embeddings else src.get("lm_head"), None, HEAD_FORMAT.get(fmt, fmt))
    ple = (src.ple_table(), lin("ple_model_proj"), src.get("ple_proj_norm")) if g.ple_dim \
        else (None, None, None)
    return Gemma4Model(g, embed, blocks, src.get("norm"), lm_head, *ple)
