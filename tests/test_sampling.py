"""The sampler: the candidate pipeline equals the full-sort definition, penalties, draws, validation.

`reference_probs` is the full-sort implementation the fast path replaced (one sort of the whole
vocabulary per row), kept here as the definition; tests/sampled.py builds the engine tests' exact marginals with it.
"""

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from speculant.exact.distributions import Dist, draw, truncated
from speculant.errors import SpeculantError
from speculant.exact.sampler import Sampler, SamplingConfig, top_token

INF = float("inf")


def reference_truncate(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V]: temperature, top-k, top-p, min-p by sorting everything.

    Ties sort by token id (stable sort). The top-p sums run in float64 over exp(x - max) taken for
    the whole row, as in the fast path: float32 sums of 151,936 terms in another order move the cut
    by ~1e-5 of mass (see test_the_float32_sort_agrees_up_to_its_rounding).
    """
    x = logits.float() / temperature
    V = x.shape[-1]
    e = (x - x.amax(-1, keepdim=True)).exp()
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -INF)
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        es = e.gather(-1, idx) * (sorted_x > -INF)
        p_sorted = es.double() / es.sum(-1, keepdim=True, dtype=torch.float64)
        # Drop a token when the tokens ahead of it already reach top_p; the most likely token stays.
        drop_sorted = (p_sorted.cumsum(-1) - p_sorted) >= top_p
        drop_sorted[..., 0] = False
        x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), -INF)
    if min_p > 0.0:
        x = x.masked_fill(e < min_p, -INF)
    return x.softmax(-1)


def reference_adjust(logits: torch.Tensor, cfg: SamplingConfig, context: list[int]) -> torch.Tensor:
    """logits [V] after logit bias and penalties over the window of `context`, one token at a time."""
    x = logits.float().clone()
    for t, b in cfg.logit_bias:
        x[t] += b
    n = cfg.repeat_last_n
    if cfg.penalized:
        window = context if n == -1 else context[-n:]
        for t, count in Counter(window).items():
            v = float(x[t])
            if cfg.repeat_penalty != 1.0:
                v = v / cfg.repeat_penalty if v > 0 else v * cfg.repeat_penalty
            x[t] = v - count * cfg.frequency_penalty - cfg.presence_penalty
    return x


def reference_probs(logits: torch.Tensor, cfg: SamplingConfig, context: list[int] = ()) -> torch.Tensor:
    """logits [V] -> the distribution `cfg` samples from after `context`."""
    x = reference_adjust(logits, cfg, list(context))
    return reference_truncate(x, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The fast path as dense probabilities: logits [R, V] -> [R, V]."""
    return Sampler(cfg, logits.shape[-1]).dist(logits).dense()


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    p = probs(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(p, torch.softmax(logits / 2.0, -1))


def test_top_k_keeps_k_largest_and_ties_with_the_kth():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0, -1.0]])
    p = probs(logits, SamplingConfig(temperature=1.0, top_k=2))[0]
    assert (p > 0).tolist() == [False, True, False, True, False]
    assert torch.allclose(p[[1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    tied = probs(torch.tensor([[1.0, 2.0, 1.0, 0.0]]), SamplingConfig(temperature=1.0, top_k=2))[0]
    assert (tied > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))[0]
    assert (p > 0).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p[:2], torch.tensor([0.5, 0.3]) / 0.8)
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.81))[0]
    assert (p > 0).tolist() == [True, True, True, False]
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.1))[0]
    assert (p > 0).tolist() == [True, False, False, False]  # the top token always stays


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = probs(logits, SamplingConfig(temperature=1.0, min_p=0.3))[0]
    assert (p > 0).tolist() == [True, True, False, False]  # 0.15 < 0.3 * 0.5
    assert torch.allclose(p[:2], torch.tensor([0.5, 0.3]) / 0.8)
    # after top-p (which keeps 0.5, 0.3, 0.15), min-p drops what is below 0.2 * 0.5
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.81, min_p=0.2))[0]
    assert (p > 0).tolist() == [True, True, True, False]


def _assert_same(fast: Dist, ref: torch.Tensor, case) -> None:
    d = fast.dense()
    assert torch.equal(d > 0, ref > 0), (case, torch.nonzero((d > 0) != (ref > 0)).tolist()[:10])
    assert torch.allclose(d, ref, rtol=1e-5, atol=1e-7), (case, float((d - ref).abs().max()))


def _random_logits(g: torch.Generator, rows: int, V: int, scale: float, grid: float) -> torch.Tensor:
    x = torch.randn(rows, V, generator=g) * scale
    if grid:  # many exact ties
        x = (x / grid).round() * grid
    x[0, torch.randperm(V, generator=g)[:20]] += 8.0  # a peaked row, its head scattered over the vocabulary
    return x


@pytest.mark.parametrize("V, scale, grid", [(7, 1.0, 0.0), (1000, 2.0, 0.0), (1000, 3.0, 0.5), (3000, 0.01, 0.0),
                                            (5000, 3.0, 0.0)])
