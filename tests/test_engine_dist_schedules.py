"""Sampled output has the target's distribution through the whole engine while the draft length changes from
round to round (the heuristic and auto schedules) and the governor turns rounds plain and back
(tests/chain_dist.py: six tokens a run)."""

import pytest

from speculant.exact.sampler import SamplingConfig
from chain_dist import check_chain_method
from sampled import exact_memo
from test_engine import PENALTIES

pytestmark = pytest.mark.heavy  # collected first (tests/conftest.py)


@pytest.fixture(scope="module")
def exact():
    return exact_memo()


@pytest.mark.parametrize("method, sampling", [
    ("draft-heuristic", SamplingConfig(1.0, top_p=0.9)),  # the draft length changes from round to round
    # the governor turns rounds plain and back (2 rounds each way, then up to 4 by measured speed)
    ("draft-governed", SamplingConfig(1.0, top_p=0.9)),
    ("lookup-governed", SamplingConfig(0.8)),
    ("hybrid-governed", PENALTIES),
    # the auto draft length: governed (so timed), the k of every round after the first chosen from measurements
    ("draft-auto", SamplingConfig(0.9, top_p=0.95)),
    ("hybrid-auto", SamplingConfig(1.0)),
    ("lookup-auto", SamplingConfig(0.8)),
])
def test_every_generated_position_has_the_targets_distribution(method, sampling, monkeypatch, exact):
    check_chain_method(method, sampling, monkeypatch, exact)
