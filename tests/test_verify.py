"""Verification rules: unit cases on near-one-hot distributions, exact output distributions by enumerating
every draft and accepted length (with wrong rules as controls), and a chi-square run of the real sampling path."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from speculant.exact.distributions import Dist
from speculant.exact.verify_chain import acceptance, verify_greedy, verify_sampled

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


def _setting(k: int, one_hot_q: bool) -> tuple[torch.Tensor, torch.Tensor, Dist, Dist, torch.Generator]:
    """p [k+1, V] and q [k, V], each with two tokens left out, as dense rows and shuffled Dists."""
    g = torch.Generator().manual_seed(100 + k + 10 * one_hot_q)
    p = torch.stack([_random_dist(g) for _ in range(k + 1)])
    q = torch.stack([_random_dist(g) for _ in range(k)])
    return p, q, dist(p, g), dist(q, g), g


def _emitted_marginals(rule, p: torch.Tensor, q: torch.Tensor, p_dist: Dist, q_arg: Dist | None) -> torch.Tensor:
    """[k+1, V] float64: P(token j is emitted and equals x), exactly, for drafts drawn from q and
    `rule(draft, q, p, u) -> (n, row)` (`acceptance` or a wrong one) deciding with uniforms u.

    Every draft in support(q)^k is weighed by its probability, and every accepted length n by
    prod_{i<n} min(1, r_i) * (1 - min(1, r_n)), with r_i = p_i(x_i) / q_i(x_i) (p_i(x_i) for one-hot
    drafts) computed here. The rule is driven with u_i just below r_i for i < n, u_n just above r_n
    and u_i = 0 past n: it must accept exactly n drafts (so its threshold is r and a rejection ends
    the run), and the token at n then follows its row, normalized.
    """
    k = q.shape[0]
    out = torch.zeros(k + 1, V, dtype=torch.float64)
    support = [torch.nonzero(row)[:, 0].tolist() for row in q]
    for xs in itertools.product(*support):
        draft = torch.tensor(xs, dtype=torch.long)
        w_draft = float(torch.prod(q.double()[torch.arange(k), draft]))
        r = p.double()[torch.arange(k), draft] / (1.0 if q_arg is None else q.double()[torch.arange(k), draft])
        a = r.clamp(max=1.0)
        for n in range(k + 1):
            w = w_draft * float(torch.prod(a[:n])) * (float(1 - a[n]) if n < k else 1.0)
            if w == 0.0:
                continue
            u = torch.zeros(k)
            u[:n] = (a[:n] * (1 - 1e-6)).float()
            if n < k:
                u[n] = float(r[n] * (1 + 1e-6))
                assert u[n] < 1.0  # a rejection this close to r = 1 would need a finer margin
            got, row = rule(draft, q_arg, p_dist, u)
            assert int(got) == n, f"accepted {int(got)} drafts, not {n}: draft {xs}, u {u}, r {r}"
            out[torch.arange(n), draft[:n]] += w
            dense = row.dense()[0].double()
            assert dense.min() >= 0 and dense.sum() > 0
            out[n] += w * dense / dense.sum()
    return out


def _deviation(rule, k: int, one_hot_q: bool) -> float:
    """The largest |P(token j = x | j emitted) - p_j(x)| over positions and tokens, exactly."""
    p, q, p_dist, q_dist, _ = _setting(k, one_hot_q)
    marg = _emitted_marginals(rule, p, q, p_dist, None if one_hot_q else q_dist)
    reached = marg.sum(-1)  # [k+1]: P(position j is emitted)
    assert abs(float(reached[0]) - 1.0) < 1e-6 and bool((reached > 0).all()), reached
    return float((marg / reached[:, None] - p.double()).abs().max())


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("one_hot_q", [False, True])
def test_emitted_tokens_follow_target_distribution_exactly(k, one_hot_q):
    """Every emitted position is distributed as p, whatever q proposed, computed exactly over every draft
    and every accepted length (p is fixed per position, so emitted token j, accepted or resampled, must
    be distributed as p_j). Float32 rows leave ~1e-7; a wrong rule is off by far more (below)."""
    assert _deviation(acceptance, k, one_hot_q) < 1e-6


def _resample_from_p(draft, q, p, u):
    """Wrong: a rejected position draws from p itself instead of the residual (over-emits the rejected token)."""
    n, _ = acceptance(draft, q, p, u)
    return n, p.select(n)


def _one_hot_residual(draft, q, p, u):
    """Wrong for sampled drafts: the right acceptances, but the deterministic drafts' residual (p without x)."""
    n, _ = acceptance(draft, q, p, u)
    return n, acceptance(draft, None, p, torch.zeros_like(u) + (torch.arange(u.shape[0]) >= n))[1]


def _ignore_q(draft, q, p, u):
    """Wrong for sampled drafts: the deterministic drafts' rule (accept with p(x), remove x), q ignored."""
    return acceptance(draft, None, p, u)


@pytest.mark.parametrize("rule,one_hot_q", [(_resample_from_p, False), (_resample_from_p, True),
                                            (_one_hot_residual, False)])
def test_the_exact_check_catches_a_wrong_residual(rule, one_hot_q):
    assert _deviation(rule, 2, one_hot_q) > 1e-2


def test_the_exact_check_catches_a_wrong_acceptance_threshold():
    with pytest.raises(AssertionError, match="accepted 0 drafts, not 1"):
        _deviation(_ignore_q, 2, False)


def test_emitted_tokens_follow_target_distribution_end_to_end():
    """The generator path (acceptance uniforms, then the draw, then the tokens) by chi-square: 10^4 rounds of
    verify_sampled itself, the exact tests above cover every setting."""
    k = 2
    p, q, p_dist, q_dist, g = _setting(k, False)
    n_rounds = 10_000
    # The drafts of every round drawn at once, and the emitted tokens counted at the end.
    drafts = torch.multinomial(q, n_rounds, replacement=True, generator=g).T.contiguous()  # [n_rounds, k]
    outs = [verify_sampled(draft, q_dist, p_dist, g) for draft in drafts]
    tokens = torch.stack([t for t, _ in outs])  # [n_rounds, k+1]
    emitted = torch.arange(k + 1) <= torch.stack([n for _, n in outs])[:, None]  # [n_rounds, k+1]
    assert bool((tokens[:, :k][emitted[:, 1:]] == drafts[emitted[:, 1:]]).all())  # accepted drafts are kept
    counts = torch.stack([torch.bincount(tokens[emitted[:, j], j], minlength=V) for j in range(k + 1)]).float()
    totals = emitted.sum(0)
    for j in range(k + 1):
        assert totals[j] >= 1000, totals
        expected = p[j] * totals[j]
        keep = expected > 5
        obs, exp = counts[j][keep], expected[keep]
        exp = exp * obs.sum() / exp.sum()
        assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4, (j, counts[j], expected)
