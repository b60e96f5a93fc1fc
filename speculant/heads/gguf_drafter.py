"""EAGLE-3 drafters as llama.cpp's converter writes them (`convert_hf_to_gguf.py DRAFTER --target-model-dir
TARGET`, general.architecture `eagle3`), read as the EAGLE repo's layout so that published.py checks and
builds them like the HF folders.

| GGUF | HF (EAGLE repo) |
|---|---|
| `eagle3.target_layers` (EAGLE-3 ids: the input of target layer i), `eagle3.target_hidden_size`, `eagle3.norm_before_residual`, `eagle3.norm_before_fc` | `eagle_aux_hidden_state_layer_ids`, `target_hidden_size`, `norm_before_residual`, `norm_before_fc` |
| `fc.weight`, `output.weight`, `output_norm.weight`, `enc_output_norm.weight` | `fc.weight`, `lm_head.weight`, `norm.weight`, `input_norm.weight` (norm_before_fc) |
| `blk.0.attn_norm`, `blk.0.attn_norm_2`, `blk.0.ffn_norm` | `midlayer.input_layernorm`, `midlayer.hidden_norm`, `midlayer.post_attention_layernorm` |
| `blk.0.attn_{q,k,v,output}`, `blk.0.ffn_{gate,up,down}` | `midlayer.self_attn.{q,k,v,o}_proj`, `midlayer.mlp.*_proj` (q/k rows permuted for llama.cpp's rotary: undone) |
| `d2t` (I64, absolute target ids) | `d2t` (offsets from the draft id) |
| `rope_freqs.weight` (Llama 3 scaling: a divisor per frequency) | `rope_scaling` |

`token_embd.weight`, where the converter copied the drafter's `embed_tokens`, is ignored as in the HF
layouts (the drafter reads the target's own embedding; llama.cpp uses the file's copy if it has one).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import Tensor

from ..errors import SpeculantError
from ..gguf_file import GGUFFile
from ..models.load_gguf import unpermute
from .config import HeadConfig

_ARCH = "eagle3"
_NAMES = {"fc.weight": "fc.weight", "output.weight": "lm_head.weight", "output_norm.weight": "norm.weight",
          "enc_output_norm.weight": "input_norm.weight", "blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
          "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
          "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
          **{f"blk.0.attn_{g}.weight": f"midlayer.self_attn.{h}_proj.weight"
             for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
          **{f"blk.0.ffn_{n}.weight": f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}}
_IGNORED = ("token_embd.weight", "rope_freqs.weight", "d2t")


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def gguf_method(path: Path) -> str:
    """`eagle3`, `dflash` or `assistant` (gemma4-assistant) for a drafter GGUF (llama.cpp's converter's
    architectures), else a clear error (the metadata is read, not the weights)."""
    arch = GGUFFile(path).fields.get("general.architecture")
    if arch == "gemma4-assistant":  # Gemma 4's assistant (heads/assistant_gguf.py)
        return "assistant"
    if arch not in (_ARCH, "dflash"):
        raise SpeculantError(f"{path}: a GGUF file of architecture {arch!r}; a drafter GGUF is an EAGLE-3 or DFlash "
                             "drafter converted by llama.cpp (architecture 'eagle3' or 'dflash'). A whole model drafts "
                             "with --draft MODEL")
    return arch


def read_gguf_drafter(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config, tensors) of an EAGLE-3 drafter GGUF in the EAGLE repo's layout (see the table above)."""
    if gguf_method(path) != _ARCH:
        raise SpeculantError(f"{path}: a DFlash drafter; run it with --method dflash")
    f = GGUFFile(path)
    meta = {k.removeprefix(f"{_ARCH}."): v for k, v in f.fields.items() if k.startswith(f"{_ARCH}.")}
    need = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "target_layers",
            "attention.layer_norm_rms_epsilon")
    missing = [f"{_ARCH}.{k}" for k in need if k not in meta]
    if missing:
        raise SpeculantError(f"{path}: the EAGLE-3 drafter lacks metadata {missing}; convert it again with llama.cpp's "
                             "convert_hf_to_gguf.py --target-model-dir")
    heads = int(meta["attention.head_count"])
    kv_heads = int(meta.get("attention.head_count_kv", heads))
    head_dim = int(meta.get("attention.key_length", int(meta["embedding_length"]) // heads))
    if int(meta.get("rope.dimension_count", head_dim)) != head_dim:
        raise SpeculantError(f"{path}: the drafter rotates {meta['rope.dimension_count']} of its {head_dim} head "
                             "dimensions; speculant's draft layer rotates all of them")
    unknown = [t.name for t in f.tensors if t.name not in _NAMES and t.name not in _IGNORED]
    if unknown:
        raise SpeculantError(f"{path}: tensors {unknown[:4]} are not part of the EAGLE-3 drafter speculant runs (one "
                             "Llama layer without biases, as llama.cpp's eagle3 graph has it)")
    tensors: dict[str, Tensor] = {}
    for name, hf in _NAMES.items():
        t = f.by_name.get(name)
        if t is not None:
            w = torch.from_numpy(f.dequantize(t))
            if name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
                w = unpermute(w, heads if ".attn_q." in name else kv_heads)
            tensors[hf] = w
    if "lm_head.weight" not in tensors:
        raise SpeculantError(f"{path}: the drafter has no output.weight (llama.cpp then borrows the target's output "
                             "layer); speculant runs EAGLE-3 drafters with their own lm_head")
    d2t = f.by_name.get("d2t")
    if d2t is not None:
        if d2t.tensor_type != GGMLQuantizationType.I64:
            raise SpeculantError(f"{path}: d2t has type {d2t.tensor_type.name}; llama.cpp writes it as I64 target ids")
        ids = torch.from_numpy(np.frombuffer(f.raw(d2t), dtype="<i8").copy())
        tensors["d2t"] = ids - torch.arange(ids.numel())  # the HF layouts' offsets
    config = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": int(meta["block_count"]),
              "hidden_size": int(meta["embedding_length"]), "intermediate_size": int(meta["feed_forward_length"]),
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
              "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
              "max_position_embeddings": int(meta.get("context_length", 4096)),
              "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
              "eagle_aux_hidden_state_layer_ids": [int(i) for i in meta["target_layers"]],
              "norm_before_residual": bool(meta.get("norm_before_residual", False)),
              "norm_before_fc": bool(meta.get("norm_before_fc", False))}
    for key in ("vocab_size", "target_hidden_size"):
        if key in meta:
            config[key] = int(meta[key])
    if "rope_freqs.weight" in f.by_name:
        tensors["rope_freqs"] = torch.from_numpy(f.dequantize(f.by_name["rope_freqs.weight"])).reshape(-1)
    return config, tensors


def with_rope_freqs(cfg: HeadConfig, tensors: dict[str, Tensor], path: Path) -> HeadConfig:
    """`cfg` with llama.cpp's per-frequency divisors (`rope_freqs`: its form of Llama 3 rope scaling) applied."""
    factors = tensors.get("rope_freqs")
    if factors is None:
        return cfg
    if factors.numel() != len(cfg.rope_inv_freq):
        raise SpeculantError(f"{path}: rope_freqs has {factors.numel()} factors; head_dim {cfg.head_dim} needs "
                             f"{len(cfg.rope_inv_freq)}")
    return replace(cfg, rope_inv_freq=tuple(float(b / s) for b, s in zip(cfg.rope_inv_freq, factors.tolist())))
