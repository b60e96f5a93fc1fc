"""Drafters in isolation: prompt lookup's n-gram index and the adaptive draft length."""

import math

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


def _rounds(dl: DraftLength, accepted_of: dict[int, int], verify_ms: dict[int, float], draft_ms: float, n: int):
    """n rounds: drafting dl.k tokens (draft_ms each), accepting accepted_of[k] of them, a pass of k + 1 rows
    taking verify_ms[k + 1]."""
    for _ in range(n):
        k = dl.k
        dl.update(accepted_of[k], k)
        dl.observe(k, k * draft_ms / 1000, verify_ms[k + 1] / 1000)


# a pass of 1..7 rows on 2 Zen 4 cores (hybrid's rounds, ms; speculant/methods/draft_length.py)
ZEN4_MS = {1: 34.9, 2: 36.8, 3: 39.1, 4: 43.0, 5: 46.8, 6: 55.2, 7: 60.5}


def test_auto_draft_length_stops_where_drafts_stop_paying():
    # drafts 1-4 always accepted, 5 and 6 never: the 5th and 6th cost a draft forward and a row each, for nothing
    accepted_of = {k: min(k, 4) for k in range(1, 7)}
    dl = DraftLength(DraftLengthConfig(k=4, schedule="auto", max_k=6, warmup=3), timed=True)
    _rounds(dl, accepted_of, ZEN4_MS, 9.0, 1)
    assert dl.k == 6  # heuristic during the warmup: +2 after a fully accepted round, -1 after the next
    _rounds(dl, accepted_of, ZEN4_MS, 9.0, 1)
    assert dl.k == 5
    _rounds(dl, accepted_of, ZEN4_MS, 9.0, 20)
    assert dl.k == 4
    assert dl.acceptance()[4] > 0.9 > 0.7 > dl.acceptance()[5]  # 2 rounds reached the 5th, the prior holds it up


def test_auto_draft_length_drafts_long_when_rows_are_free_and_accepted():
    flat = {r: 35.0 for r in range(1, 8)}
    accept_all = {k: k for k in range(1, 7)}
    dl = DraftLength(DraftLengthConfig(k=1, schedule="auto", max_k=6, warmup=2), timed=True)
    _rounds(dl, accept_all, flat, 1.0, 12)
    assert dl.k == 6
    # the same rounds untimed (seeded sampling): the heuristic schedule alone, no measured state
    untimed = DraftLength(DraftLengthConfig(k=1, schedule="auto", max_k=6, warmup=2), timed=False)
    _rounds(untimed, {k: 0 for k in range(1, 7)}, flat, 1.0, 3)
    assert untimed.k == 1 and not untimed.verify


def test_auto_draft_length_verify_cost_between_and_beyond_measured_lengths():
    dl = DraftLength(DraftLengthConfig(schedule="auto"), timed=True)
    assert dl.verify_seconds(3) is None
    dl.observe(2, 0.0, 1.0)  # a pass of 3 rows
    assert dl.verify_seconds(1) == dl.verify_seconds(6) == 1.0  # one length known: it stands for all
    dl.observe(4, 0.0, 2.0)  # 5 rows
    dl.observe(4, 0.0, 3.0)
    assert dl.verify_seconds(5) == 2.5  # the mean
    assert dl.verify_seconds(4) == pytest.approx(1.75)  # interpolated
    assert dl.verify_seconds(7) == pytest.approx(4.0)  # extrapolated along 3 -> 5 rows
    assert dl.verify_seconds(2) == 1.0  # below the shortest: the shortest


def test_a_block_drafter_is_priced_per_round_and_may_draft_its_whole_block():
    """DFlash proposes a block in one pass whatever k: T(k) = t_round + t_verify(k + 1). Priced per token, the
    same measurements make a long block look k times dearer and the policy drafts short."""
    assert DraftLengthConfig().limit() == 6 and DraftLengthConfig(k=8).limit() == 8
    assert DraftLengthConfig().limit(block=16) == 15 and DraftLengthConfig().limit(block=64) == 31
    assert DraftLengthConfig(max_k=4).limit(block=16) == 4  # a length the user set stands

    def policy(block: int) -> DraftLength:
        dl = DraftLength(DraftLengthConfig(k=4, schedule="auto", warmup=1), timed=True, block=block)
        for j in range(1, dl.max_k + 1):  # every draft accepted 9 times in 10 where reached
            dl.reached[j], dl.kept[j] = 1000, 900
        for k in (2, 4, 8, 15):  # a round: the drafter's pass 100 ms, verification 35 ms + 1 ms a row
            dl.observe(k, 0.100, (35 + k + 1) / 1000)
        return dl

    block, per_token = policy(16), policy(0)
    assert block.max_k == 15 and per_token.max_k == 6
    a = block.acceptance()
    rate = {k: (1 + sum(math.prod(a[1 : j + 1]) for j in range(1, k + 1))) / (0.100 + (36 + k) / 1000)
            for k in range(1, 16)}
    assert block.k == max(rate, key=rate.get) == 15
    assert per_token.k < 6  # 100 ms a round spread over its drafts, then charged k times


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"k": 5, "max_k": 4}, {"schedule": "sometimes"}, {"warmup": 0}])
def test_invalid_draft_length(kwargs):
    with pytest.raises(SpeculantError):
        DraftLengthConfig(**kwargs)


def test_invalid_lookup_config():
    with pytest.raises(SpeculantError):
        LookupConfig(max_ngram=2, min_ngram=3)