def test_candidates_equal_the_full_sort(V, scale, grid):
    """Every combination of temperature (extremes included), top-k, top-p and min-p: the same kept
    tokens and the same probabilities as sorting the whole vocabulary, rows processed together."""
    g = torch.Generator().manual_seed(V + int(10 * scale))
    x = _random_logits(g, 3, V, scale, grid)
    for T, k, p, m in itertools.product((0.01, 0.7, 1.5, 50.0), (0, 1, 3, 50), (1.0, 0.95, 0.5), (0.0, 0.05, 0.5)):
        _assert_same(truncated(x, T, k, p, m), reference_truncate(x, T, k, p, m), (T, k, p, m))


def test_rows_with_few_certain_tokens_beside_a_tied_row_keep_real_distinct_ids():
    """A row whose first half ties (many blocks share their maximum, so the pool holds many certain tokens) beside
    rows with few: those rows fill their K entries with other ids of their pool, never with the last partial
    block's padding past V (which once indexed past the vocabulary: "index 5000 is out of bounds")."""
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(3, 5000, generator=g) * 3
        x[:, :2500] = x[:, :1]
        for T, k, p, m in [(0.8, 0, 0.8, 0.0), (0.8, 3, 0.9, 0.0), (0.8, 2, 1.0, 0.0), (0.8, 3, 0.7, 0.05)]:
            d = truncated(x, T, k, p, m)
            assert bool((d.ids < 5000).all()) and all(len(set(r)) == len(r) for r in d.ids.tolist())
            _assert_same(d, reference_truncate(x, T, k, p, m), (T, k, p, m))


@pytest.mark.parametrize("T, k, p, m", [(0.7, 0, 0.9, 0.0), (0.7, 40, 0.95, 0.05), (1.0, 0, 0.999, 0.0),
                                        (5.0, 0, 0.9, 0.0), (0.7, 0, 1.0, 0.1), (1.0, 2000, 1.0, 0.0)])
def test_candidates_equal_the_full_sort_on_a_real_sized_vocabulary(T, k, p, m):
    """151,936 logits, including flat rows whose nucleus needs pools of every size up to the full sort."""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([_random_logits(g, 2, 151936, 3.0, 0.0), torch.randn(1, 151936, generator=g) * 0.1,
                   torch.zeros(1, 151936)])  # a nearly flat and a fully tied row
    _assert_same(truncated(x, T, k, p, m), reference_truncate(x, T, k, p, m), (T, k, p, m))


