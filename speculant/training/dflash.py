"""DFlash block drafters trained on the target's features (`train-heads --method dflash`).

The drafter learns what it does while drafting (heads/dflash.py, methods/dflash.py). At an anchor position P of the
training text, the block [x_P, MASK x (b-1)] at positions P..P+b-1 attends to the context rows 0..P-1 (the target's
features at the drafter's layers through fc and hidden_norm: the rows a round's cache holds; the anchor's own row is
not among them, the target has not run on the pending token yet) and to all of its own rows, non-causally. Row j
(1..b-1) guesses the target's choice at position P+j: its top-TOP distribution after x_0..x_{P+j-1} (features.py),
the text's tokens standing in for the drafts before it, as in a chain whose earlier drafts were all accepted.

The softmax runs over the rows of the `vocab` most frequent target choices (train-heads' --draft-vocab, as EAGLE's
heads): its cost grows with the rows, and with 8,192 of them a CPU step is several times cheaper on a 49,152-token
vocabulary than over all rows. The draft rows then learn to beat those tokens only; drafting still scores every row
(the target's output layer is the drafter's), and --draft-vocab at the vocabulary's size is DFlash's full softmax.

Many anchors train in one pass (DFlash's recipe): every block's rows are queries over [context; all blocks] under a
mask that lets each see its own context prefix and its own block only. The embedding and the output layer are the
target's, frozen. Row j's loss weighs exp(-(j-1)/gamma), DFlash's decay: a later draft counts only when every earlier
one was accepted, so its errors cost less.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..heads.dflash import ARCH, DFlashModel, dflash_config
from ..heads.layer import INIT_STD, rms
from ..heads.modules import target_rows
from ..models.rotary import tables
from .features import Features
from .objectives import soft_ce

FEATURE_LAYERS = 3  # target layers the drafter reads: a low, a middle and a high one, as EAGLE-3's
EVAL_SEED = 12345  # held-out anchors: the same at every evaluation, so the scores compare


def layer_ids(n_layers: int, k: int = FEATURE_LAYERS) -> list[int]:
    """z-lab's spread of k target layers (dflash's build_target_layer_ids) from layer 1 to layer n-3: never the
    last, whose output llama.cpp's DFlash graph cannot read (tests/test_dflash_gguf.py)."""
    if n_layers < 4:  # too shallow for the spread: the layers below the last
        return list(range(max(n_layers - 1, 1)))[:k]
    start, end = 1, n_layers - 3
    return sorted({round(start + i * (end - start) / max(k - 1, 1)) for i in range(k)})


def drafter_config(target_cfg, block: int, layers: int, intermediate: int | None) -> dict:
    """The config.json (z-lab's layout) of a new drafter for `target_cfg` (a models.ModelConfig): Qwen3 layers of
    the target's width and attention shape, its rotary base, the last token id as the mask (an embedding row that
    is only ever a mask here)."""
    ids = layer_ids(target_cfg.n_layers)
    return {"architectures": [ARCH], "model_type": "qwen3", "hidden_size": target_cfg.dim,
            "intermediate_size": intermediate or target_cfg.hidden_dim, "num_hidden_layers": layers,
            "num_attention_heads": target_cfg.n_heads, "num_key_value_heads": target_cfg.n_kv_heads,
            "head_dim": target_cfg.head_dim, "rms_norm_eps": target_cfg.norm_eps, "rope_theta": target_cfg.rope_base,
            "max_position_embeddings": target_cfg.context_length, "vocab_size": target_cfg.vocab_size,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
            "num_target_layers": target_cfg.n_layers, "block_size": block,
            "dflash_config": {"block_size": block, "target_layer_ids": ids, "mask_token_id": target_cfg.vocab_size - 1}}


def new_drafter(raw: dict, target_cfg, seed: int) -> DFlashModel:
    """A trainable DFlashModel of config `raw`, read by the loader's own parser (so what training builds is what
    --drafter loads); its matrices drawn from N(0, INIT_STD) by a generator seeded with `seed`, norms at 1."""
    D, n = target_cfg.dim, len(raw["dflash_config"]["target_layer_ids"])
    cfg = dflash_config(raw, {"fc.weight": torch.empty(D, n * D)}, target_cfg, Path("train-heads"))
    model = DFlashModel(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, INIT_STD, generator=g)
    return model


