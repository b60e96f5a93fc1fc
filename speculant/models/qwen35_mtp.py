"""Qwen3.5's multi-token-prediction (MTP) layer, as published (`mtp.*`) and as llama.cpp runs it (`nextn`).

A row at position p takes the token t_p and the hidden state h_{p-1} of the position before it (the target's
final normed hidden state, the lm_head's input; zeros before the first token), and predicts t_{p+1}:

    x = fc([rms(embed(t_p), pre_fc_norm_embedding), rms(h_{p-1}, pre_fc_norm_hidden)])   (concat: embedding first)
    x = decoder layer (full attention with output gate, its own KV cache; rotary at p)
    h' = rms(x, mtp.norm);  logits = lm_head(h')                                         (shared embedding, head)

Chained drafting feeds h' (not a target state) with the token just drafted at p + 1. All norms are zero-centred.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache import KVCache
from .formats.base import QLinear
from .qwen35 import Qwen35Block, Qwen35Model
from .row_ops import rms_norm


class MTPLayer(nn.Module):
    def __init__(self, fc: QLinear, enorm: Tensor, hnorm: Tensor, block: Qwen35Block, norm: Tensor, eps: float) -> None:
        super().__init__()
        self.fc, self.block = fc, block
        self.enorm = nn.Parameter(enorm.float(), requires_grad=False)
        self.hnorm = nn.Parameter(hnorm.float(), requires_grad=False)
        self.norm = nn.Parameter(norm.float(), requires_grad=False)
        self.eps = eps

    def new_cache(self, model: Qwen35Model, max_len: int) -> KVCache:
        c = model.cfg
        return KVCache(1, c.n_kv_heads, c.head_dim, min(max_len, c.context_length), model.kv_dtype, model.device)

    @torch.inference_mode()
    def forward(self, model: Qwen35Model, tokens: Tensor, hidden: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """tokens [S] at cache slots cache.length.. (their positions), hidden [S, D] (each token's previous
        position's) -> (h' [S, D], logits [S, V])."""
        S = tokens.shape[0]
        start, end = cache.reserve(S)
        pos = torch.arange(start, end, device=tokens.device)
        e = rms_norm(model.embed(tokens).float(), self.enorm, self.eps)
        h = rms_norm(hidden.float().contiguous(), self.hnorm, self.eps)
        x = self.block(self.fc(torch.cat([e, h], -1)), cache, 0, start, model.cos[pos], model.sin[pos])
        cache.length = end
        out = rms_norm(x, self.norm, self.eps)
        return out, model.lm_head(out)
