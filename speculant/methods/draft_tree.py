"""The draft model's chain with its runner-up tokens as siblings: a tree for the price of a chain.

The draft model drafts its chain as `draft` does (draft_model.py). At every depth its output row
also ranks the tokens it did not pick: the best `width - 1` of them become siblings of the chain
token (leaves under the same parent). Where the target rejects the chain token, one of them often
is its choice, and the round keeps one more token; the draft pays nothing extra (the rows exist),
the target scores width x the rows in its one pass (SpecInfer's token tree, the cheapest kind).

Exactness: a sibling is the top of the draft's row minus the chain token, a function of the context
and the tokens drawn before it, so its q is one-hot (exact/tree.py); the chain tokens keep the q they
were sampled from. Greedy output equals `ar` (exact/verify_tree.py takes the longest accepted path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..exact.distributions import Dist
from ..errors import SpeculantError
from ..exact.tree import DraftTree
from .base import MAX_DRAFT_TOKENS, Drafter, MethodSpec
from .draft_model import DraftModelDrafter, build


@dataclass(frozen=True, slots=True)
class DraftTreeConfig:
    width: int = 2  # children per depth: the chain token and width - 1 runner-ups

    def __post_init__(self) -> None:
        if not 1 <= self.width <= 8:
            raise SpeculantError(f"draft tree width must be in 1..8, got {self.width}")


class _Recorder:
    """The draft model as DraftModelDrafter calls it, keeping the last row of each forward's logits."""

    def __init__(self, model) -> None:
        self._model = model
        self.rows: list[torch.Tensor] = []

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        self.rows.append(out.logits[-1])
        return out

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class DraftTreeDrafter(Drafter):
    name = "draft_tree"

    def __init__(self, inner: DraftModelDrafter, cfg: DraftTreeConfig, max_chain: int) -> None:
        self.recorder = _Recorder(inner.model)
        inner.model = self.recorder
        self.inner, self.cfg = inner, cfg
        self.nodes = min(max_chain * cfg.width, MAX_DRAFT_TOKENS)
        self.chain_nodes: list[int] = []  # node ids of the last tree's chain tokens

    def start(self, prompt: list[int]) -> None:
        self.inner.start(prompt)

    def ready(self) -> None:
        self.inner.ready()

    def finish(self, decoded: list[int]) -> None:
        self.inner.finish(decoded)

    def propose(self, pending: int, k: int) -> DraftTree:
        self.recorder.rows.clear()
        w = self.cfg.width
        chain = self.inner.propose(pending, max(1, k // w))
        L = chain.tokens.shape[0]
        dev = chain.tokens.device
        tokens: list[int] = []
        parents: list[int] = []
        self.chain_nodes = []
        rows: list[Dist] = []
        spare = k - L  # sibling nodes left in the budget: the tree never exceeds the k rows the engine has room for
        if L:
            vocab = self.inner.target_vocab
            logits = torch.stack(self.recorder.rows[:L])[:, :vocab]  # [L, W]: the rows the chain was drawn from
            alts = logits.topk(min(w, logits.shape[1]), -1).indices.tolist()  # [L, w]
            picked = chain.tokens.tolist()
            par = -1
            for d in range(L):
                self.chain_nodes.append(len(tokens))
                tokens.append(picked[d])
                parents.append(par)
                if chain.q is not None:
                    rows.append(chain.q.select(torch.tensor([d], device=dev)))
                sibs = [a for a in alts[d] if a != picked[d]][: min(w - 1, spare)]
                spare -= len(sibs)
                for s in sibs:
                    tokens.append(s)
                    parents.append(par)
                if chain.q is not None and sibs:
                    rows.append(Dist.one_hot(torch.tensor(sibs, device=dev), vocab))
                par = self.chain_nodes[-1]
        q = Dist.cat(rows) if rows else None
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=dev), parents, q)

    def commit(self, accepted: list[int], n_drafted: int, path: list[int] | None = None) -> None:
        n = len(accepted) - 1
        if n and path and path[-1] not in self.chain_nodes:  # ends on a sibling: the chain up to its parent
            self.inner.commit(accepted, n)
        else:
            self.inner.commit(accepted, len(self.chain_nodes))


SPEC = MethodSpec("draft_tree", "the draft model's chain plus its runner-up tokens, verified as one tree",
                  build=lambda c: DraftTreeDrafter(build(c), c.method.draft_tree, c.method.draft_length.limit()),
                  loads="draft", tree=True)
