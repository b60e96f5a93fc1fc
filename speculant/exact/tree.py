"""A tree of drafted tokens: what tree drafters propose and what the target verifies in one pass.

The tree hangs below `pending` (the last emitted token, not yet scored). Its N nodes are numbered in
the order the drafter drew them; a node's parent always has a smaller number (-1 = pending), so
index order is a topological order and the ascending node numbers of any root-to-node path are that
path in order. A chain of k drafts is the tree with parents [-1, 0, 1, ..., k-2].

The target scores [pending, *tokens] in one forward: row 0 is pending, row 1 + i is node i. Row
1 + i sits at rotary position base + depth[i] and attends to the committed context and to the rows
of its own ancestors (itself included), so its logits are those of the path to node i scored as a
plain chain (`ancestor_mask`, `positions`). The rows are pass rows, `node + 1` everywhere below.

Exactness of sampled trees rests on `q` (exact/verify_tree.py has the proof):
- q row i is the distribution node i's token was drawn from, *given everything drawn before it*:
  for siblings drawn one after another from the parent's draft distribution r, that is r itself
  when drawn with replacement (i.i.d., SpecInfer), and r with the earlier siblings' tokens removed
  and renormalized when drawn without replacement (a sampled top-b);
- q = None (or a one-hot row) for a deterministic node: a function of the context alone, such as
  the draft's top-b tokens (EAGLE-2's dynamic tree, Medusa's static tree) or a prompt-lookup copy.
  The tree's *shape* may depend on anything drawn before (a dynamic tree ranked by the draft's own
  probabilities); only the target's randomness must not leak into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .distributions import Dist
from ..errors import SpeculantError


@dataclass(slots=True)
class DraftTree:
    tokens: Tensor  # [N] long, on the model's device
    parents: list[int]  # N entries, parents[i] < i; -1 = a child of pending (host list: the shape is the drafter's)
    q: Dist | None = None  # N rows (see the module docstring); None = every node deterministic (one-hot)
    # derived on the host in __post_init__
    depth: list[int] = field(init=False)  # N entries, 1 for pending's children
    children: list[list[int]] = field(init=False)  # 1 + N lists: [0] = pending's children, [1 + i] = node i's

    def __post_init__(self) -> None:
        n = len(self.parents)
        if self.tokens.dim() != 1 or self.tokens.shape[0] != n:
            raise SpeculantError(f"a draft tree needs one parent per token: {tuple(self.tokens.shape)} tokens, "
                                 f"{n} parents")
        if self.q is not None and self.q.rows != n:
            raise SpeculantError(f"a draft tree's q needs one row per node: {self.q.rows} rows for {n} nodes")
        self.depth = []
        self.children = [[] for _ in range(n + 1)]
        for i, par in enumerate(self.parents):
            if not -1 <= par < i:
                raise SpeculantError(f"draft tree node {i} has parent {par}; parents must come first (-1 = pending)")
            self.depth.append(1 + (self.depth[par] if par >= 0 else 0))
            self.children[par + 1].append(i)

    @staticmethod
    def chain(tokens: Tensor, q: Dist | None = None) -> "DraftTree":
        """k drafts in a row as a tree (parents -1, 0, 1, ..., k-2)."""
        return DraftTree(tokens, list(range(-1, tokens.shape[0] - 1)), q)

    @property
    def size(self) -> int:
        """N, the drafted nodes (the pass scores N + 1 rows)."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, self.size - 1))

    def path(self, node: int) -> list[int]:
        """Nodes from pending's child down to `node` (inclusive); [] for node -1 (pending)."""
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self, device: torch.device | str = "cpu") -> Tensor:
        """[1 + N, 1 + N] bool over the pass rows: row r attends to row c (pending, its ancestors, itself)."""
        n = self.size
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[0, 0] = True
        for i, par in enumerate(self.parents):
            m[i + 1] = m[par + 1]
            m[i + 1, i + 1] = True
        return m.to(device)

    def positions(self, base: int, device: torch.device | str = "cpu") -> Tensor:
        """[1 + N] long: the rotary positions of the pass rows, base + depth (pending at base)."""
        return torch.tensor([base] + [base + d for d in self.depth], dtype=torch.long, device=device)

    def row_paths(self, tokens: Sequence[int]) -> list[list[int]]:
        """For every pass row, the drafted tokens before the position it scores: [] for pending, then the
        path to node i (inclusive) for row 1 + i. `tokens` = self.tokens as a host list (the sampler's
        penalties count exactly these, as a chain's row counts the drafts before it)."""
        out: list[list[int]] = [[]]
        for i, par in enumerate(self.parents):
            out.append(out[par + 1] + [int(tokens[i])])
        return out


def as_tree(draft: "DraftTree | object") -> DraftTree:
    """A drafter's proposal as a tree: a DraftTree as is, a chain `Draft` (tokens, q) as its chain tree."""
    if isinstance(draft, DraftTree):
        return draft
    return DraftTree.chain(draft.tokens, draft.q)  # type: ignore[attr-defined]
