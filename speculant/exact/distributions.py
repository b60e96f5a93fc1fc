"""Token distributions stored as their candidates, and the truncation samplers that produce them.

Sampling with top-k, top-p or min-p keeps a handful of tokens out of ~150K. A `Dist` row stores only
those: token ids and probabilities, [R, K] each, padded with probability 0. Verification and draws
then work on K entries instead of the whole vocabulary.

`truncated` is the definition HF and llama.cpp share, applied in HF's order: divide by the
temperature, keep the top-k (every token tied with the k-th stays), keep the smallest prefix of the
tokens by descending probability whose mass reaches top-p (the top token always stays), keep the
tokens whose probability is at least min-p times the top token's, renormalize. "Prefix" orders tokens
by logit, then by id on ties, so the kept set is a function of the logits alone.

It gives that distribution without sorting the vocabulary. The row is cut into blocks of `BLOCK`
logits; the `j` blocks with the largest maxima form the pool, and every token above the largest
maximum left outside (tau) is in the pool: these "certain" tokens are exactly all tokens > tau, a
prefix of the sorted order. Only they are sorted. The cut is final when it provably falls inside that
prefix: top-k's set lies in it, or its probability mass reaches top-p (then every later token has
top-p behind it), or tau's probability is below min-p times the top's (then no later token passes
min-p). Otherwise the pool grows, up to the whole vocabulary (then it is the full sort).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 256  # logits per block: 594 block maxima for a 151,936-token vocabulary
FIRST_BLOCKS = 16  # blocks in the first pool (4,096 logits); each retry takes 8x more
# A top-p cut counts as inside the certain tokens only with this much mass to spare: the sums here and
# in a full sort round differently, and a cut that close to the edge is settled by a bigger pool.
MASS_MARGIN = 1e-4
MIN_P_MARGIN = 1e-6  # likewise for tau against the min-p threshold


@dataclass(slots=True)
class Dist:
    """Distributions over `vocab` token ids, one per row: ids [R, K] long and p [R, K] float32.

    Ids are distinct within a row; entries that are not candidates have p = 0. Rows sum to 1,
    except residual rows in verification, which `draw` normalizes itself.
    """

    ids: Tensor
    p: Tensor
    vocab: int

    @property
    def rows(self) -> int:
        return self.p.shape[0]

    def prob_of(self, tokens: Tensor) -> Tensor:
        """tokens [n] (n <= rows) -> [n]: the probability row i gives tokens[i]."""
        n = tokens.shape[0]
        return ((self.ids[:n] == tokens[:, None]) * self.p[:n]).sum(-1)

    def dense(self) -> Tensor:
        """[R, vocab] probabilities (tests and debugging; the decoding loop never builds these)."""
        return self.p.new_zeros(self.rows, self.vocab).scatter_add_(1, self.ids, self.p)

    def select(self, row: Tensor) -> Dist:
        """The one row `row` ([1] long, on the device, no host sync) as a Dist."""
        return Dist(self.ids.index_select(0, row), self.p.index_select(0, row), self.vocab)

    @staticmethod
    def one_hot(tokens: Tensor, vocab: int) -> Dist:
        """tokens [n] -> n rows that each give one token probability 1 (a deterministic proposal)."""
        return Dist(tokens[:, None], torch.ones(tokens.shape[0], 1, device=tokens.device), vocab)

    @staticmethod
    def cat(dists: Sequence[Dist]) -> Dist:
        """Rows of several Dists stacked, padded to the widest."""
        k = max(d.p.shape[1] for d in dists)
        ids = [torch.nn.functional.pad(d.ids, (0, k - d.ids.shape[1])) for d in dists]
        p = [torch.nn.functional.pad(d.p, (0, k - d.p.shape[1])) for d in dists]
        return Dist(torch.cat(ids), torch.cat(p), max(d.vocab for d in dists))


def draw(dist: Dist, generator: torch.Generator) -> Tensor:
    """One token per row, with probability proportional to p: [R] long (one uniform per row)."""
    w = dist.p
    c = w.cumsum(-1)  # [R, K]
    u = torch.rand(w.shape[0], 1, generator=generator, device=w.device) * c[:, -1:]
    j = torch.searchsorted(c, u, right=True)  # the first entry whose cumulative mass passes u
    # u * total can round up to the total itself: fall back to the last entry with mass
    last = ((w > 0) * torch.arange(w.shape[1], device=w.device)).amax(-1, keepdim=True)
    return dist.ids.gather(1, torch.minimum(j, last))[:, 0]


def truncated(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Dist:
    """logits [R, V] -> Dist [R, K]: temperature, top-k, top-p, min-p (the module docstring).

    Probabilities are exp(x - max) / sum, with exp taken over the whole row at once and the sums in
    float64, so that where the top-p cut falls does not depend on the order of summation (float32 sums
    of 151,936 terms move it by ~1e-5 of mass). One host sync per pool size tried (usually one).
    temperature > 0.
    """
    x = logits.float() / temperature  # [R, V]
    R, V = x.shape
    top_k = top_k if 0 < top_k < V else 0
    if not top_k and top_p >= 1.0 and min_p <= 0.0:  # nothing is cut: every token is a candidate
        return Dist(torch.arange(V, device=x.device).expand(R, V), x.softmax(-1), V)
    top = x.amax(-1, keepdim=True)  # [R, 1]
    e = (x - top).exp()  # [R, V]: unnormalized probabilities
    # top-p without top-k weighs the candidates against the whole vocabulary
    total = e.sum(-1, keepdim=True, dtype=torch.float64) if top_p < 1.0 and not top_k else None  # [R, 1]
    n_full, nb = V // BLOCK, -(-V // BLOCK)
    j = min(nb, max(FIRST_BLOCKS, top_k + 1))  # top-k needs k certain tokens; each block gives at least one
    bmax = None  # [R, nb]: the blocks' maxima, where the first pool is not the whole vocabulary
    if j < nb:
        bmax = x[:, : n_full * BLOCK].view(R, n_full, BLOCK).amax(-1)
        if V % BLOCK:
            bmax = torch.cat([bmax, x[:, n_full * BLOCK :].amax(-1, keepdim=True)], 1)
    while j < nb:
        out = _cut(x, e, top, total, bmax, nb, j, top_k, top_p, min_p)
        if out is not None:
            return out
        j = min(nb, 8 * j)
    return _whole(x, e, total, top_k, top_p, min_p)


def _cut(x: Tensor, e: Tensor, top: Tensor, total: Tensor | None, bmax: Tensor, nb: int, j: int, top_k: int,
         top_p: float, min_p: float) -> Dist | None:
    """The truncated distribution from the pool of the j < nb best blocks (maxima bmax), or None if the pool is
    too small."""
    R, V = x.shape
    dev = x.device
    best = bmax.topk(j + 1, -1)  # [R, j+1]
    tau = best.values[:, j:]  # [R, 1]: the largest block maximum outside the pool
    blocks = best.indices[:, :j].sort(-1).values  # ascending, so the pool's ids ascend
    ids = (blocks[..., None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten(1)  # [R, j*BLOCK]
    vals = x.gather(1, ids.clamp_max(V - 1)).masked_fill_(ids >= V, float("-inf"))
    certain = vals > tau  # all tokens above tau, wherever they are
    n_certain = certain.sum(-1)  # [R]
    K = int(n_certain.max())
    if K == 0:  # every block maximum ties with tau
        return None
    # each row's K entries: its certain tokens, then (in a row with fewer than K) other real ids of its pool, so
    # that the ids stay distinct; the last block's padding past V only if the pool has no other, then the pool grows
    rank = certain.float() + (ids < V)
    pos = rank.topk(K, -1).indices.sort(-1).values  # [R, K], ascending ids
    v = vals.gather(1, pos)
    c = certain.gather(1, pos)
    # by logit, then by id: stable sort of ascending ids
    order = v.masked_fill(~c, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    v, c, cid = v.gather(1, order), c.gather(1, order), ids.gather(1, pos).gather(1, order)  # [R, K]
    real = cid < V
    cid = cid.clamp_max(V - 1)
    ec = e.gather(1, cid) * c  # [R, K], 0 past the certain tokens
    keep = c.clone()
    # a row is settled once its cut provably falls inside its certain tokens; the first sorted token
    # must be certain (it is the row's top unless tied with tau)
    ok = c[:, 0] & real.all(-1)
    settled = torch.zeros(R, dtype=torch.bool, device=dev)
    if top_k:
        kth = v[:, min(top_k, K) - 1 :][:, :1]  # -inf in rows without k certain tokens (then incomplete)
        keep &= v >= kth
        complete = n_certain >= top_k  # top-k's set (ties included) lies inside the certain tokens
        settled |= complete
        ok &= complete
    if top_p < 1.0:
        mass = _top_p(ec * keep, total if not top_k else None, top_p, keep)
        settled |= mass[:, -1] >= top_p + MASS_MARGIN
    if min_p > 0.0:
        keep &= ec >= min_p
        settled |= (tau - top).exp()[:, 0] < min_p * (1.0 - MIN_P_MARGIN)
    ok &= settled
    width = keep.sum(-1).amax()
    good, width = torch.stack([ok.all().to(width.dtype), width]).tolist()  # the one host sync
    if not good:
        return None
    return _kept(ec, keep, cid, width, V)


def _whole(x: Tensor, e: Tensor, total: Tensor | None, top_k: int, top_p: float, min_p: float) -> Dist:
    """The truncated distribution when the pool is the whole vocabulary: one stable sort orders it by logit, then
    by id, nothing lies outside, so every cut is final (the same cuts as `_cut` makes, without its bookkeeping)."""
    V = x.shape[1]
    v, cid = x.sort(dim=-1, descending=True, stable=True)  # [R, V]
    keep = v > float("-inf")  # a token of logit -inf is never a candidate
    ec = e.gather(1, cid) * keep
    if top_k:
        keep &= v >= v[:, top_k - 1 : top_k]
    if top_p < 1.0:
        _top_p(ec * keep, total if not top_k else None, top_p, keep)
    if min_p > 0.0:
        keep &= ec >= min_p
    return _kept(ec, keep, cid, int(keep.sum(-1).amax()), V)  # the one host sync


def _top_p(w: Tensor, total: Tensor | None, top_p: float, keep: Tensor) -> Tensor:
    """Clears in `keep` the tokens past the top-p cut of the sorted unnormalized probabilities w [R, K] (weighed
    against `total`, or against their own sum when None); returns the cumulative mass [R, K]."""
    p = w.double() / (w.sum(-1, keepdim=True, dtype=torch.float64) if total is None else total)  # [R, K]
    mass = p.cumsum(-1)
    cut = (mass - p) >= top_p  # the tokens ahead of it already reach top_p
    cut[:, 0] = False
    keep &= ~cut
    return mass


def _kept(ec: Tensor, keep: Tensor, cid: Tensor, width: int, V: int) -> Dist:
    """The kept tokens (a prefix of each sorted row, `width` the widest) renormalized."""
    w = (ec * keep)[:, :width]
    return Dist(cid[:, :width], w / w.sum(-1, keepdim=True), V)
