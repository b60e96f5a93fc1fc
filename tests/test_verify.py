"""Verification rules: unit cases on near-one-hot distributions and exact distributions by chi-square."""

import pytest
import torch
from scipy.stats import chisquare

from speculant.exact.distributions import Dist
from speculant.exact.verify_chain import verify_greedy, verify_sampled

V = 6


def dist(p: torch.Tensor, g: torch.Generator | None = None) -> Dist:
    """p [R, V] as a Dist of its nonzero entries, in a random order per row (with g) and padded: the
    form the sampler produces, candidates in any order."""
    if g is None:
        return Dist(torch.arange(V).expand(p.shape[0], V), p, V)
    rows = []
    for r in p:
        ids = torch.nonzero(r)[:, 0]
        ids = ids[torch.randperm(ids.numel(), generator=g)]
        rows.append(Dist(ids[None], r[ids][None], V))
    return Dist.cat(rows)


def onehot(i: int, eps: float = 0.0) -> torch.Tensor:
    p = torch.full((V,), eps)
    p[i] = 1.0 - eps * (V - 1)
    return p


def test_greedy_accepts_matching_prefix():
    logits = torch.stack([onehot(2), onehot(4), onehot(1), onehot(5)]) * 10
    tokens, n = verify_greedy(torch.tensor([2, 4, 0]), logits)
    assert int(n) == 2
    assert tokens[: int(n) + 1].tolist() == [2, 4, 1]
    tokens, n = verify_greedy(torch.tensor([2, 4, 1]), logits)
    assert int(n) == 3 and tokens.tolist() == [2, 4, 1, 5]  # all accepted + bonus
    tokens, n = verify_greedy(torch.tensor([], dtype=torch.long), logits[:1])
    assert int(n) == 0 and tokens.tolist() == [2]  # plain decoding


def test_sampled_accepts_when_target_agrees_and_rejects_when_it_cannot():
    g = torch.Generator().manual_seed(0)
    p = torch.stack([onehot(3), onehot(1), onehot(0)])
    q = torch.stack([onehot(3), onehot(1)])
    tokens, n = verify_sampled(torch.tensor([3, 1]), dist(q), dist(p), g)
    assert int(n) == 2 and tokens.tolist() == [3, 1, 0]
    # The target gives the drafted token 0 probability: always rejected, replaced from p.
    tokens, n = verify_sampled(torch.tensor([5, 1]), dist(torch.stack([onehot(5), onehot(1)]), g), dist(p, g), g)
    assert int(n) == 0 and tokens[0].item() == 3


def test_sampled_near_one_hot_residual():
    g = torch.Generator().manual_seed(1)
    p = torch.stack([onehot(2, 1e-4), onehot(4, 1e-4)])
    # Draft is sure of token 0 where the target is sure of 2: rejected, residual ~ p without q's mass.
    for _ in range(50):
        tokens, n = verify_sampled(torch.tensor([0]), dist(onehot(0, 1e-4)[None]), dist(p), g)
        assert int(n) == 0 and tokens[0].item() == 2


def test_lookup_one_hot_q_accepts_with_probability_p():
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.25, 0.75, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    acc = sum(int(verify_sampled(torch.tensor([1]), None, dist(p, g), g)[1]) for _ in range(4000))
    assert abs(acc / 4000 - 0.75) < 0.03


def _random_dist(g: torch.Generator, sharp: float = 2.0) -> torch.Tensor:
    """A random distribution with two tokens left out: p and q cover different candidates."""
    x = torch.randn(V, generator=g) * sharp
    x[torch.randperm(V, generator=g)[:2]] = float("-inf")
    return torch.softmax(x, -1)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("one_hot_q", [False, True])
def test_emitted_tokens_follow_target_distribution(k, one_hot_q):
    """Every emitted position is distributed as p, whatever q proposed (10^5 rounds, chi-square).

    p is fixed per position (independent of the context), so emitted token j, whether accepted or
    resampled, must be distributed exactly as p_j.
    """
    g = torch.Generator().manual_seed(100 + k + 10 * one_hot_q)
    p = torch.stack([_random_dist(g) for _ in range(k + 1)])  # [k+1, V]
    q = torch.stack([_random_dist(g) for _ in range(k)])  # [k, V]
    p_dist, q_dist = dist(p, g), dist(q, g)
    n_rounds = 100_000
    # The drafts of every round drawn at once, and the emitted tokens counted at the end: the rounds
    # cost one verify_sampled call each (lookup: a deterministic proposal per round, so q is None).
    drafts = torch.multinomial(q, n_rounds, replacement=True, generator=g).T.contiguous()  # [n_rounds, k]
    q_arg = None if one_hot_q else q_dist
    outs = [verify_sampled(draft, q_arg, p_dist, g) for draft in drafts]
    tokens = torch.stack([t for t, _ in outs])  # [n_rounds, k+1]
    emitted = torch.arange(k + 1) <= torch.stack([n for _, n in outs])[:, None]  # [n_rounds, k+1]
    counts = torch.stack([torch.bincount(tokens[emitted[:, j], j], minlength=V) for j in range(k + 1)]).float()
    totals = emitted.sum(0)
    for j in range(k + 1):
        if totals[j] < 2000:
            continue
        expected = p[j] * totals[j]
        keep = expected > 5
        obs, exp = counts[j][keep], expected[keep]
        exp = exp * obs.sum() / exp.sum()
        assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4, (j, counts[j], expected)
