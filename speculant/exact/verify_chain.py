"""Verification of drafted tokens: where speculative decoding's exactness lives.

Pure tensor functions, fixed output shapes, no host syncs (the caller reads the result once).
Distributions come as `Dist`s, their candidate tokens only (exact/distributions.py).
Names follow the papers: p = target distribution, q = draft distribution, k = drafted tokens.

Chain rule (Leviathan et al. 2023; Chen et al. 2023): drafted token x_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is resampled from
norm(max(0, p_i - q_i)); if all k are accepted a bonus token is drawn from p_k. The emitted tokens
are then distributed exactly as sampling from p alone. A deterministic drafter (prompt lookup) has
q = one-hot(x_i), so the rule becomes: accept with probability p_i(x_i), resample from p_i with
x_i removed. Greedy decoding is the limit: accept while x_i == argmax p_i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .distributions import Dist, draw
from .sampler import top_token


def verify_greedy(draft: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft [k], target_logits [k+1, V] -> (tokens [k+1], n_accepted []).

    Emitted tokens are tokens[: n_accepted + 1]; accepted drafts equal the target's argmax, so
    the emitted run is just the argmax prefix.
    """
    best = top_token(target_logits)  # [k+1]
    k = draft.shape[0]
    n = torch.cumprod((draft == best[:k]).to(torch.int64), 0).sum() if k else best.new_zeros(())
    return best, n


def verify_sampled(draft: Tensor, q: Dist | None, p: Dist, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """draft [k], q: k rows or None (one-hot drafts), p: k+1 rows -> (tokens [k+1], n_accepted []).

    Emitted tokens are tokens[: n_accepted + 1]: the accepted drafts, then one token that is either
    the resampled replacement (n_accepted < k) or the bonus token (n_accepted == k). Its randomness is
    k acceptance uniforms, then one draw from the row `acceptance` returns.
    """
    u = torch.rand(draft.shape[0], generator=generator, device=p.p.device)
    n, row = acceptance(draft, q, p, u)
    extra = draw(row, generator)  # [1]
    tokens = torch.cat([draft, draft.new_zeros(1)])
    tokens = tokens.index_copy(0, n, extra)
    return tokens, n[0]


def acceptance(draft: Tensor, q: Dist | None, p: Dist, u: Tensor) -> tuple[Tensor, Dist]:
    """verify_sampled's deterministic part, given its acceptance uniforms u [k] in [0, 1): (n [1], row).

    n = the accepted prefix length; row = the one row the token at n is drawn from, unnormalized
    (`draw` normalizes). Separate so that tests can enumerate u and read off the exact output
    distribution. Only row n of the residual is built: over p's candidates, as p - q is positive only
    where p is.
    """
    k = draft.shape[0]
    p_x = p.prob_of(draft)  # [k]
    ratio = p_x if q is None else p_x / q.prob_of(draft)
    accepted = u < ratio  # [k]
    n = torch.cumprod(accepted.to(torch.int64), 0).sum().reshape(1)  # [1]
    row = p.select(n)  # [1, K]: residual_n's support, or p_k for the bonus token
    if not k:
        return n, row
    if q is None:  # q_n = one-hot(draft[n]); none for the bonus row
        x = torch.cat([draft, draft.new_full((1,), -1)]).index_select(0, n)
        q_n = (row.ids == x).to(row.p.dtype)
    else:  # q_n at p's candidates, through a dense row (q's candidates may be any ids)
        dense = row.p.new_zeros(1, max(p.vocab, q.vocab))
        qi = n.clamp_max(k - 1)
        dense.scatter_add_(1, q.ids.index_select(0, qi), q.p.index_select(0, qi))
        q_n = dense.gather(1, row.ids) * (n < k)
    residual = (row.p - q_n).clamp_min_(0.0)
    # p == q exactly leaves no residual mass; that row is then never reached (ratio = 1), but keep the
    # draw well-defined.
    weights = torch.where(residual.sum() > 0, residual, row.p)
    return n, Dist(row.ids, weights, p.vocab)
