"""What the heads are trained to do, and how well they do it (losses and held-out acceptance).

Labels are the target's own next-token distributions (top-TOP probabilities, features.py) at each
position; a head is scored on what decides acceptance: whether its top guess is the target's.

Medusa head k at position i guesses the target's choice at position i+k+1. EAGLE heads unroll
`steps` draft steps ("training-time test", EAGLE-3): step j at position i reads the embedding of
token x_{i+j+1} and the feature from step j-1 (step 0: the target's), sits at rotary position i+j,
attends to the step-0 entries at positions <= i and to its own chain's entries of steps 1..j (which
is exactly what it sees while drafting), and guesses the target's choice at position i+j+1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..heads.modules import EagleHead, MedusaHeads

STEP_DECAY = 0.8  # weight of each later head / unrolled step (Medusa's and EAGLE-3's choice)
RANKS = 10  # Medusa: how often the target's token is the head's rank-r guess, r < RANKS (for the static tree)


def soft_ce(logits: Tensor, top_ids: Tensor, top_p: Tensor, t2d: Tensor) -> Tensor:
    """Cross-entropy of draft logits [..., Vd] against the target's top probabilities [..., TOP]
    (target ids; those outside the draft vocabulary are dropped, the rest renormalized)."""
    d = t2d[top_ids]  # [..., TOP], -1 outside
    w = top_p * (d >= 0)
    logp = F.log_softmax(logits.float(), -1).gather(-1, d.clamp_min(0))
    mass = w.sum(-1)
    keep = mass > 0
    return (-(w * logp).sum(-1)[keep] / mass[keep]).mean() if keep.any() else logits.sum() * 0


def hits(logits: Tensor, top_ids: Tensor, d2t: Tensor) -> Tensor:
    """[...] bool: the draft's top guess is the target's top token."""
    return d2t[logits.argmax(-1)] == top_ids[..., 0]


def medusa_loss(head: MedusaHeads, feats: Tensor, top_ids: Tensor, top_p: Tensor) -> tuple[Tensor, dict]:
    """feats [B, T, D] -> (loss, {"acc": [K] top-1 hit rates, "ranks": [K, RANKS] rank-r hit rates})."""
    logits = head(feats.float())  # [K, B, T, Vd]
    T = feats.shape[1]
    loss = feats.new_zeros((), dtype=torch.float32)
    acc, ranks = [], []
    for k in range(logits.shape[0]):
        lg, ids, p = logits[k][:, : T - k - 1], top_ids[:, k + 1:], top_p[:, k + 1:]
        loss = loss + STEP_DECAY ** k * soft_ce(lg, ids, p, head.t2d)
        with torch.no_grad():
            guess = head.d2t[lg.topk(RANKS, -1).indices]  # [B, T', RANKS]
            r = (guess == ids[..., :1]).float().flatten(0, -2).mean(0)  # [RANKS]
            ranks.append(r)
            acc.append(r[0])
    return loss, {"acc": torch.stack(acc), "ranks": torch.stack(ranks)}


def eagle_unroll(head: EagleHead, emb_next: Tensor, feats: Tensor, steps: int, cos: Tensor, sin: Tensor) -> list[Tensor]:
    """emb_next [B, T, D] (row i: embedding of token i+1), feats [B, T, Df] -> `steps` outputs [B, T, D]."""
    B, T, _ = emb_next.shape
    hidden = head.first_feature(feats)
    causal = torch.ones(T, T, dtype=torch.bool).tril_()
    diag = torch.eye(T, dtype=torch.bool)
    keys, values, outs = [], [], []
    for j in range(steps):
        e = emb_next if j == 0 else torch.cat([emb_next[:, j:], emb_next[:, -1:].expand(B, j, -1)], 1)
        x, residual = head.layer_input(e, hidden)
        q, k, v = head.layer.project(x, cos[j: j + T], sin[j: j + T])  # rows at positions i + j
        keys.append(k)
        values.append(v)
        mask = torch.cat([causal] + [diag] * j, 1)  # [T, (j+1) T]
        a = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                           enable_gqa=True)
        hidden = head.layer.finish(a, residual)
        outs.append(hidden)
    return outs


def eagle_loss(head: EagleHead, emb_next: Tensor, feats: Tensor, top_ids: Tensor, top_p: Tensor, steps: int,
               cos: Tensor, sin: Tensor, regress: Tensor | None = None) -> tuple[Tensor, dict]:
    """-> (loss, {"acc": [steps] top-1 hit rates, "chain": mean drafts a `steps`-chain gets accepted}).

    `regress` [B, T, D] (EAGLE-2): the target's features, which step j's output also regresses onto
    (EAGLE-1's smooth-L1 feature loss; the token loss then weighs 0.1 as there)."""
    T = feats.shape[1]
    outs = eagle_unroll(head, emb_next, feats.float(), steps, cos, sin)
    loss = feats.new_zeros((), dtype=torch.float32)
    acc, chain, run = [], feats.new_zeros(()), None
    for j, h in enumerate(outs):
        n = T - j - 1
        lg = head.logits(h[:, :n])
        ce = soft_ce(lg, top_ids[:, j + 1:], top_p[:, j + 1:], head.t2d)
        if regress is not None:
            ce = 0.1 * ce + F.smooth_l1_loss(h[:, :n].float(), regress[:, j + 1:].float())
        loss = loss + STEP_DECAY ** j * ce
        with torch.no_grad():
            ok = hits(lg, top_ids[:, j + 1:], head.d2t)[:, : T - steps]  # [B, T-steps]: positions every step scores
            run = ok if run is None else run & ok  # the chain's first j+1 drafts all accepted
            acc.append(ok.float().mean())
            chain = chain + run.float().mean()
    return loss, {"acc": torch.stack(acc), "chain": chain.float()}
