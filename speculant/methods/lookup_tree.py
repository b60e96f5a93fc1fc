"""Prompt lookup with several candidate continuations, verified as one tree.

Plain prompt lookup (lookup.py) copies what followed the latest earlier occurrence of the longest
matching n-gram. Text often repeats with variations (a name used in several statements, a line
pattern with different arguments), so the latest occurrence is often the wrong one. This drafter
keeps the last `branches` occurrences of every n-gram, takes the continuations of the longest
n-grams first and the most recent occurrences first, and merges them into a trie under pending:
shared prefixes cost one node, and the target checks every branch in its one pass
(decoding/tree_round.py), keeping the longest accepted one.

Continuations are cut at a depth that follows the draft-length heuristic (+2 after a round that
accepted a deepest path, -1 otherwise, within 1..`depth`), so rounds where copies fail stop paying
for long branches. Every node is a function of the context alone, so the tree is deterministic
(q = None): exact under greedy decoding and sampling alike (exact/verify_tree.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from ..exact.tree import DraftTree
from .base import MAX_DRAFT_TOKENS, Drafter, MethodSpec
from .lookup import LookupConfig, NgramIndex


@dataclass(frozen=True, slots=True)
class LookupTreeConfig:
    # Small: on CPUs without AMX each extra verified row costs a good part of a target step, and extra
    # branches lift tokens per round only a little (`bench methods`; docs/measurements.md "Method defaults").
    branches: int = 2  # candidate continuations at most (earlier occurrences per n-gram kept)
    nodes: int = 8  # tree nodes per round at most (the target scores 1 + nodes rows)
    depth: int = 6  # tokens per continuation at most (the adaptive depth's ceiling)

    def __post_init__(self) -> None:
        if self.branches < 1:
            raise SpeculantError(f"lookup tree branches must be >= 1, got {self.branches}")
        if not 1 <= self.nodes <= MAX_DRAFT_TOKENS:
            raise SpeculantError(f"tree nodes must be in 1..{MAX_DRAFT_TOKENS} (the target checks 1 + nodes "
                                 f"tokens in one batch-invariant pass), got {self.nodes}")
        if self.depth < 1:
            raise SpeculantError(f"lookup tree depth must be >= 1, got {self.depth}")


class LookupTreeDrafter(Drafter):
    name = "lookup_tree"

    def __init__(self, cfg: LookupTreeConfig, lookup: LookupConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.lookup = lookup.resolved(1)
        self.nodes = cfg.nodes  # the engine's per-round budget for tree drafters
        self.device = device
        self.ngrams = NgramIndex(self.lookup, keep=cfg.branches)
        self.depth = cfg.depth  # this round's depth (adaptive)
        self.proposed_depth = 0  # the last tree's depth

    def start(self, prompt: list[int]) -> None:
        self.ngrams.reset(prompt)
        self.depth = self.cfg.depth
        self.proposed_depth = 0

    def continuations(self, pending: int) -> list[list[int]]:
        """Up to `branches` distinct continuations, longest n-gram and most recent occurrence first."""
        return self.ngrams.continuations(pending, self.depth, self.cfg.branches)

    def propose(self, pending: int, k: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        trie: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for cont in self.continuations(pending):
            par = -1
            for t in cont:
                node = trie.get((par, t))
                if node is None:
                    if len(tokens) >= k:
                        break
                    node = trie[(par, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(par)
                par = node
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long, device=self.device), parents)
        self.proposed_depth = tree.max_depth
        return tree

    def commit(self, accepted: list[int], n_drafted: int, path: list[int] | None = None) -> None:
        if self.proposed_depth:
            full = len(accepted) - 1 >= self.proposed_depth
            self.depth = min(self.depth + 2, self.cfg.depth) if full else max(self.depth - 1, 1)
            self.proposed_depth = 0
        for t in accepted:
            self.ngrams.push(t)


SPEC = MethodSpec("lookup_tree", "prompt lookup with several candidate continuations, verified as one tree",
                  build=lambda c: LookupTreeDrafter(c.method.lookup_tree, c.method.lookup, c.target.device), tree=True)
