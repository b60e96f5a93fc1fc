"""Medusa drafting (Cai et al. 2024): K heads on the target's last hidden state, a static tree.

Head k guesses the token k+2 places after the last scored position, all from the same hidden state
h_P (the target's final normed state at the last context token, whose logits chose `pending`). The
tree is fixed for the head: a node is a path of ranks (r_1, ..., r_d), its token head d-1's rank-r_d
guess. `static_tree` picks the `nodes` paths with the highest expected acceptance, the product of
the heads' measured rank hit rates (Medusa's construction; training stores them, training/train.py).
Every node is a function of the context (no draws), so the tree is exact for sampling with q = None.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from ..heads.modules import MedusaHeads
from .heads import HeadsConfig, load_heads
from ..models.transformer import FINAL_HIDDEN
from ..exact.tree import DraftTree
from .base import Drafter, MethodSpec

# Rank hit rates assumed for heads that come without measured ones (imported checkpoints):
# Medusa-1's reported top-1 accuracy of ~0.6 for head 1, falling per head and per rank.
PRIOR_TOP1, PRIOR_HEAD_DECAY, PRIOR_RANK_DECAY, PRIOR_RANKS = 0.6, 0.75, 0.45, 8


def static_tree(ranks: list[list[float]], nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` rank paths with the highest product of hit rates (ranks[d][r]: head d's rank-r rate),
    best first; every path's prefixes come before it."""
    K = len(ranks)
    heap = [(-ranks[0][r], (r,)) for r in range(len(ranks[0]))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        d = len(path)
        if d < K:
            for r, rate in enumerate(ranks[d]):
                heapq.heappush(heap, (neg * rate, path + (r,)))  # neg * rate = -(value * rate)
    return out


def prior_ranks(heads: int) -> list[list[float]]:
    return [[PRIOR_TOP1 * PRIOR_HEAD_DECAY ** k * PRIOR_RANK_DECAY ** r for r in range(PRIOR_RANKS)]
            for k in range(heads)]


class MedusaDrafter(Drafter):
    name = "medusa"
    taps = (FINAL_HIDDEN,)

    def __init__(self, head: MedusaHeads, cfg: HeadsConfig, ranks: list[list[float]] | None = None) -> None:
        self.head = head
        self.nodes = cfg.nodes  # the engine's per-round budget
        ranks = ranks or prior_ranks(head.cfg.medusa_heads)
        self.paths = static_tree(ranks[: head.cfg.medusa_heads], cfg.nodes)
        self.parents = [self.paths.index(p[:-1]) if len(p) > 1 else -1 for p in self.paths]
        self.depth = max(len(p) for p in self.paths)
        self.width = 1 + max(max(p) for p in self.paths)  # guesses each head must rank
        # flat index into the heads' [depth, width] guesses of each node
        self.index = torch.tensor([(len(p) - 1) * self.width + p[-1] for p in self.paths], device=head.d2t.device)
        self._h: Tensor | None = None  # [1, D] the target's normed state at the last context token

    def start(self, prompt: list[int], hidden: dict[int, Tensor] | None = None) -> None:
        self._h = hidden[FINAL_HIDDEN][-1:].float()

    def commit(self, accepted: list[int], n_drafted: int, *, path: list[int] | None = None,
               hidden: dict[int, Tensor] | None = None) -> None:
        self._h = hidden[FINAL_HIDDEN][-1:].float()

    def propose(self, pending: int, k: int) -> DraftTree:
        with torch.inference_mode():
            logits = self.head(self._h)[: self.depth, 0]  # [depth, Vd]
            guesses = logits.topk(self.width, -1).indices.reshape(-1)  # [depth * width]
            n = min(k, len(self.paths))  # paths are prefix-closed in order: any first n form a tree
            return DraftTree(self.head.d2t[guesses[self.index[:n]]], self.parents[:n])


SPEC = MethodSpec("medusa", "Medusa heads on the target's last hidden state, a static tree (--heads)",
                  build=lambda c: MedusaDrafter(c.head, c.method.heads, c.head_stats.get("val", {}).get("ranks")),
                  loads="heads", tree=True, options="heads", load=lambda t, m: load_heads(t, m.name, m.heads))
