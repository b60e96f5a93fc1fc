"""Verification of drafted tokens: where speculative decoding's exactness lives.

Pure tensor functions, fixed output shapes, no host syncs (the caller reads the result once).
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

from .sampling import top_token


def verify_greedy(draft: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft [k], target_logits [k+1, V] -> (tokens [k+1], n_accepted []).

    Emitted tokens are tokens[: n_accepted + 1]; accepted drafts equal the target's argmax, so
    the emitted run is just the argmax prefix.
    """
    best = top_token(target_logits)  # [k+1]
    k = draft.shape[0]
    n = torch.cumprod((draft == best[:k]).to(torch.int64), 0).sum() if k else best.new_zeros(())
    return best, n


def verify_sampled(draft: Tensor, q: Tensor | None, p: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """draft [k], q [k, V] or None (one-hot drafts), p [k+1, V] -> (tokens [k+1], n_accepted []).

    Emitted tokens are tokens[: n_accepted + 1]: the accepted drafts, then one token that is either
    the resampled replacement (n_accepted < k) or the bonus token (n_accepted == k).
    """
    k = draft.shape[0]
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft]  # [k]
    if q is None:
        ratio = p_x
        residual = p[:k].clone()
        residual[rows, draft] = 0.0  # max(0, p - onehot(x)) = p without x
    else:
        ratio = p_x / q[rows, draft]
        residual = (p[:k] - q).clamp_min_(0.0)
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = u < ratio  # [k]
    n = torch.cumprod(accepted.to(torch.int64), 0).sum()
    # Row n of [residual_0..residual_{k-1}, p_k] is where the one non-draft token comes from.
    dists = torch.cat([residual, p[k:]], dim=0)  # [k+1, V]
    row = dists.index_select(0, n.reshape(1))[0]
    total = row.sum()
    # p == q exactly leaves no residual mass; that row is then never reached (ratio = 1), but keep
    # the draw well-defined.
    row = torch.where(total > 0, row / total.clamp_min(1e-30), p.index_select(0, n.reshape(1))[0])
    extra = torch.multinomial(row, 1, generator=generator)  # [1]
    tokens = torch.cat([draft, draft.new_zeros(1)])
    tokens = tokens.index_copy(0, n.reshape(1), extra)
    return tokens, n
