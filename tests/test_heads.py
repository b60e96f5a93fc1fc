"""Draft heads through the engine: greedy output identical to `ar`, sampled output with the target's
distribution, trees within budget, and the head's cost per draft step."""

from dataclasses import replace

import pytest
import torch

from conftest import tiny_model
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig, parse_method
from speculant.errors import SpeculantError
from speculant.methods.governor import GovernorConfig
from speculant.heads.config import default_config
from speculant.heads.formats import save_head
from speculant.heads.modules import build_head, init_from_target
from speculant.methods.heads import HeadsConfig
from speculant.methods.medusa import static_tree
from speculant.exact.sampler import SamplingConfig
from sampled import biased_acceptance, exact_marginals, sample_runs
from test_engine import PENALTIES, PROMPT

pytestmark = pytest.mark.heavy  # collected first (tests/conftest.py)

METHODS = ("medusa", "eagle2", "eagle3")


def random_head(target, method: str, folder, *, draft_vocab: int | None = None, seed: int = 0, scale: float = 2.0):
    """A random head saved as a checkpoint folder (outputs start at the target's rows, layers random)."""
    torch.manual_seed(seed)
    cfg = default_config(method, target.config, draft_vocab or target.config.vocab_size, medusa_heads=3)
    head = build_head(cfg)
    V = target.config.vocab_size
    head.set_vocab(torch.randperm(V)[: cfg.draft_vocab].sort().values)
    init_from_target(head, target.model)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2 and "lm_head" not in name:
                p.normal_(0, scale / p.shape[1] ** 0.5)
    return save_head(head, folder / f"{method}-{seed}")


def engine(target, method: str, folder, **heads) -> Engine:
    return Engine(target, method=MethodConfig(method, heads=HeadsConfig(name=str(folder), **heads)))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fmt", ["float32", "q8_0"])
def test_greedy_identical_to_ar(method, fmt, tmp_path):
    target = tiny_model(32, seed=1, logit_scale=3.0, layers=4)
    gen = GenerationConfig(max_new_tokens=40)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    drafted = accepted = 0
    for seed in range(3):
        folder = random_head(target, method, tmp_path, draft_vocab=24 if method != "eagle2" else None, seed=seed)
        e = engine(target, method, folder, nodes=8, depth=4, topk=3, fmt=fmt)
        done = e.generate(PROMPT, gen)
        assert done.token_ids == ref, (method, seed)
        drafted += done.stats.drafted_tokens
        accepted += done.stats.accepted_tokens
        assert done.stats.drafted_tokens <= 8 * done.stats.rounds
    assert drafted > 0 and accepted > 0  # the trees were checked, and some of their tokens taken


def test_greedy_with_prompt_cache_and_short_budget(tmp_path):
    """A reused prompt prefix has no hidden rows; the last rounds have room for fewer nodes than asked."""
    target = tiny_model(32, seed=2, logit_scale=3.0, layers=4)
    gen = GenerationConfig(max_new_tokens=13)
    for method in METHODS:
        folder = random_head(target, method, tmp_path, seed=7)
        e = engine(target, method, folder, nodes=12)
        cache = e.prompt_cache()
        first = e.generate(PROMPT, gen, cache=cache).token_ids
        longer = PROMPT + first + [3, 4]
        assert e.generate(longer, gen, cache=cache).token_ids == Engine(target).generate(longer, gen).token_ids


V, RUNS = 4, 1500


@pytest.mark.parametrize("method, sampling", [
    ("eagle3", SamplingConfig(1.0)),
    ("eagle2", SamplingConfig(0.8, top_k=3)),
    ("medusa", PENALTIES),
    ("eagle3-governed", SamplingConfig(0.9)),  # plain rounds between tree rounds (methods/governor.py)
])
def test_sampled_distribution_exact(method, sampling, tmp_path):
    """Chi-square of every position against the target-only marginals (head trees are deterministic:
    q = None), with acceptance strictly between none and all."""
    # a Q8_0 target (its passes one C call over the blocks, taps included) but for the plain EAGLE-3 case's
    # float32 one (torch's row-wise route): the rounds under test are the same on both
    fmt = "float32" if method == "eagle3" else "q8_0"
    target = tiny_model(V, seed=5, logit_scale=0.2, layers=3, fmt=fmt)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    method, _, governed = method.partition("-")
    n_tok = 5 if governed else 4
    exp = exact_marginals(target, prompt, sampling, n_tok)
    e = engine(target, method, random_head(target, method, tmp_path, seed=3), nodes=5, depth=3, topk=2)
    if governed:
        e = Engine(target, method=replace(e.method, governor=GovernorConfig("on", probe=2, hold=2, max_hold=4)))
    r = sample_runs(lambda i: e, prompt, sampling, n_tok, V, RUNS)
    r.check_rounds(bool(governed))
    assert min(r.pvalues(exp)) > 1e-3, (method, r.pvalues(exp))


def test_the_position_check_rejects_a_biased_acceptance(tmp_path, monkeypatch):
    """The negative control of the test above, in its setup (eagle3 at temperature 1, fewer runs): tree rounds
    that verify against a biased p (tests/sampled.py) must be rejected."""
    biased_acceptance(monkeypatch)
    target = tiny_model(V, seed=5, logit_scale=0.2, layers=3)
    prompt, n_tok, sampling = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], 4, SamplingConfig(1.0)
    exp = exact_marginals(target, prompt, sampling, n_tok)
    e = engine(target, "eagle3", random_head(target, "eagle3", tmp_path, seed=3), nodes=5, depth=3, topk=2)
    r = sample_runs(lambda i: e, prompt, sampling, n_tok, V, 500)
    assert r.accepted > 0
    assert min(r.pvalues(exp)) < 1e-6, r.pvalues(exp)


def test_static_tree_is_prefix_closed_and_best_first():
    ranks = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths = static_tree(ranks, 8)
    assert paths[:3] == [(0,), (0, 0), (1,)]  # 0.6, 0.24, 0.2
    for i, p in enumerate(paths):
        assert len(p) == 1 or p[:-1] in paths[:i]
    value = [torch.tensor([ranks[d][r] for d, r in enumerate(p)]).prod() for p in paths]
    assert all(a >= b for a, b in zip(value, value[1:]))


def test_method_options_and_errors(tmp_path):
    cfg = parse_method("eagle3:nodes=12,depth=6,topk=3,heads=foo")
    assert (cfg.heads.nodes, cfg.heads.depth, cfg.heads.topk, cfg.heads.name) == (12, 6, 3, "foo")
    with pytest.raises(SpeculantError, match="tree nodes"):
        parse_method("eagle3:nodes=40")
    with pytest.raises(SpeculantError, match="bad method option"):
        parse_method("medusa:branches=2")
    target = tiny_model(32, seed=1)
    with pytest.raises(SpeculantError, match="train-heads"):
        engine(target, "eagle3", tmp_path / "missing")
    folder = random_head(target, "eagle2", tmp_path)
    with pytest.raises(SpeculantError, match="use --method eagle2"):
        engine(target, "eagle3", folder)
    other = tiny_model(32, seed=1, dim=64)
    with pytest.raises(SpeculantError, match="width"):
        engine(other, "eagle2", folder)
