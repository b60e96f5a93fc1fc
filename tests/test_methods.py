"""Drafters in isolation: prompt lookup's n-gram index and the adaptive draft length."""

import pytest

from speculant.errors import SpeculantError
from speculant.methods.base import DraftLength, DraftLengthConfig
from speculant.methods.lookup import LookupConfig, LookupDrafter


def test_lookup_proposes_continuation_of_most_recent_longest_match():
    d = LookupDrafter(LookupConfig(max_ngram=3))
    d.start([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2])
    # suffix [1, 2] + pending 3 -> "1 2 3" occurred at the start, followed by 4 5 9
    assert d.propose(3, 3).tokens.tolist() == [4, 5, 9]
    # only "2 3" matches after pending 3 following [.., 9, 2]? use a fresh history
    d.start([2, 3, 4, 0, 2, 3, 6, 0, 5])
    assert d.propose(2, 2).tokens.tolist() == [3, 6]  # "2" most recently followed by 3 6
    assert d.propose(7, 4).tokens.tolist() == []  # never seen
    assert d.propose(2, 0).tokens.tolist() == []


def test_lookup_index_follows_committed_tokens():
    d = LookupDrafter(LookupConfig(max_ngram=2))
    d.start([5, 6, 7])
    d.commit([8, 5, 6], n_drafted=2)  # history 5 6 7 8 5 6, pending next
    assert d.propose(7, 3).tokens.tolist() == [8, 5, 6]
    assert d.history == [5, 6, 7, 8, 5, 6]  # propose leaves the history as it was


def test_heuristic_draft_length_grows_and_shrinks_within_bounds():
    dl = DraftLength(DraftLengthConfig(k=4, schedule="heuristic", max_k=7))
    dl.update(4, 4)
    assert dl.k == 6
    dl.update(6, 6)
    assert dl.k == 7
    for _ in range(10):
        dl.update(0, 5)
    assert dl.k == 1
    fixed = DraftLength(DraftLengthConfig(k=3, schedule="fixed"))
    fixed.update(3, 3)
    assert fixed.k == 3


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"k": 5, "max_k": 4}, {"schedule": "sometimes"}])
def test_invalid_draft_length(kwargs):
    with pytest.raises(SpeculantError):
        DraftLengthConfig(**kwargs)


def test_invalid_lookup_config():
    with pytest.raises(SpeculantError):
        LookupConfig(max_ngram=2, min_ngram=3)
