"""EAGLE-2 and EAGLE-3 drafting: a one-layer head, autoregressive over features, grows a dynamic tree.

State: the head's own KV cache, one entry per context position p built from (feature F_p, token
x_{p+1}), exactly as in training (training/objectives.py). The target's features arrive through taps:
`start` gets the prompt's rows, `commit` those of [pending, *accepted]; a feature is paired with the
token after it as soon as that token is known, and the last one waits for the next pending.

A round (`propose`): one head pass over the waiting (feature, token) pairs, the last of them
(F_P, pending) giving the root output; then the dynamic tree of EAGLE-2 (Li et al. 2024): the root's
top-`topk` tokens are depth 1; at each further step the `topk` newest nodes with the highest
cumulative log-probability are expanded in one head pass (each attends to the context and its own
ancestors), each proposing its `topk` best children; finally all nodes are reranked by cumulative
log-probability and the best `nodes` kept (a node never outranks its parent, so the kept set is a
tree). The nodes are a function of the context alone (top-k, no draws), so the tree is exact for
sampling with q = None (exact/tree.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..heads.layer import attend, rope_tables_for
from ..heads.modules import EagleHead
from .heads import HeadsConfig, load_heads
from ..models.cache import KVCache
from ..models.transformer import Transformer
from ..exact.tree import DraftTree
from .base import Drafter, DrafterInputs, MethodSpec


class EagleDrafter(Drafter):
    def __init__(self, head: EagleHead, target: Transformer, cfg: HeadsConfig, max_len: int) -> None:
        self.name = head.cfg.method
        # the layers the engine taps, each once (a published default on a small target can name one twice)
        self.taps = tuple(dict.fromkeys(head.cfg.taps))
        self.head, self.target, self.cfg = head, target, cfg
        self.nodes = cfg.nodes  # the engine's per-round budget
        hc = head.cfg
        # room for the context plus one round's expanded nodes
        self.cache = KVCache(1, hc.n_kv_heads, hc.head_dim, max_len + cfg.depth * cfg.topk + 1, torch.float32,
                             target.device)
        self.cos, self.sin = rope_tables_for(hc, target)
        self.pos0 = 0  # rotary position of cache slot 0 (a reused prompt prefix has no features)
        self._feats: list[Tensor] = []  # waiting features [1, Df] each, paired with _tokens
        self._tokens: list[int] = []
        self._tail: Tensor | None = None  # the last feature, whose next token (pending) is not known yet

    def _features(self, hidden: dict[int, Tensor]) -> Tensor:
        return torch.cat([hidden[t] for t in self.head.cfg.taps], -1).float()  # [R, Df]

    def start(self, prompt: list[int], hidden: dict[int, Tensor] | None = None) -> None:
        f = self._features(hidden)
        R = f.shape[0]
        self.cache.rollback(0)
        self.pos0 = len(prompt) - R
        self._feats = list(f[:-1].split(1))
        self._tokens = list(prompt[len(prompt) - R + 1:])
        self._tail = f[-1:]

    def commit(self, accepted: list[int], n_drafted: int, *, path: list[int] | None = None,
               hidden: dict[int, Tensor] | None = None) -> None:
        if self._tail is not None:  # no round ran since the last commit (no room to draft): pair it now
            self._feats.append(self._tail)
            self._tokens.append(accepted[0])
        f = self._features(hidden)  # [len(accepted), Df]
        self._feats += list(f[:-1].split(1))
        self._tokens += accepted[1:]
        self._tail = f[-1:]

    def propose(self, pending: int, k: int) -> DraftTree:
        head, cfg = self.head, self.cfg
        feats = torch.cat(self._feats + [self._tail])  # [n, Df]
        tokens = torch.tensor(self._tokens + [pending], device=feats.device)
        self._feats, self._tokens, self._tail = [], [], None
        committed = self.cache.length + tokens.shape[0]
        root_pos = self.pos0 + committed - 1  # (F_P, pending) sits at position P
        with torch.inference_mode():
            positions = torch.arange(committed - tokens.shape[0], committed, device=feats.device) + self.pos0
            h = self._pass(head.first_feature(feats), tokens, None, positions)
            return self._tree(h[-1:], root_pos, committed, min(k, cfg.nodes))

    def _pass(self, feature: Tensor, tokens: Tensor, mask: Tensor | None, positions: Tensor) -> Tensor:
        """Head rows for (feature [S, D], next token [S]) at `positions` -> outputs [S, D]."""
        x, residual = self.head.layer_input(self.target.embed(tokens).float(), feature)
        return attend(self.head.layer, x, residual, self.cache, positions, mask, self.cos, self.sin)

    def _tree(self, h_root: Tensor, root_pos: int, committed: int, budget: int) -> DraftTree:
        head, cfg = self.head, self.cfg
        b = cfg.topk
        dev = h_root.device
        logp = torch.log_softmax(head.logits(h_root).float(), -1)  # [1, Vd]
        top = logp.topk(min(b, logp.shape[-1]), -1)
        # every node generated: draft id, parent node (-1 = pending), cumulative log-prob, depth
        ids: list[Tensor] = [top.indices[0]]
        scores: list[Tensor] = [top.values[0]]
        parents: list[int] = [-1] * top.indices.shape[1]
        n = len(parents)
        layer_nodes = list(range(n))  # the newest depth's nodes
        slot: dict[int, int] = {}  # expanded node -> its cache slot
        anc: dict[int, list[int]] = {-1: []}  # expanded node -> the cache slots of its expanded ancestors and itself
        all_scores = scores[0]
        # A tree of `budget` nodes is at most `budget` deep: deeper nodes could never be kept, and the pass
        # that grows depth d sits at position root_pos + d - 1, which must stay inside the context (and the
        # rotary table) when ties (a near-certain head) defeat the early stop below.
        for depth in range(2, min(cfg.depth, budget) + 1):
            sc = all_scores[layer_nodes[0]: layer_nodes[-1] + 1]
            if n >= budget and float(sc.max()) < float(all_scores.topk(budget).values[-1]):
                break  # children score below their parents: nothing deeper can make the final cut
            pick = sc.topk(min(b, len(layer_nodes))).indices.tolist()
            expand = [layer_nodes[i] for i in pick]
            flat_ids = torch.cat(ids)
            base = self.cache.length
            rows = []
            for r, node in enumerate(expand):
                slot[node] = base + r
                anc[node] = anc.get(parents[node], []) + [base + r]
                rows.append(anc[node])
            S = len(expand)
            mask = torch.zeros(S, base + S, dtype=torch.bool)
            mask[:, :committed] = True
            for r, slots in enumerate(rows):
                mask[r, slots] = True
            mask = mask.to(dev)  # built on the host, then one copy
            if depth == 2:
                feature = head.next_feature(h_root).expand(S, -1)
            else:
                feature = h_prev[torch.tensor([pos_of[parents[e]] for e in expand], device=dev)]
            positions = torch.full((S,), root_pos + depth - 1, device=dev)
            out = self._pass(feature, head.d2t[flat_ids[expand]], mask, positions)
            lp = torch.log_softmax(head.logits(out).float(), -1) + all_scores[expand][:, None]  # [S, Vd]
            ch = lp.topk(min(b, lp.shape[-1]), -1)
            ids.append(ch.indices.reshape(-1))
            scores.append(ch.values.reshape(-1))
            new_parents = [e for e in expand for _ in range(ch.indices.shape[1])]
            parents += new_parents
            layer_nodes = list(range(n, n + len(new_parents)))
            n += len(new_parents)
            all_scores = torch.cat(scores)
            h_prev, pos_of = head.next_feature(out), {e: r for r, e in enumerate(expand)}
        self.cache.rollback(committed)
        return _select(head.d2t[torch.cat(ids)], parents, all_scores, budget)


def _select(tokens: Tensor, parents: list[int], scores: Tensor, budget: int) -> DraftTree:
    """The `budget` best nodes by cumulative log-probability, as a DraftTree (parents before children)."""
    order = scores.argsort(descending=True, stable=True).tolist()
    kept: list[int] = []
    chosen: set[int] = set()
    for i in order:  # a child never outranks its parent, except on exact ties: skip orphans
        if len(kept) == budget:
            break
        if parents[i] == -1 or parents[i] in chosen:
            kept.append(i)
            chosen.add(i)
    depth, rank = {}, {i: r for r, i in enumerate(order)}
    for i in sorted(kept):  # generation order has parents first
        depth[i] = 1 + (depth[parents[i]] if parents[i] >= 0 else 0)
    kept.sort(key=lambda i: (depth[i], rank[i]))
    new = {old: j for j, old in enumerate(kept)}
    return DraftTree(tokens[kept], [new[parents[i]] if parents[i] >= 0 else -1 for i in kept])


def build(c: DrafterInputs) -> EagleDrafter:
    return EagleDrafter(c.head, c.target, c.method.heads, c.max_len)


def load(target, method) -> tuple:
    return load_heads(target, method.name, method.heads)


EAGLE2 = MethodSpec("eagle2", "an EAGLE head on the target's last hidden state drafts a dynamic tree (--heads)",
                    build=build, loads="heads", tree=True, options="heads", load=load)
EAGLE3 = MethodSpec("eagle3", "an EAGLE-3 head on three of the target's layers drafts a dynamic tree (--heads, "
                    "or a published drafter: --drafter)", build=build, loads="heads", tree=True, options="heads",
                    load=load)
