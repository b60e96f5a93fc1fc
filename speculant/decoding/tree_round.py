"""One decoding round over a tree of drafts: score every node in one pass, keep the accepted path.

The target scores [pending, *nodes] with each node's ancestor mask and depth positions
(models/transformer.py: bit-identical to the node's path scored as a chain), the verdict
(exact/verify_tree.py) picks the path, and `KVCache.keep` moves the path's keys/values to consecutive
slots: the cache then holds exactly what `ar` would have written. The sampler's penalties count
each row's own ancestors (`Sampler.adjust(paths=)`). Host syncs: the drafted tokens when penalties
are on, the sampler's candidate check when sampling, and one read of the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.cache import KVCache
from ..models.transformer import Transformer
from ..exact.sampler import Sampler
from ..exact.tree import DraftTree
from ..exact.verify_tree import verify_tree_greedy, verify_tree_sampled


@dataclass(slots=True)
class TreeRound:
    tokens: list[int]  # emitted: the accepted path's tokens, then the target's own token
    path: list[int]  # the accepted nodes, root first (len(tokens) - 1 of them)
    hidden: dict[int, Tensor]  # taps asked for: {tap: [len(tokens), D]} rows of pending and the path


def tree_round(model: Transformer, cache: KVCache, sampler: Sampler, pending: int, tree: DraftTree,
               taps: tuple[int, ...] = ()) -> TreeRound:
    """Score `tree` after `pending` (cache.length = pending's slot), verify, keep the accepted path."""
    dev = model.device
    base = cache.length
    tokens = torch.cat([tree.tokens.new_tensor([pending]), tree.tokens])  # [1 + N]
    out = model(tokens, cache, positions=tree.positions(base, dev), mask=tree.ancestor_mask(dev), taps=taps)
    paths = tree.row_paths(tree.tokens.tolist()) if sampler.penalized else None
    if sampler.generator is None:
        v = verify_tree_greedy(tree, sampler.adjust(out.logits, paths=paths))
    else:
        v = verify_tree_sampled(tree, sampler.dist(out.logits, paths=paths), sampler.generator)
    D = tree.max_depth
    read = torch.cat([v.n.reshape(1), v.tokens, v.nodes]).tolist()  # the round's one host sync
    n = read[0]
    emitted, path = read[1 : n + 2], read[2 + D : 2 + D + n]
    rows = torch.tensor([0] + [i + 1 for i in path], device=dev)
    cache.keep(base, rows)
    return TreeRound(emitted, path, {t: h.index_select(0, rows) for t, h in out.taps.items()})
