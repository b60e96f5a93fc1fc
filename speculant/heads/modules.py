"""The draft heads as torch modules: Medusa (Cai et al. 2024), EAGLE-2 (Li et al. 2024), EAGLE-3 (Li et al. 2025).

All heads speak in draft-vocabulary ids 0..draft_vocab-1; `d2t` [Vd] maps them to target ids (and
`t2d` [V], -1 outside the draft vocabulary, back). A reduced draft vocabulary (FR-Spec, EAGLE-3)
is what keeps the output layer, most of a head's bytes, small.

- `MedusaHeads`: K heads on the target's final normed hidden state h_t; head k is `medusa_layers`
  residual blocks x + SiLU(W x + b) and an output layer, and guesses the token k+2 places after t
  (the target itself gives the next one). Blocks start at zero, so head k starts as the target's own
  next-token guess.
- `EagleHead`: one decoder layer, autoregressive over features. EAGLE-2 (EAGLE-1's layout): the
  layer reads fc([embedding of the next token; feature]), its output is the next feature, read by the
  target's own output rows. EAGLE-3: fc fuses the low/mid/high taps into the first feature; the layer
  reads [norm(embedding); norm(feature)] (2D wide), keeps the feature as residual, and its output
  feeds its own norm and output layer; later steps feed the layer's output back as the feature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpeculantError
from .config import HeadConfig
from .layer import DraftLayer, linear, quantize_linears, rms


class _VocabMaps(nn.Module):
    def _init_maps(self, cfg: HeadConfig) -> None:
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab))  # [Vd] draft id -> target id
        self.register_buffer("t2d", torch.full((cfg.vocab,), -1, dtype=torch.long))  # [V] target id -> draft id
        self.t2d[: cfg.draft_vocab] = torch.arange(cfg.draft_vocab)

    def set_vocab(self, d2t: Tensor) -> None:
        """Use draft vocabulary `d2t` [Vd] (distinct target ids)."""
        d2t = d2t.long()
        if d2t.shape != self.d2t.shape:
            raise SpeculantError(f"the head's vocabulary map has {d2t.numel()} entries for {self.d2t.numel()} draft tokens")
        V = self.t2d.shape[0]
        if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= V):
            raise SpeculantError(f"the head's vocabulary map points outside the target's {V} token ids")
        if torch.unique(d2t).numel() != d2t.numel():
            raise SpeculantError("the head's vocabulary map repeats a target id")
        self.d2t.copy_(d2t)
        self.t2d.fill_(-1)
        self.t2d[d2t] = torch.arange(d2t.numel())


class MedusaHeads(_VocabMaps):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden
        self.blocks = nn.ModuleList(
            nn.ModuleList(linear(D, D, True, std=0.0) for _ in range(cfg.medusa_layers)) for _ in range(cfg.medusa_heads))
        n_out = 1 if cfg.shared_lm_head else cfg.medusa_heads
        self.lm_heads = nn.ModuleList(linear(D, cfg.draft_vocab, False) for _ in range(n_out))
        self._init_maps(cfg)

    def forward(self, h: Tensor) -> Tensor:
        """h [..., D] (the target's final normed hidden state) -> logits [K, ..., Vd]."""
        outs = []
        for blk in self.blocks:
            x = h
            for lin in blk:
                x = x + F.silu(lin(x))
            outs.append(x)
        x = torch.stack(outs)  # [K, ..., D]
        if len(self.lm_heads) == 1:
            return self.lm_heads[0](x)
        return torch.stack([lm(x[k]) for k, lm in enumerate(self.lm_heads)])


class EagleHead(_VocabMaps):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden
        self.eagle3 = cfg.method == "eagle3"
        self.fc = linear(cfg.feature_dim if self.eagle3 else 2 * D, D, cfg.fc_bias)
        self.layer = DraftLayer(cfg, 2 * D if self.eagle3 else D)
        if self.eagle3:
            self.input_norm = nn.Parameter(torch.ones(D))
            self.hidden_norm = nn.Parameter(torch.ones(D))
            self.norm = nn.Parameter(torch.ones(D))
            if cfg.feature_norm == "concat":
                self.feature_norm = nn.Parameter(torch.ones(cfg.feature_dim))
            elif cfg.feature_norm == "per_tap":
                self.feature_norm = nn.Parameter(torch.ones(len(cfg.taps), D))
        self.lm_head = linear(D, cfg.draft_vocab, False)
        if not cfg.own_lm_head:  # EAGLE-1/2: the target's output rows, frozen (attach_target_rows fills them)
            self.lm_head.weight.requires_grad_(False)
        self._init_maps(cfg)

    def first_feature(self, feats: Tensor) -> Tensor:
        """Target features [..., feature_dim] (taps concatenated) -> the layer's first feature [..., D]."""
        if not self.eagle3:
            return feats
        eps = self.cfg.norm_eps
        if self.cfg.feature_norm == "concat":
            feats = rms(feats, self.feature_norm, eps)
        elif self.cfg.feature_norm == "per_tap":
            feats = torch.cat([rms(f, w, eps) for f, w in zip(feats.chunk(len(self.cfg.taps), -1), self.feature_norm)], -1)
        return self.fc(feats)

    def next_feature(self, h: Tensor) -> Tensor:
        """The layer's output [..., D] -> the feature the next draft step reads (norm_output: normed)."""
        return rms(h, self.norm, self.cfg.norm_eps) if self.cfg.norm_output else h

    def layer_input(self, emb: Tensor, feature: Tensor) -> tuple[Tensor, Tensor]:
        """(embedding of the next token [..., D], feature [..., D]) -> (layer input, residual)."""
        if self.eagle3:
            normed = rms(feature, self.hidden_norm, self.cfg.norm_eps)
            residual = normed if self.cfg.norm_before_residual else feature
            return torch.cat([rms(emb, self.input_norm, self.cfg.norm_eps), normed], -1), residual
        x = self.fc(torch.cat([emb, feature], -1))
        return x, x

    def logits(self, h: Tensor) -> Tensor:
        """The layer's output [..., D] -> draft-vocabulary logits [..., Vd]."""
        return self.lm_head(rms(h, self.norm, self.cfg.norm_eps) if self.eagle3 else h)


def build_head(cfg: HeadConfig) -> MedusaHeads | EagleHead:
    return MedusaHeads(cfg) if cfg.method == "medusa" else EagleHead(cfg)


def target_rows(target, ids: Tensor) -> Tensor:
    """Rows `ids` of the target's output layer as float32 [n, D] (the target's own format dequantized)."""
    lm = target.lm_head
    if hasattr(lm, "dequantized"):
        w = lm.dequantized()
    elif hasattr(lm, "weight") and lm.weight.dtype == torch.float32:
        w = lm.weight.data
    else:  # other formats: read the rows through the layer itself (identity inputs)
        with torch.no_grad():
            w = lm(torch.eye(lm.in_features)).T
    return w.index_select(0, ids.to(w.device)).float().clone()


def init_from_target(head: MedusaHeads | EagleHead, target) -> None:
    """Start the head's output layers at the target's rows for its draft vocabulary (EAGLE-1/2: keep them)."""
    rows = target_rows(target, head.d2t)
    lms = head.lm_heads if isinstance(head, MedusaHeads) else [head.lm_head]
    with torch.no_grad():
        for lm in lms:
            lm.weight.copy_(rows)


def for_inference(head: MedusaHeads | EagleHead, fmt: str) -> MedusaHeads | EagleHead:
    """The head with its linear layers in block format `fmt` (drafting only; not trainable after)."""
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    if fmt != "float32":
        quantize_linears(head, fmt)
    return head
