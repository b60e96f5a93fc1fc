"""Sampled output has the target's distribution where the other distribution tests do not reach: deep and
wide trees (runs generate more tokens than are checked, so the engine's budget is not capped by the tokens
left), the joint distribution of the first two tokens (not only each position's marginal), block-format
models (Q4_K, Q8_0: their fused C passes also keep the runs cheap), samplers the method files leave out,
a q8_0 KV cache for `draft` and a reduced draft vocabulary for `hybrid`. Every case has a negative
control: the same engine verifying against a biased p (p^8 renormalized), which the statistic must
reject."""

import pytest
import torch

from conftest import tiny_model
from speculant.decoding.engine import Engine
from speculant.methods.heads import HeadsConfig
from speculant.methods.config import MethodConfig
from speculant.methods.base import DraftLengthConfig
from speculant.methods.draft_model import DraftModelConfig
from speculant.methods.draft_tree import DraftTreeConfig
from speculant.methods.lookup import LookupConfig
from speculant.methods.lookup_tree import LookupTreeConfig
from speculant.exact.sampler import SamplingConfig
from sampled import biased_acceptance, exact_joint, exact_paths, sample_runs
from test_heads import random_head

pytestmark = pytest.mark.heavy  # collected first (tests/conftest.py)

V = 4
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # repeats: lookup drafts every round
CHECKED, JOINT, GENERATED = 4, 2, 8  # positions checked, of them in the joint, tokens generated per run
RUNS, CONTROL_RUNS = 400, 150
# every filter and the penalties at once (a window of 3, so drafted tokens enter and leave it at depth)
ALL = SamplingConfig(0.9, top_k=3, top_p=0.95, min_p=0.05, repeat_penalty=1.3, repeat_last_n=3, presence_penalty=0.4,
                     frequency_penalty=0.3, logit_bias={2: 0.5, 0: -0.3})
FILTERS = SamplingConfig(1.0, top_k=3, top_p=0.9, min_p=0.1, logit_bias={1: 0.4})


def target(fmt: str, kv: str = "f32"):
    """A flat tiny target (top probability ~0.3-0.5). Q4_K needs rows of 256 values; q8_0 caches heads of 32."""
    if fmt == "q4_k":
        return tiny_model(V, seed=5, logit_scale=0.07, dim=256, hidden=256, heads=4, kv_heads=2, fmt=fmt, kv_dtype=kv)
    if kv == "q8_0":
        return tiny_model(V, seed=5, logit_scale=0.1, dim=128, heads=4, kv_heads=2, fmt=fmt, kv_dtype=kv)
    return tiny_model(V, seed=5, logit_scale=0.2, layers=3, fmt=fmt, kv_dtype=kv)


def draft(fmt: str, kv: str = "f32"):
    if fmt == "q4_k":
        return tiny_model(V, seed=6, logit_scale=0.07, dim=256, hidden=256, layers=1, fmt=fmt, kv_dtype=kv)
    dim = 64 if kv == "q8_0" else 32 if fmt != "float32" else 16  # whole 32-value blocks in rows and cached heads
    return tiny_model(V, seed=6, logit_scale=0.2, dim=dim, heads=2, kv_heads=1, layers=1, fmt=fmt, kv_dtype=kv)


# name -> (target format, method builder, sampling); the builder gets (target, tmp_path)
CASES = {
    "lookup-filters": ("q8_0", lambda t, p: Engine(t, method=MethodConfig(
        "lookup", DraftLengthConfig(k=4, schedule="fixed"), LookupConfig(3, 1))), FILTERS),
    "lookup_tree-deep-q4_k": ("q4_k", lambda t, p: Engine(t, method=MethodConfig(
        "lookup_tree", lookup=LookupConfig(2, 1), lookup_tree=LookupTreeConfig(3, 8, 4))), ALL),
    "draft_tree-w3": ("q8_0", lambda t, p: Engine(t, draft("q8_0"), MethodConfig(
        "draft_tree", DraftLengthConfig(k=3, schedule="fixed", max_k=3), draft_model=DraftModelConfig(0.0),
        draft_tree=DraftTreeConfig(3))), ALL),
    "draft-q4_k-kvq8": ("q4_k", lambda t, p: Engine(t, draft("q8_0", "q8_0"), MethodConfig(
        "draft", DraftLengthConfig(k=4, schedule="fixed"), draft_model=DraftModelConfig(0.0))), FILTERS),
    "hybrid-vocab-q8_0": ("q8_0", lambda t, p: Engine(t, draft("q4_k"), MethodConfig(
        "hybrid", DraftLengthConfig(k=4, schedule="fixed"), LookupConfig(3, 3),
        DraftModelConfig(0.0, vocab=3))), ALL),
    "medusa": ("q8_0", lambda t, p: heads(t, p, "medusa", nodes=8), ALL),
    "eagle2": ("q8_0", lambda t, p: heads(t, p, "eagle2", nodes=8, depth=4, topk=3), FILTERS),
    "eagle3-q8_0": ("q8_0", lambda t, p: heads(t, p, "eagle3", nodes=8, depth=4, topk=3), ALL),
}


def heads(t, folder, method: str, **cfg) -> Engine:
    name = str(random_head(t, method, folder, seed=3, draft_vocab=3 if method == "eagle3" else None))
    return Engine(t, method=MethodConfig(method, heads=HeadsConfig(name=name, fmt="q8_0", **cfg)))


@pytest.fixture(scope="module")
def exact():
    """The enumerated target-only distribution (marginals, joint), once per (target, sampler) in this module."""
    memo: dict = {}

    def get(fmt: str, sampling: SamplingConfig):
        key = (fmt, sampling)
        if key not in memo:
            levels = exact_paths(target(fmt), PROMPT, sampling, CHECKED)
            memo[key] = (torch.stack([sum(w * p for _, w, p in level) for level in levels]), exact_joint(levels, JOINT))
        return memo[key]

    return get


def run(case: str, tmp_path, runs: int, control: bool, exact):
    fmt, build, sampling = CASES[case]
    t = target(fmt)
    e = build(t, tmp_path)
    r = sample_runs(lambda i: e, PROMPT, sampling, CHECKED, V, runs, generate=GENERATED, joint=JOINT)
    marginals, joint = exact(fmt, sampling)
    return r, r.pvalues(marginals), r.joint_pvalue(joint) if not control else None


@pytest.mark.parametrize("case", list(CASES))
def test_marginals_and_joint_are_the_targets(case, tmp_path, exact):
    r, marginal, joint = run(case, tmp_path, RUNS, control=False, exact=exact)
    assert 0 < r.accepted < r.drafted, (r.accepted, r.drafted)
    assert r.longest >= 2, r.longest  # rounds kept paths two or more drafts deep (cache.keep, penalties at depth)
    assert min(marginal) > 1e-4 and joint > 1e-4, (marginal, joint)


@pytest.mark.parametrize("case", list(CASES))
def test_the_check_rejects_a_biased_acceptance(case, tmp_path, monkeypatch, exact):
    biased_acceptance(monkeypatch)
    _, marginal, _ = run(case, tmp_path, CONTROL_RUNS, control=True, exact=exact)
    assert min(marginal) < 1e-6, marginal