class DFlashObjective:
    """The loss and held-out scores of a DFlash drafter on feature batches (features.py) of `target` (a Transformer):
    `anchors` blocks per sequence, drawn anew each training step from a generator seeded with `seed`; the softmax
    over the target's output rows of `vocab` (sorted target ids)."""

    def __init__(self, model: DFlashModel, target, anchors: int, seed: int, vocab: Tensor) -> None:
        self.model, self.target, self.anchors = model, target, anchors
        self.rows = target_rows(target, vocab)  # frozen [n, D]
        self.d2t = vocab
        self.t2d = torch.full((target.cfg.vocab_size,), -1, dtype=torch.long)  # soft_ce's map: -1 outside `vocab`
        self.t2d[vocab] = torch.arange(vocab.shape[0])
        self.g = torch.Generator().manual_seed(seed)
        b = model.cfg.block_size
        # DFlash's decay: gamma 7 for blocks of 16, 5 for 10, 4 for 8; (b-1)/2 is near each
        self.weights = torch.tensor([math.exp(-j / max((b - 1) / 2, 1.0)) for j in range(b - 1)])
        self._rot: tuple[Tensor, Tensor] | None = None

    def _rotary(self, n: int) -> tuple[Tensor, Tensor]:
        if self._rot is None or self._rot[0].shape[0] < n:
            self._rot = tables(self.model.cfg.rope_inv_freq, n)
        return self._rot

    def _anchors(self, T: int, train: bool) -> Tensor:
        """Sorted anchor positions in 1..T-b+1: each has a context row before it and its b-1 labels in the text."""
        b = self.model.cfg.block_size
        g = self.g if train else torch.Generator().manual_seed(EVAL_SEED)
        n = T - b + 1
        return (torch.randperm(n, generator=g)[: min(self.anchors, n)] + 1).sort().values

    def __call__(self, f: Features, idx: Tensor) -> tuple[Tensor, dict]:
        """-> (loss, {"acc": [b-1] top-1 hit rate of each draft row, "chain": mean drafts a block gets accepted})."""
        model, cfg = self.model, self.model.cfg
        tokens, feats = f.tokens[idx], f.feats[idx].float()  # [B, T], [B, T, n*D]
        B, T = tokens.shape
        b = cfg.block_size
        P = self._anchors(T, model.training)
        A = P.shape[0]
        pos = (P[:, None] + torch.arange(b)).flatten()  # [A*b] the blocks' positions
        cos, sin = self._rotary(T + b)
        block = torch.full((B, A, b), cfg.mask_token_id)
        block[:, :, 0] = tokens[:, P]
        with torch.no_grad():
            h = self.target.embed(block.flatten()).float().view(B, A * b, -1) * cfg.embed_scale
        # each block's rows see the context before their anchor and their own block, nothing else
        seen = torch.cat([torch.arange(T)[None] < P.repeat_interleave(b)[:, None],
                          torch.arange(A).repeat_interleave(b)[:, None] == torch.arange(A).repeat_interleave(b)[None]], 1)
        c = rms(model.fc(feats), model.hidden_norm, cfg.norm_eps)  # [B, T, D]
        for layer in model.layers:
            q, k, v = layer.project(h, cos[pos], sin[pos])
            kc, vc = layer.kv(c, cos[:T], sin[:T])
            out = F.scaled_dot_product_attention(q, torch.cat([kc, k], -2), torch.cat([vc, v], -2), attn_mask=seen,
                                                 enable_gqa=True)
            h = layer.finish(h, out)
        h = rms(h, model.norm, cfg.norm_eps).view(B, A, b, -1)[:, :, 1:]  # the draft rows
        logits = (h @ self.rows.T.to(h.dtype)) * cfg.logit_scale  # [B, A, b-1, V]
        lab = P[:, None] + torch.arange(b - 1)  # row j+1's label: the target's choice after position P+j
        ids, p = f.top_ids[idx][:, lab], f.top_p[idx][:, lab]  # [B, A, b-1, TOP]
        loss = sum(w * soft_ce(logits[:, :, j], ids[:, :, j], p[:, :, j], self.t2d)
                   for j, w in enumerate(self.weights.tolist())) / self.weights.sum()
        with torch.no_grad():
            ok = self.d2t[logits.argmax(-1)] == ids[..., 0]  # [B, A, b-1]
            acc = ok.float().mean((0, 1))
            chain = ok.int().cumprod(-1).sum(-1).float().mean()  # the drafts a greedy round keeps
        return loss, {"acc": acc, "chain": chain}
