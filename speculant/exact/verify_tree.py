"""Verification of a tree of drafts (speculant/exact/tree.py): the longest path the target accepts.

Pure tensor functions with fixed output shapes and no host syncs, like exact/verify_chain.py; the tree's shape
is host data (the drafter built it), its tokens and the target's rows are tensors. Pass rows: 0 =
pending, 1 + i = node i; row r's distribution p_r scores the token after row r.

Greedy: node i is right when its token is the target's top token at its parent's row; a path is
accepted when all its nodes are right. Every accepted path is a prefix of the target's greedy
continuation, so the longest one (the first of equal depth) is emitted, then the target's top
token after it.

Sampling: recursive rejection over siblings (SpecInfer, Miao et al. 2024; EAGLE). At a row with
target distribution p and children c_1, c_2, ... (in node order) drawn with distributions q_1, q_2,
...: accept c_j with probability min(1, p(x_j) / q_j(x_j)) and go on below it; on rejection set
p <- norm(max(0, p - q_j)) and try c_{j+1}; when every child is rejected, draw from p.

Why it is exact: q_j must be the distribution x_j was drawn from *given everything drawn before
it* (exact/tree.py's convention). Claim: from child j on, the emitted token is distributed as p_j.
With no child left it is a draw from p_j. Otherwise x_j ~ q_j given the past, and the standard
speculative-sampling step gives P(emit x) = min(p_j(x), q_j(x)) + P(reject) * p_{j+1}(x) with
P(reject) = sum max(0, p_j - q_j), which is p_j(x) when the rest emits p_{j+1} (induction; the
uniforms are independent of the drafts). Below an accepted child the same holds for its row,
so every position of the output has the target's distribution. This covers:
- i.i.d. siblings (drawn with replacement from r): q_j = r for every j (SpecInfer's MSS);
- siblings drawn without replacement from r: q_j = r with x_1..x_{j-1} removed, renormalized.
  Using r for all of them instead would be wrong: a rejected x_1 has p_2(x_1) = 0 but could
  never be drawn again, so the residual mass meant for it is never given out;
- deterministic siblings (top-b of a head, a lookup copy): q_j = one-hot(x_j) (q = None): accept
  with p_j(x_j), else remove x_j from p and renormalize. The same rule is wrong for sampled
  siblings with q = r: it ignores that x_j was likely under r, over-emitting it.
The accepted child of every row is computed for all rows at once (the uniforms of rows off the
final path are simply unused), then the path is followed from row 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .distributions import Dist, draw
from .sampler import top_token
from .tree import DraftTree


@dataclass(slots=True)
class TreeVerdict:
    """Emitted = tokens[: n + 1] (the accepted drafts, then the target's token); the accepted drafts are
    nodes[: n] (node ids, root first). D = the tree's depth; entries past n are padding."""

    tokens: Tensor  # [D + 1] long
    nodes: Tensor  # [D] long
    n: Tensor  # [] long


def verify_tree_greedy(tree: DraftTree, logits: Tensor) -> TreeVerdict:
    """tree of N nodes, logits [1 + N, V] (after bias and penalties) -> the verdict."""
    best = top_token(logits)  # [1 + N]
    N, dev = tree.size, logits.device
    if N == 0:
        return TreeVerdict(best[:1], best.new_zeros(0), best.new_zeros(()))
    parent_rows = torch.tensor(tree.parents, device=dev) + 1  # [N]
    right = tree.tokens == best.index_select(0, parent_rows)  # [N]
    anc = tree.ancestor_mask(dev)[1:, 1:]  # [N, N]: node -> its ancestors and itself
    accepted = ~(anc & ~right[None, :]).any(-1)  # [N]
    score = accepted * torch.tensor(tree.depth, device=dev)  # depth of accepted nodes, 0 elsewhere
    deepest = score.argmax()  # the first of the longest accepted paths (argmax takes the first maximum)
    n = score.max()
    return _verdict(tree, anc, deepest, n, best.index_select(0, ((deepest + 1) * (n > 0)).reshape(1)))


def verify_tree_sampled(tree: DraftTree, p: Dist, generator: torch.Generator) -> TreeVerdict:
    """tree of N nodes (q: N rows or None = one-hot), p: 1 + N rows -> the verdict (module docstring)."""
    dev = p.p.device
    node, n, final = tree_acceptance(tree, p, lambda size: torch.rand(size, generator=generator, device=dev))
    extra = draw(final, generator)  # [1]
    anc = tree.ancestor_mask(dev)[1:, 1:]
    return _verdict(tree, anc, node.clamp_min(0), n, extra)


def tree_acceptance(tree: DraftTree, p: Dist, uniform: Callable[[int], Tensor]) -> tuple[Tensor, Tensor, Dist]:
    """verify_tree_sampled's deterministic part, given its acceptance uniforms: (node, n, final).

    uniform(P) gives P uniforms in [0, 1), one per row with children (in row order), for the rows' first
    children, then again for their second children, and so on. node = the last accepted node (-1: none), n =
    its depth, final = the one row the last token is drawn from, unnormalized. Separate so that tests can
    choose the uniforms and read off the exact output distribution.
    """
    N, dev = tree.size, p.p.device
    rows = [r for r in range(N + 1) if tree.children[r]]  # rows with children
    width = max((len(tree.children[r]) for r in rows), default=0)
    P = len(rows)
    rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
    ids = p.ids.index_select(0, rows_t)  # [P, K]
    w = p.p.index_select(0, rows_t).clone()  # [P, K]: each row's current residual, normalized
    choice = torch.full((P,), -1, dtype=torch.long, device=dev)  # the accepted child per row
    for j in range(width):  # the j-th child of every row at once
        kids = [tree.children[r][j] if j < len(tree.children[r]) else -1 for r in rows]
        valid = torch.tensor([c >= 0 for c in kids], device=dev) & (choice < 0)  # [P]
        c = torch.tensor([max(c, 0) for c in kids], dtype=torch.long, device=dev)  # [P]
        x = tree.tokens.index_select(0, c)  # [P]
        hit = ids == x[:, None]  # [P, K]
        p_x = (w * hit).sum(-1)  # [P]
        if tree.q is None:  # one-hot drafts
            q_at = hit.to(w.dtype)
            q_x = torch.ones_like(p_x)
        else:  # q_j over p's candidates, through a dense row (q's candidates may be any ids)
            dense = w.new_zeros(P, max(p.vocab, tree.q.vocab))
            dense.scatter_add_(1, tree.q.ids.index_select(0, c), tree.q.p.index_select(0, c))
            q_at = dense.gather(1, ids)
            q_x = dense.gather(1, x[:, None])[:, 0]
        u = uniform(P)
        ok = valid & (u * q_x < p_x)  # u < p/q without dividing by a zero q
        choice = torch.where(ok, c, choice)
        rejected = (valid & ~ok)[:, None]
        residual = (w - q_at).clamp_min_(0.0)
        total = residual.sum(-1, keepdim=True)
        # p == q leaves no residual mass; then no rejection happens (ratio 1), but keep rows well-defined
        w = torch.where(rejected & (total > 0), residual / total.clamp_min(1e-30), w)
    # follow the accepted children from row 0
    child = torch.full((N + 1,), -1, dtype=torch.long, device=dev)
    if P:
        child.index_copy_(0, rows_t, choice)
    D = tree.max_depth
    node = torch.full((), -1, dtype=torch.long, device=dev)
    for _ in range(D):
        nxt = child.index_select(0, (node + 1).reshape(1))[0]
        node = torch.where(nxt >= 0, nxt, node)
    n = torch.tensor(tree.depth + [0], device=dev).index_select(0, torch.where(node >= 0, node, N).reshape(1))[0]
    # the last token: from the final row's residual (it has children, all rejected) or its p (a leaf);
    # a residual row lives on the candidates of its own row of p
    last = (node + 1).reshape(1)  # [1]
    final = p.select(last)
    if P:
        slot = torch.full((N + 1,), P, dtype=torch.long, device=dev)
        slot.index_copy_(0, rows_t, torch.arange(P, device=dev))
        s = slot.index_select(0, last)  # [1]
        final = Dist(final.ids, torch.where((s < P)[:, None], w.index_select(0, s.clamp_max(P - 1)), final.p), p.vocab)
    return node, n, final


def _verdict(tree: DraftTree, anc: Tensor, deepest: Tensor, n: Tensor, extra: Tensor) -> TreeVerdict:
    """The verdict for the path ending at node `deepest` (n > 0) or for no accepted draft (n == 0)."""
    N, D = tree.size, tree.max_depth
    ar = torch.arange(N, device=anc.device)
    if N == 0:
        return TreeVerdict(extra, ar, n)
    on = anc.index_select(0, deepest.reshape(1))[0] & (n > 0)  # [N]: the path's nodes
    nodes = torch.where(on, ar, N + ar).argsort()[:D]  # path nodes first, ascending = root first
    tokens = torch.cat([tree.tokens.index_select(0, nodes), extra.new_zeros(1)])  # [D + 1]
    return TreeVerdict(tokens.index_copy(0, n.reshape(1), extra), nodes, n)
