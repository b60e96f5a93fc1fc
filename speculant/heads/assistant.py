"""Gemma 4's assistant drafter (HF `Gemma4AssistantForCausalLM`, transformers' models/gemma4_assistant), read
from its folder here or from llama.cpp's gemma4-assistant GGUF (heads/assistant_gguf.py, which says what differs).

The assistant is a small Gemma 4 decoder whose layers all share keys/values: they compute none and attend to the
target's, those of the target's last sliding-window layer and last global layer that write keys/values. A step
takes the target's embedding of a token (scaled as the target scales it) beside a hidden state of the
target's width (the target's final normed hidden state of the token before it, then the assistant's own
`post_projection` of its last output), projects the pair to its width (`pre_projection`), runs its layers at
one query position (the pending token's, for every step of a round) over the target's committed keys (all of
them in a global layer; the last window + 1 in a sliding one: transformers' bidirectional sliding mask, flipped),
and gives logits through its output layer; with `use_ordered_embeddings`, through the clustered output
layer: `centroids` score the clusters, the top `centroid_intermediate_top_k` clusters' tokens (by
`token_ordering`, vocab / num_centroids tokens each) get their dot products and every other token the lowest
of those minus 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import SpeculantError
from ..models.formats import make_linear
from ..models.gemma4 import Gemma4Block, Gemma4Model
from ..models.gemma4_config import Gemma4Config, gemma4_config
from ..models.load_hf import _open, _weight_files
from ..models.transformer import rms_norm

_LAYER = {"attn_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
          "ffn_norm": "pre_feedforward_layernorm.weight", "post_ffn_norm": "post_feedforward_layernorm.weight",
          "q_norm": "self_attn.q_norm.weight", "scalar": "layer_scalar", "q": "self_attn.q_proj.weight",
          "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
          "down": "mlp.down_proj.weight"}


_NORMS = ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q_norm", "scalar")


def is_assistant(folder: Path) -> bool:
    f = folder / "config.json"
    if not f.is_file():
        return False
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (raw.get("model_type") == "gemma4_assistant"
                                      or "Gemma4AssistantForCausalLM" in (raw.get("architectures") or []))


@dataclass(frozen=True)
class AssistantParts:
    """What an assistant file holds, read by heads/assistant.py (HF folder) or heads/assistant_gguf.py (llama.cpp's
    gemma4-assistant file): its layers' shape, how far back a sliding-window layer reads, and its tensors by
    canonical name (`layers.{i}.` + a _LAYER key, norm, head, pre, post, centroids) as float32 [out, in]."""

    g: Gemma4Config  # parsed as an unshared model: keys/values come from the target
    near: int  # the committed keys a sliding-window layer attends to (the newest ones)
    backbone: int  # the target width it was made for
    where: str  # for messages
    get: Callable[[str], Tensor]
    clusters: Tensor | None = None  # the clustered output layer's token ordering [clusters, tokens each]
    top_k: int = 0  # clusters searched


def folder_parts(folder: Path) -> AssistantParts:
    """The parts of an HF assistant folder (Gemma4AssistantForCausalLM)."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tc = dict(raw.get("text_config") or {})
    src = f"{folder}/config.json"
    if not tc:
        raise SpeculantError(f"{src}: a Gemma 4 assistant needs its text_config")
    window = int(tc.get("sliding_window", 512))
    if tc.get("use_bidirectional_attention") == "all":  # transformers' config halves it so
        window = window // 2 + 1
    # its layers as a Gemma 4 model's (keys/values from elsewhere: parsed as unshared, run as shared)
    g = gemma4_config(tc | {"num_kv_shared_layers": 0, "use_bidirectional_attention": None}, source=src)
    where: dict = {}
    for f in _weight_files(folder):
        where.update(_open(f))
    tied = "lm_head.weight" not in where or raw.get("tie_word_embeddings", True)
    names = {"norm": "model.norm.weight", "head": "model.embed_tokens.weight" if tied else "lm_head.weight",
             "pre": "pre_projection.weight", "post": "post_projection.weight",
             "centroids": "masked_embedding.centroids.weight"}

    def get(name: str) -> Tensor:
        key = names.get(name) or f"model.layers.{name.split('.')[1]}.{_LAYER[name.split('.')[2]]}"
        if key not in where:
            raise SpeculantError(f"{folder} lacks tensor {key}; the assistant folder is incomplete")
        return where[key].get_tensor(key).float()

    clusters, top_k = None, 0
    if raw.get("use_ordered_embeddings", False):
        top_k = int(raw.get("centroid_intermediate_top_k", 32))
        n, vocab = int(raw.get("num_centroids", 2048)), g.base.vocab_size
        key = "masked_embedding.token_ordering"
        order = where[key].get_tensor(key).long() if key in where else None
        if order is None or vocab % n or order.shape != (vocab,):
            raise SpeculantError(f"{src}: token_ordering must list the {vocab} tokens in {n} equal clusters")
        clusters = order.view(n, vocab // n)
    return AssistantParts(g, window + 1, int(raw.get("backbone_hidden_size", 1536)), src, get, clusters, top_k)


class Assistant(nn.Module):
    def __init__(self, source: Path | AssistantParts, target: Gemma4Model) -> None:
        super().__init__()
        if not isinstance(target, Gemma4Model):
            raise SpeculantError("the Gemma 4 assistant drafts for a Gemma 4 target (--model a Gemma 4 folder)")
        parts = source if isinstance(source, AssistantParts) else folder_parts(source)
        g, src, get = parts.g, parts.where, parts.get
        c, tg = g.base, target.g
        if parts.backbone != target.cfg.dim or c.vocab_size != target.cfg.vocab_size:
            raise SpeculantError(f"{src}: the assistant was made for a target of width {parts.backbone} "
                                 f"and {c.vocab_size} tokens; this target has {target.cfg.dim} and "
                                 f"{target.cfg.vocab_size}")
        # the target's layers whose keys/values the assistant reads: its last owner of each type
        owners = {loc: max(i for i in range(tg.n_layers) if tg.kv_source[i] == i and tg.base.is_local(i) == loc)
                  for loc in (True, False)}
        for i in range(c.n_layers):
            t = owners[c.is_local(i)]
            if (g.head_dims[i], c.n_heads % tg.kv_heads[t]) != (tg.head_dims[t], 0):
                raise SpeculantError(f"{src}: assistant layer {i} has heads of {g.head_dims[i]} values; the target's "
                                     f"layer {t} stores {tg.kv_heads[t]} key heads of {tg.head_dims[t]}")
        self.g, self.near, self.source = g, parts.near, [target.slots[owners[c.is_local(i)]] for i in range(c.n_layers)]

        def lin(*names: str):
            return make_linear(torch.cat([get(k) for k in names]), None, "float32")

        blocks = []
        for i in range(c.n_layers):
            p = f"layers.{i}."
            w = {n: get(p + n) for n in _NORMS}
            blk = Gemma4Block(g, i, w, lin(p + "q"), None, lin(p + "o"), lin(p + "gate", p + "up"), lin(p + "down"),
                              None, None)
            blk.n_kv = tg.kv_heads[owners[c.is_local(i)]]
            blocks.append(blk)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.Parameter(get("norm"), requires_grad=False)
        self.head = nn.Parameter(get("head"), requires_grad=False)  # [V, d]
        self.pre = lin("pre")
        self.post = lin("post")
        self.ordered = parts.clusters is not None
        if self.ordered:
            self.centroids = lin("centroids")
            self.top_k, self.clusters = parts.top_k, parts.clusters
        # the rotary of the one position a round queries, computed per step as rotary.tables computes a row (the
        # same float32 products) rather than tables as long as the target's context
        self.inv_freq = {loc: torch.tensor(g.inv_freq(loc), dtype=torch.float32) for loc in (True, False)}
        self.embed_scale = target.cfg.embed_scale

    def step(self, cache, committed: int, position: int, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step: target embedding x [1, D] (scaled) and hidden h [1, D] -> (logits [1, V], next h [1, D]).
        The query sits at `position`; it attends to the target's `committed` cache slots."""
        y = self.pre(torch.cat([x, h], -1))
        near = slice(max(0, committed - self.near), committed)
        rope = {}
        for local, inv in self.inv_freq.items():
            freqs = torch.outer(torch.tensor([float(position)]), inv)  # [1, hd/2]
            rope[local] = freqs.cos(), freqs.sin()
        for i, blk in enumerate(self.blocks):
            local = blk.window is not None
            y = blk(y, None, cache, self.source[i], committed - 1, *rope[local], None, True,
                    [near if local else slice(0, committed)])
        y = rms_norm(y, self.norm, self.g.base.norm_eps)
        return self.logits(y), self.post(y)

    def logits(self, y: Tensor) -> Tensor:
        if not self.ordered:
            return y @ self.head.T
        top = self.centroids(y).topk(self.top_k, -1).indices[0]  # [top_k]
        ids = self.clusters[top].reshape(-1)  # the chosen clusters' tokens
        sel = (y @ self.head[ids].T)[0]
        out = torch.full((1, self.head.shape[0]), float(sel.min()) - 1.0)
        out[0, ids] = sel
        return out
