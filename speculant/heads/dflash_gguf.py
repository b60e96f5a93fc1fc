"""DFlash drafters as llama.cpp's converter writes them (`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`,
general.architecture `dflash`), read back as z-lab's layout so that dflash.py checks and builds them like the folders.

| GGUF | z-lab (HF) |
|---|---|
| `dflash.block_size`, `dflash.target_layers` (HF hidden_states indices: layer id + 1), `tokenizer.ggml.mask_token_id` | `dflash_config`: block_size, target_layer_ids, mask_token_id |
| `dflash.logit_scale`, `dflash.final_logit_softcapping`, `dflash.embedding_scale` | output_multiplier, final_logit_softcapping, input_embedding_scale |
| `fc.weight`, `enc.output_norm.weight`, `output_norm.weight` | `fc.weight`, `hidden_norm.weight`, `norm.weight` |
| `blk.{i}.attn_{q,k,v,output}`, `attn_{q,k}_norm`, `attn_norm`, `ffn_norm`, `ffn_{gate,up,down}` | `layers.{i}.self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `input_layernorm`, `post_attention_layernorm`, `mlp.*_proj` |

Qwen3's rotary is rotate-half (NeoX) in both, so q/k rows are as they are. The DFlash-2 / DSpark extras
(convolutions, candidate selectors) and causal or sliding-window drafters are refused.

`file_blocks` gives the linears' weights as the file stores them (memory-mapped GGML blocks), so the drafter
multiplies llama.cpp's own blocks, as the target does its file's, instead of requantizing dequantized ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from ..gguf_file import GGUFFile
from ..models.formats.ggml import PACKED_TYPES, Part, row_bytes

ARCH = "dflash"
_TOP = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_IGNORED = ("token_embd.weight", "output.weight")  # the target's own are used (a converter copy is the same rows)


def _hf_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER and parts[3] in ("weight", "bias"):
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def read_dflash_gguf(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config.json as z-lab writes it, tensors by HF name) of a DFlash drafter GGUF."""
    f = GGUFFile(path)
    if f.fields.get("general.architecture") != ARCH:
        raise SpeculantError(f"{path}: not a DFlash drafter GGUF (architecture {f.fields.get('general.architecture')!r})")
    meta = {k.removeprefix(f"{ARCH}."): v for k, v in f.fields.items() if k.startswith(f"{ARCH}.")}
    need = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "target_layers",
            "block_size", "attention.layer_norm_rms_epsilon")
    missing = [f"{ARCH}.{k}" for k in need if k not in meta]
    if "tokenizer.ggml.mask_token_id" not in f.fields:
        missing.append("tokenizer.ggml.mask_token_id")
    if missing:
        raise SpeculantError(f"{path}: the DFlash drafter lacks metadata {missing}; convert it again with llama.cpp's "
                             "convert_hf_to_gguf.py --target-model-dir")
    if meta.get("attention.causal") or "attention.sliding_window" in meta:
        raise SpeculantError(f"{path}: causal or sliding-window DFlash layers are not supported")
    heads = int(meta["attention.head_count"])
    head_dim = int(meta.get("attention.key_length", int(meta["embedding_length"]) // heads))
    if int(meta.get("rope.dimension_count", head_dim)) != head_dim:
        raise SpeculantError(f"{path}: the drafter rotates {meta['rope.dimension_count']} of its {head_dim} head "
                             "dimensions; speculant's DFlash layer rotates all of them")
    tensors: dict[str, Tensor] = {}
    unknown = []
    for t in f.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            if t.name not in _IGNORED:
                unknown.append(t.name)
            continue
        tensors[hf] = torch.from_numpy(f.dequantize(t))
    if unknown:
        raise SpeculantError(f"{path}: tensors {unknown[:4]} are not part of the DFlash drafter speculant runs (Qwen3 "
                             "layers; DFlash-2 convolutions and selectors are not supported)")
    dflash = {"block_size": int(meta["block_size"]), "target_layer_ids": [int(i) - 1 for i in meta["target_layers"]],
              "mask_token_id": int(f.fields["tokenizer.ggml.mask_token_id"])}
    for key, name in (("logit_scale", "output_multiplier"), ("final_logit_softcapping", "final_logit_softcapping"),
                      ("embedding_scale", "input_embedding_scale")):
        if key in meta:
            dflash[name] = float(meta[key])
    config = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": int(meta["block_count"]),
              "hidden_size": int(meta["embedding_length"]), "intermediate_size": int(meta["feed_forward_length"]),
              "num_attention_heads": heads, "num_key_value_heads": int(meta.get("attention.head_count_kv", heads)),
              "head_dim": head_dim, "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
              "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
              "max_position_embeddings": int(meta.get("context_length", 4096)),
              "vocab_size": len(f.fields.get("tokenizer.ggml.tokens") or ()) or 1,
              "attention_bias": any(k.endswith(".bias") for k in tensors), "dflash_config": dflash}
    return config, tensors


def file_blocks(path: Path) -> dict[str, Part]:
    """HF name -> the file's own blocks of each 2-D weight stored in a GGML block type (PACKED_TYPES: what
    llama-quantize writes), memory-mapped; the float types (F32, F16, BF16) are left to the heads' format."""
    f = GGUFFile(path)
    out = {}
    for t in f.tensors:
        hf = _hf_name(t.name)
        if hf is None or len(t.shape) != 2 or t.tensor_type not in PACKED_TYPES:
            continue
        k, rows = t.shape
        rb = row_bytes(int(t.tensor_type), k)
        if rb * rows != t.n_bytes:
            raise SpeculantError(f"{path}: tensor {t.name} has {t.n_bytes} bytes, not {rows} rows of {k} "
                                 f"{t.tensor_type.name} values; the file is corrupt")
        out[hf] = Part(int(t.tensor_type), f.raw(t).reshape(rows, rb))
    return out