def _old_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The code the fast path replaced, verbatim (float32 softmax and cumsum over the sorted row)."""
    x = logits.float() / temperature
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    p_sorted = sorted_x.softmax(-1)
    drop_sorted = (p_sorted.cumsum(-1) - p_sorted) >= top_p
    drop_sorted[..., 0] = False
    x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
    return x.softmax(-1)


def test_the_float32_sort_agrees_up_to_its_rounding():
    """The old float32 code and the fast path keep the same tokens, except tokens whose mass ahead is
    within float32 rounding of top_p (there the old code's cut depends on its summation order)."""
    g = torch.Generator().manual_seed(2)
    x = _random_logits(g, 3, 151936, 3.0, 0.0)
    for T, top_p in ((0.7, 0.9), (1.0, 0.95), (0.7, 0.999)):
        new, old = truncated(x, T, top_p=top_p).dense(), _old_probs(x, T, top_p)
        e = (x / T - (x / T).amax(-1, keepdim=True)).exp().double()
        _, idx = torch.sort(x / T, dim=-1, descending=True, stable=True)
        ps = e.gather(-1, idx) / e.sum(-1, keepdim=True)
        ahead = torch.zeros_like(ps).scatter(-1, idx, ps.cumsum(-1) - ps)  # float64 mass ahead of each token
        differ = (new > 0) != (old > 0)
        assert ((ahead[differ] - top_p).abs() < 1e-4).all()
        # a sliver of mass: the old float32 sum's order differs by build (on an AVX2-only CPU one
        # boundary token of 1.3e-4 flips at T=0.7, top-p 0.9; 9e-5 and 1.5e-4 in the other two cases)
        assert (new + old)[differ].sum() < 5e-4
        both = (new > 0) & (old > 0)
        assert torch.allclose(new[both], old[both], rtol=1e-3, atol=1e-7)


def test_draws_follow_the_distribution_and_repeat_with_the_seed():
    g = torch.Generator().manual_seed(0)
    d = truncated(torch.randn(2, 50, generator=g) * 2, 1.0, top_p=0.9)
    a = [draw(d, SamplingConfig(1.0, seed=7).generator()).tolist() for _ in range(2)]
    assert a[0] == a[1]
    g1, g2 = SamplingConfig(1.0, seed=7).generator(), SamplingConfig(1.0, seed=8).generator()
    assert [draw(d, g1).tolist() for _ in range(20)] != [draw(d, g2).tolist() for _ in range(20)]
    n = 20000
    counts = torch.zeros(2, 50)
    draws = torch.stack([draw(d, g1) for _ in range(n)])  # [n, 2]
    for r in range(2):
        counts[r] = torch.bincount(draws[:, r], minlength=50).float()
    dense = d.dense()
    assert counts[dense == 0].sum() == 0  # never a token outside the kept set
    for r in range(2):
        keep = dense[r] > 0
        exp = dense[r][keep].double()
        assert chisquare(counts[r][keep].double().numpy(), (exp / exp.sum() * n).numpy()).pvalue > 1e-4


def test_draw_never_picks_a_token_without_mass():
    # u * total rounding up to the total must not land on the zero-probability padding at the end
    d = Dist(torch.tensor([[5, 9, 0, 0]]), torch.tensor([[0.0, 1.0, 0.0, 0.0]]), 10)
    g = torch.Generator().manual_seed(0)
    assert {int(draw(d, g)) for _ in range(200)} == {9}


def test_penalties_and_bias_see_the_drafted_prefix_of_each_row():
    """Rows of one verification pass: row j counts the context plus the first j drafted tokens, with the
    window sliding over the drafts (repeat_last_n 3 < 5 drafted)."""
    V = 12
    g = torch.Generator().manual_seed(3)
    context, drafted = [1, 2, 3, 2, 5], [2, 2, 7, 1, 3]
    for cfg in (SamplingConfig(0.8, repeat_penalty=1.3, repeat_last_n=3, presence_penalty=0.5, frequency_penalty=0.25,
                               logit_bias={4: 2.0, "9": -INF}),
                SamplingConfig(0.0, repeat_penalty=0.7, repeat_last_n=-1, frequency_penalty=-0.3),
                SamplingConfig(1.0, presence_penalty=1.0, repeat_last_n=0, logit_bias=[(2, -1.5)])):
        s = Sampler(cfg, V)
        s.start(context[:2])
        s.push(context[2:])
        logits = torch.randn(len(drafted) + 1, V, generator=g) * 2
        got = s.adjust(logits, drafted)
        for j in range(len(drafted) + 1):
            assert torch.allclose(got[j], reference_adjust(logits[j], cfg, context + drafted[:j])), (cfg, j)
        # the last rows only (a drafter's single row after its own drafts), and a narrower output layer
        assert torch.equal(s.adjust(logits[-2:], drafted), got[-2:])
        assert torch.equal(s.adjust(logits[-1:, :8], drafted), got[-1:, :8])
        assert torch.equal(logits, logits.clone())  # the input is left as it was
        if cfg.greedy:
            assert torch.equal(s.pick(logits, drafted), got.argmax(-1))


def test_penalties_change_what_is_sampled():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    s = Sampler(SamplingConfig(1.0, top_k=1, repeat_penalty=2.0, seed=0), 4)
    s.start([0, 0, 3])
    assert int(s.pick(logits)) == 1  # token 0's logit 2.0 -> 1.0
    s = Sampler(SamplingConfig(0.0, logit_bias={3: 5.0}), 4)
    assert int(s.pick(logits)) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e-9}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": 1.5}, "top-p"),
    ({"top_k": -1}, "top-k"),
    ({"min_p": -0.1}, "min-p"),
    ({"min_p": 1.5}, "min-p"),
    ({"repeat_penalty": 0.0}, "repeat penalty"),
    ({"repeat_penalty": INF}, "repeat penalty"),
    ({"repeat_last_n": -2}, "repeat-last-n"),
    ({"presence_penalty": float("nan")}, "presence"),
    ({"frequency_penalty": INF}, "frequency"),
    ({"logit_bias": {-1: 1.0}}, "logit bias"),
    ({"logit_bias": {"x": 1.0}}, "logit bias"),
    ({"logit_bias": {3: INF}}, "logit bias"),
    ({"logit_bias": {3: "lots"}}, "logit bias"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(SpeculantError, match=match):
        SamplingConfig(**kwargs)


def test_logit_bias_forms_and_vocabulary_check():
    a = SamplingConfig(1.0, logit_bias={"7": 1, 2: -INF})
    assert a.logit_bias == ((2, -INF), (7, 1.0)) and a == SamplingConfig(1.0, logit_bias=[(7, 1.0), (2, -INF)])
    hash(a)
    with pytest.raises(SpeculantError, match="outside the model's vocabulary"):
        Sampler(SamplingConfig(1.0, logit_bias={40: 1.0}), 32)
    with pytest.raises(SpeculantError, match="bans every token"):
        Sampler(SamplingConfig(0.0, logit_bias={i: -INF for i in range(4)}), 4)


def test_top_token_is_argmax_with_the_first_index_on_ties():
    x = torch.randn(5, 151936, generator=torch.Generator().manual_seed(3))
    assert torch.equal(top_token(x), x.argmax(-1))
    tied = torch.zeros(2, 1000)
    tied[:, [7, 500, 999]] = 1.0
    assert top_token(tied).tolist() == [7, 7] and int(top_token(tied[0])) == 7
