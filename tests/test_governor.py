"""The speculation governor (speculant/methods/governor.py): its arm choice on measured rates, the rounds it
turns plain keep every method's greedy output identical to `ar`, and it falls back to plain decoding
when drafting is slow but keeps speculating when speculation pays."""

import time

import pytest

from conftest import tiny_model
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.governor import Governor, GovernorConfig, GovernorMemory
from speculant.methods.heads import HeadsConfig
from speculant.methods.config import MethodConfig, parse_method
from speculant.methods.base import DraftLengthConfig
from speculant.methods.draft_model import DraftModelDrafter
from speculant.exact.sampler import SamplingConfig
from test_engine import PROMPT
from test_heads import random_head

ALTERNATE = GovernorConfig("on", probe=2, hold=2, max_hold=2)  # 2 speculative rounds, 2 plain, and so on


def drive(gov: Governor, seconds_per_token: dict[bool, float], rounds: int) -> list[bool]:
    """Run `rounds` rounds where an arm's round emits 3 tokens (speculating) or 1 (plain) at the given cost."""
    arms = []
    for _ in range(rounds):
        arm = gov.speculate
        arms.append(arm)
        tokens = 3 if arm else 1
        gov.record(tokens, tokens * seconds_per_token[arm])
    return arms


def test_the_faster_arm_wins_and_probes_thin_out():
    cfg = GovernorConfig("on", probe=3, hold=6, max_hold=24)
    fast_spec = drive(Governor(cfg, True), {True: 0.01, False: 0.02}, 200)
    assert fast_spec[:6] == [True] * 6 and fast_spec[6:9] == [False] * 3  # warm up, then a plain probe
    assert fast_spec[9:21] == [True] * 12  # the probe lost: hold doubles
    assert fast_spec[21:24] == [False] * 3 and fast_spec[24:48] == [True] * 24  # up to max_hold
    assert fast_spec.count(False) == 3 * 8  # 8 probes in 200 rounds
    slow_spec = drive(Governor(cfg, True), {True: 0.05, False: 0.02}, 200)
    assert slow_spec[9:15] == [False] * 6  # the plain probe won: plain for `hold` rounds, then a probe
    assert slow_spec[15:18] == [True] * 3 and slow_spec[18:30] == [False] * 12
    assert slow_spec.count(True) == 6 + 3 * 8
    # a change of regime is found again: speculation starts paying after the first 100 rounds
    gov = Governor(cfg, True)
    drive(gov, {True: 0.05, False: 0.02}, 100)
    late = drive(gov, {True: 0.005, False: 0.02}, 100)
    assert late[-30:].count(True) >= 27
    # an engine's next generation goes on with the schedule where the last one stopped: 40 rounds are
    # 6 + 3 + 6 + 3 + 12 + 3 rounds of phases and 7 of a plain phase of 24 (hold doubled twice)
    memory = GovernorMemory()
    first = drive(Governor(cfg, True, memory), {True: 0.05, False: 0.02}, 40)
    assert memory.best is False and memory.rate[False] > memory.rate[True]
    assert first[30:33] == [True] * 3 and first[33:] == [False] * 7 and memory.left == 17
    nxt = drive(Governor(cfg, True, memory), {True: 0.05, False: 0.02}, 20)
    assert nxt[:17] == [False] * 17 and nxt[17:20] == [True] * 3  # the rest of the phase, then a probe
    assert first + nxt == drive(Governor(cfg, True), {True: 0.05, False: 0.02}, 60)  # as one generation of 60
    # inactive: always speculate
    assert all(drive(Governor(cfg, False), {True: 1.0, False: 0.001}, 50))


def test_config_and_modes():
    assert GovernorConfig().governs(SamplingConfig(0.0))
    assert GovernorConfig().governs(SamplingConfig(0.7))  # unseeded: random anyway
    assert not GovernorConfig().governs(SamplingConfig(0.7, seed=3))  # seeded runs repeat exactly
    assert GovernorConfig("on").governs(SamplingConfig(0.7, seed=3))
    assert not GovernorConfig("off").governs(SamplingConfig(0.0))
    with pytest.raises(SpeculantError, match="governor mode"):
        GovernorConfig("sometimes")
    with pytest.raises(SpeculantError, match="probe"):
        GovernorConfig(probe=0)
    assert parse_method("hybrid:governor=off,k=3").governor.mode == "off"
    assert parse_method("eagle3:governor=on,nodes=6").governor.mode == "on"


@pytest.fixture(scope="module")
def models():
    return tiny_model(32, seed=1, logit_scale=3.0, layers=4), tiny_model(32, seed=2, logit_scale=3.0, dim=16, layers=1)


