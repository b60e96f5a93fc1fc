"""Gemma 4's assistant drafter from llama.cpp's `gemma4-assistant` GGUF file (convert_hf_to_gguf.py's
Gemma4AssistantModel), run as llama.cpp runs it (src/models/gemma4-assistant.cpp, common/speculative.cpp's MTP
drafter with the target's memory shared).

What differs from the HF folder (heads/assistant.py), read as llama.cpp reads the file:
- the converter drops the clustered output layer (`masked_embedding.*`): logits come from the whole output layer
  (the assistant's own token_embd), as llama.cpp computes them;
- a sliding-window layer's query at the pending position p attends to the target's keys at positions above
  p - sliding_window (llama.cpp's standard window: sliding_window - 1 committed keys), not transformers' window + 1;
- the projections are `nextn.pre_projection` / `nextn.post_projection`, the target width `embedding_length_out`;
- the keys/values are those of the target's last two layers (llama-model.cpp: n_layer - 2 for sliding layers,
  n_layer - 1 for global ones), which must be a sliding-window then a global layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from ..gguf_file import GGUFFile
from ..models.gemma4 import Gemma4Model
from ..models.gemma4_gguf import gemma4_gguf_config, gguf_name
from .assistant import Assistant, AssistantParts

ARCH = "gemma4-assistant"
_LAYER_PARTS = ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q_norm", "scalar", "q", "o", "gate", "up",
                "down")
_NAMES = {"norm": "output_norm.weight", "head": "token_embd.weight", "pre": "nextn.pre_projection.weight",
          "post": "nextn.post_projection.weight"}
_IGNORED = ("rope_freqs.weight", "masked_embd_centroids.weight", "masked_embd_ordering")  # read or unused by llama.cpp


def gguf_parts(path: Path) -> AssistantParts:
    """The parts of a gemma4-assistant GGUF file; every tensor is checked against the metadata first."""
    f = GGUFFile(path)
    fields, tensors = f.fields, f.by_name
    where = str(path)
    if fields.get("general.architecture") != ARCH:
        raise SpeculantError(f"{path} is not a Gemma 4 assistant GGUF (architecture {ARCH!r})")
    freqs = tensors.get("rope_freqs.weight")
    # parsed as an unshared model (every layer reads the target's keys/values), as heads/assistant.py does
    unshared = fields | {f"{ARCH}.attention.shared_kv_layers": 0}
    try:
        g = gemma4_gguf_config(unshared, tensors, None if freqs is None else f.dequantize(freqs), where, ARCH)
        backbone = int(fields.get(f"{ARCH}.embedding_length_out", 0))
    except (TypeError, ValueError, OverflowError) as e:
        raise SpeculantError(f"GGUF file {path} has malformed {ARCH} metadata ({e})") from None
    c = g.base
    if backbone < 1 or backbone == c.dim:
        raise SpeculantError(f"GGUF file {path}: {ARCH}.embedding_length_out must give the target's width")
    shapes = {"norm": (c.dim,), "head": (c.vocab_size, c.dim), "pre": (c.dim, 2 * backbone), "post": (backbone, c.dim)}
    names = {_NAMES[k]: k for k in shapes}
    for i in range(c.n_layers):
        hd, ff = g.head_dims[i], g.mlp_hidden[i]
        layer = {"attn_norm": (c.dim,), "post_attn_norm": (c.dim,), "ffn_norm": (c.dim,), "post_ffn_norm": (c.dim,),
                 "q_norm": (hd,), "scalar": (1,), "q": (c.n_heads * hd, c.dim), "o": (c.dim, c.n_heads * hd),
                 "gate": (ff, c.dim), "up": (ff, c.dim), "down": (c.dim, ff)}
        for k, s in layer.items():
            shapes[f"layers.{i}.{k}"] = s
            names[gguf_name(f"layers.{i}.{k}")] = f"layers.{i}.{k}"
    for name, t in tensors.items():
        if name in _IGNORED:
            continue
        if name not in names:
            raise SpeculantError(f"GGUF file {path} has tensor {name}, which a Gemma 4 assistant has no place for")
        shape = tuple(int(x) for x in reversed(t.shape))
        if shape != shapes[names[name]]:
            raise SpeculantError(f"GGUF file {path}: tensor {name} has shape {shape}, its metadata implies "
                                 f"{shapes[names[name]]}; the file is inconsistent")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise SpeculantError(f"GGUF file {path} lacks {len(missing)} tensor(s) a Gemma 4 assistant needs, e.g. "
                             f"{missing[0]}; the file is incomplete")
    canonical = {v: k for k, v in names.items()}

    def get(name: str) -> Tensor:
        return torch.from_numpy(f.dequantize(tensors[canonical[name]]))

    # llama.cpp's window: keys p with p_query - p < sliding_window; the query's own row is not in the target's cache
    return AssistantParts(g, max(0, c.sliding_window - 1), backbone, where, get)


def load_gguf_assistant(path: Path, target: Gemma4Model) -> Assistant:
    """The assistant of a gemma4-assistant GGUF for a loaded Gemma 4 target."""
    if isinstance(target, Gemma4Model):
        tg = target.g
        n = tg.n_layers
        if n < 2 or not tg.base.is_local(n - 2) or tg.base.is_local(n - 1):
            raise SpeculantError(f"{path}: llama.cpp's assistant reads the target's last two layers as a "
                                 "sliding-window then a global layer; this target's are not")
    return Assistant(gguf_parts(path), target)
