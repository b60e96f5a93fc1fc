"""Sampled output of the chain methods and their draft options has the target's distribution, through the whole
engine (tests/chain_dist.py), and the check rejects a biased acceptance."""

import pytest

from conftest import tiny_model
from speculant.decoding.engine import Engine
from speculant.methods.base import DraftLengthConfig
from speculant.methods.config import MethodConfig
from speculant.methods.draft_model import DraftModelConfig
from speculant.exact.sampler import SamplingConfig
from chain_dist import FMT, check_chain_method
from sampled import biased_acceptance, exact_marginals, exact_memo, sample_runs

pytestmark = pytest.mark.heavy  # collected first (tests/conftest.py)


FLOAT32 = {"draft"}  # this case runs float32 models (torch's row-wise route), the others Q8_0 (chain_dist.py)


@pytest.fixture(scope="module")
def exact():
    return exact_memo()


@pytest.mark.parametrize("method, sampling", [
    ("draft", SamplingConfig(0.7, top_k=3, top_p=0.9)),
    ("draft-conf", SamplingConfig(1.0)),
    ("draft-vocab", SamplingConfig(0.9)),  # the draft proposes among the first 3 of 4 ids only
    # the draft reads only its window of the prompt (the last 6 of 70 tokens): q is still what it proposes from
    ("draft-window", SamplingConfig(0.9, top_p=0.95)),
    ("lookup", SamplingConfig(1.3)),
    ("hybrid", SamplingConfig(1.0, top_p=0.8)),
    ("hybrid-never", SamplingConfig(0.8, top_k=3)),  # unchecked guesses, then the model's own drafts
    ("hybrid-always", SamplingConfig(0.9, top_p=0.95)),  # every guess checked by the draft model
    ("hybrid-window", SamplingConfig(1.0)),
])
def test_every_generated_position_has_the_targets_distribution(method, sampling, monkeypatch, exact):
    check_chain_method(method, sampling, monkeypatch, exact, "float32" if method in FLOAT32 else FMT)


def test_the_position_check_rejects_a_biased_acceptance(monkeypatch):
    """The negative control of the check (tests/chain_dist.py), in its setup (the plain `draft` case, fewer runs):
    rounds that verify against a biased p (tests/sampled.py) must be rejected."""
    biased_acceptance(monkeypatch)
    V, n_tok, runs, sampling = 4, 4, 600, SamplingConfig(1.0)
    target = tiny_model(V, seed=5, logit_scale=0.2)
    draft = tiny_model(V, seed=6, logit_scale=0.2, dim=16, layers=1)
    prompt = [0, 1, 2, 3] * 2 + [0, 1]
    exp = exact_marginals(target, prompt, sampling, n_tok)
    e = Engine(target, draft, MethodConfig("draft", DraftLengthConfig(k=3, schedule="fixed"),
                                           draft_model=DraftModelConfig(min_confidence=0.0)))
    r = sample_runs(lambda i: e, prompt, sampling, n_tok, V, runs)
    assert r.accepted > 0
    assert min(r.pvalues(exp)) < 1e-6, r.pvalues(exp)