@pytest.mark.parametrize("method", ["draft", "lookup", "hybrid", "lookup_tree", "draft_tree", "medusa", "eagle2", "eagle3"])
def test_plain_rounds_between_speculative_ones_keep_greedy_output(models, method, tmp_path):
    """Every drafter resumes correctly after rounds it did not draft: its caches, n-grams and hidden
    states catch up on the tokens the target emitted alone."""
    target, draft = models
    gen = GenerationConfig(max_new_tokens=48)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    heads = HeadsConfig()
    if method in ("medusa", "eagle2", "eagle3"):
        heads = HeadsConfig(name=str(random_head(target, method, tmp_path, seed=3)), nodes=6, depth=3, topk=2)
    m = MethodConfig(method, DraftLengthConfig(k=3, max_k=5), heads=heads, governor=ALTERNATE)
    e = Engine(target, draft if method in ("draft", "hybrid", "draft_tree") else None, m)
    done = e.generate(PROMPT, gen)
    assert done.token_ids == ref
    st = done.stats
    assert st.paused_rounds >= 4 and st.rounds >= 4
    assert st.target_forwards == 1 + st.rounds + st.paused_rounds
    assert st.emitted_in_rounds + st.paused_rounds + 1 == len(done.token_ids)
    # a seeded sampled generation is not governed under auto, and repeats
    s = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(0.9, seed=11))
    auto = Engine(target, e.draft, MethodConfig(method, m.draft_length, heads=heads))
    a, b = auto.generate(PROMPT, s), auto.generate(PROMPT, s)
    assert a.token_ids == b.token_ids and a.stats.paused_rounds == 0


def test_a_draft_model_the_governor_keeps_idle_never_runs(models):
    """A generation inside a plain phase that an earlier one left never runs the draft model, not even its
    prompt prefill; when the next probe comes, the draft catches up and the output is still `ar`'s."""
    target, draft = models
    gen = GenerationConfig(max_new_tokens=30)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    e = Engine(target, draft, MethodConfig("draft", governor=GovernorConfig("on", probe=3, hold=6, max_hold=48)))
    runs = []
    model = draft.model
    model.forward = lambda *a, **kw: runs.append(a[0].shape[0]) or type(model).forward(model, *a, **kw)
    try:
        e._governor_memory = GovernorMemory(best=False, rate={True: 1.0, False: 2.0}, speculate=False, hold=48,
                                            left=40)
        idle = e.generate(PROMPT, gen)
        assert idle.token_ids == ref and idle.stats.rounds == 0 and runs == []
        assert e._governor_memory.left == 40 - 29  # the schedule goes on in the next generation
        probed = e.generate(PROMPT, gen)  # 11 plain rounds, then a probe of 3 speculative ones (or more)
        assert probed.token_ids == ref and probed.stats.paused_rounds >= 11 and probed.stats.rounds >= 3
        assert runs[0] == len(PROMPT) - 1  # the deferred prefill came with the first draft
    finally:
        del model.forward


def _slowed(fn, seconds):
    def slow(*a, **kw):
        time.sleep(seconds)
        return fn(*a, **kw)
    return slow


def test_slow_drafting_falls_back_to_plain_decoding(models, monkeypatch):
    target, draft = models
    monkeypatch.setattr(DraftModelDrafter, "propose", _slowed(DraftModelDrafter.propose, 0.03))
    gen = GenerationConfig(max_new_tokens=120)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    done = Engine(target, draft, MethodConfig("draft")).generate(PROMPT, gen)  # governor: auto, greedy
    assert done.token_ids == ref
    assert done.stats.paused_rounds > done.stats.rounds
    off = Engine(target, draft, MethodConfig("draft", governor=GovernorConfig("off"))).generate(PROMPT, gen)
    assert off.token_ids == ref and off.stats.paused_rounds == 0


def test_speculation_that_pays_is_kept(models):
    """A slow target (30 ms a pass, any rows) drafted by its own fast twin: every draft accepted. (10 ms let a
    loaded machine's slower draft passes look costly enough to pause; 30 ms keeps the margin wide.)"""
    target, _ = models
    twin = tiny_model(32, seed=1, logit_scale=3.0, layers=4)
    gen = GenerationConfig(max_new_tokens=120)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    target.model.forward = _slowed(type(target.model).forward.__get__(target.model), 0.03)
    try:
        done = Engine(target, twin, MethodConfig("draft")).generate(PROMPT, gen)
    finally:
        del target.model.forward
    assert done.token_ids == ref and done.stats.acceptance_rate == 1.0
    assert done.stats.paused_rounds <= GovernorConfig().probe  # one probe at most, which lost
