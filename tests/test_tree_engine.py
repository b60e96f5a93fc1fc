"""Tree rounds through the engine: greedy output identical to `ar`, every sampled position with the
target's distribution (deterministic trees, i.i.d. and without-replacement siblings, penalties),
the hidden states handed to tap drafters, stats."""

import pytest
import torch

from conftest import tiny_model
from speculant.exact.distributions import Dist, draw
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.governor import GovernorConfig
from speculant.methods.config import MethodConfig, parse_method
from speculant.methods.base import FINAL_HIDDEN, DraftLengthConfig, Drafter
from speculant.methods.draft_model import DraftModelConfig
from speculant.methods.draft_tree import DraftTreeConfig
from speculant.methods.lookup import LookupConfig
from speculant.methods.lookup_tree import LookupTreeConfig
from speculant.exact.sampler import SamplingConfig
from speculant.exact.tree import DraftTree
from sampled import exact_memo, sample_runs
from test_engine import PENALTIES, PROMPT

pytestmark = pytest.mark.heavy  # collected first (tests/conftest.py)


class RandomTree(Drafter):
    """Siblings drawn from a fixed distribution r over the vocabulary, `widths[d]` under every node of
    depth d: i.i.d. ('iid', q = r), without replacement ('without', q = r minus earlier siblings), or
    r's top tokens ('topb', q = None). Records what the engine hands it."""

    name = "random_tree"

    def __init__(self, vocab: int, widths: list[int], mode: str, seed: int = 0, taps: tuple[int, ...] = ()) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.r = (torch.randn(vocab, generator=self.g) * 2.0).softmax(-1)  # sharp: siblings often repeat under i.i.d.
        self.vocab, self.widths, self.mode, self.taps = vocab, widths, mode, taps
        n, level = 0, 1
        for w in widths:
            level *= w
            n += level
        self.nodes = n
        self.log: list[tuple] = []
        self.order = self.r.argsort(descending=True)

    def start(self, prompt, hidden=None):
        self.log.append(("start", list(prompt), hidden))

    def propose(self, pending: int, k: int) -> DraftTree:
        tokens, parents, qs = [], [], []
        frontier = [-1]
        for w in self.widths:
            nxt = []
            for par in frontier:
                left = self.r.clone()
                for j in range(w):
                    if len(tokens) >= k:
                        break
                    if self.mode == "topb":
                        x = int(self.order[j])
                    else:
                        q = self.r if self.mode == "iid" else left / left.sum()
                        x = int(draw(Dist(torch.arange(self.vocab)[None], q[None], self.vocab), self.g))
                        qs.append(q)
                        left[x] = 0.0
                    tokens.append(x)
                    parents.append(par)
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        q = None if self.mode == "topb" else Dist(torch.arange(self.vocab).expand(len(qs), -1), torch.stack(qs), self.vocab)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), parents, q)

    def commit(self, accepted, n_drafted, path=None, hidden=None):
        self.log.append(("commit", list(accepted), path, hidden))


def with_drafter(engine: Engine, drafter) -> Engine:
    engine._drafter = lambda *a: drafter
    return engine


def test_greedy_lookup_tree_and_random_trees_match_ar():
    target = tiny_model(32, seed=1, logit_scale=3.0)
    gen = GenerationConfig(max_new_tokens=40)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    for cfg in (LookupTreeConfig(), LookupTreeConfig(branches=2, nodes=5, depth=3), LookupTreeConfig(nodes=31)):
        done = Engine(target, method=MethodConfig("lookup_tree", lookup_tree=cfg)).generate(PROMPT, gen)
        assert done.token_ids == ref, cfg
        assert done.stats.accepted_tokens > 0
    for mode, widths in (("topb", [3, 2, 2]), ("iid", [2, 2, 1]), ("without", [4, 1, 1, 1])):
        done = with_drafter(Engine(target, method=MethodConfig("lookup")), RandomTree(32, widths, mode)).generate(
            PROMPT, gen)
        assert done.token_ids == ref, mode
    # penalties and bias: each row counts its own ancestors
    s = SamplingConfig(0.0, repeat_penalty=1.3, repeat_last_n=4, presence_penalty=0.5, logit_bias={3: 1.0})
    gen = GenerationConfig(max_new_tokens=30, sampling=s)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    assert Engine(target, method=MethodConfig("lookup_tree")).generate(PROMPT, gen).token_ids == ref
    assert with_drafter(Engine(target, method=MethodConfig("lookup")), RandomTree(32, [3, 3], "topb")).generate(
        PROMPT, gen).token_ids == ref


@pytest.mark.parametrize("width", [1, 2, 3])
def test_greedy_draft_tree_matches_ar(width, monkeypatch):
    from speculant.methods import draft_tree

    ends = []  # rounds whose accepted path ends on a runner-up sibling
    commit = draft_tree.DraftTreeDrafter.commit

    def spy(self, accepted, n_drafted, path=None):
        ends.append(bool(path) and path[-1] not in self.chain_nodes)
        return commit(self, accepted, n_drafted, path)

    monkeypatch.setattr(draft_tree.DraftTreeDrafter, "commit", spy)
    target = tiny_model(32, seed=1)
    gen = GenerationConfig(max_new_tokens=60)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    # an unrelated draft (nothing accepted) and the target's own q4_0 twin (mostly right, sometimes second)
    for draft in (tiny_model(32, seed=2, dim=16, layers=1), tiny_model(32, seed=1, fmt="q4_0")):
        for dm in (DraftModelConfig(), DraftModelConfig(0.0)):
            m = MethodConfig("draft_tree", DraftLengthConfig(k=4, max_k=5), draft_model=dm,
                             draft_tree=DraftTreeConfig(width))
            assert Engine(target, draft, m).generate(PROMPT, gen).token_ids == ref
    assert any(ends) == (width > 1)
    assert parse_method("draft_tree:width=3").draft_tree == DraftTreeConfig(3)


def test_tree_stats_and_parse_method():
    target = tiny_model(32, seed=1, logit_scale=3.0)
    done = Engine(target, method=MethodConfig("lookup_tree")).generate(PROMPT, GenerationConfig(max_new_tokens=40))
    st = done.stats
    assert st.rounds + st.paused_rounds + 1 == st.target_forwards
    assert st.emitted_in_rounds + st.paused_rounds + 1 == len(done.token_ids)
    assert st.drafted_tokens > st.accepted_tokens > 0
    m = parse_method("lookup_tree:branches=3,nodes=12,depth=5,ngram=4")
    assert m.name == "lookup_tree" and m.lookup_tree == LookupTreeConfig(3, 12, 5) and m.lookup.max_ngram == 4
    with pytest.raises(Exception, match="tree nodes must be"):
        parse_method("lookup_tree:nodes=40")


def test_tap_drafters_get_the_hidden_states_of_the_context():
    """Rows handed over equal the target's states scored one token at a time (q8_0 is batch-invariant;
    the prompt fits one short pass)."""
    target = tiny_model(32, seed=1, logit_scale=3.0, fmt="q8_0")
    taps = (0, FINAL_HIDDEN)
    for drafter in (RandomTree(32, [3, 2], "topb", taps=taps), RandomTree(32, [1, 1, 1], "topb", taps=taps)):
        e = with_drafter(Engine(target, method=MethodConfig("lookup")), drafter)
        done = e.generate(PROMPT, GenerationConfig(max_new_tokens=20))
        rows = {t: [drafter.log[0][2][t]] for t in taps}
        context = list(drafter.log[0][1])
        for ev in drafter.log[1:]:
            context += ev[1]
            for t in taps:
                rows[t].append(ev[3][t])
                assert ev[3][t].shape[0] == len(ev[1])
        assert context == PROMPT + done.token_ids[: len(context) - len(PROMPT)]
        m = target.model
        cache = m.new_cache(128)
        for i, tok in enumerate(context):
            out = m(torch.tensor([tok]), cache, taps=taps)
            for t in taps:
                assert torch.equal(torch.cat(rows[t])[i], out.taps[t][0]), (i, t)


V, RUNS = 4, 2500


class WrongQ(RandomTree):
    """Siblings drawn without replacement but q = r for all of them (right only for i.i.d. draws)."""

    def propose(self, pending: int, k: int) -> DraftTree:
        tree = super().propose(pending, k)
        n = tree.size
        return DraftTree(tree.tokens, tree.parents, Dist(torch.arange(self.vocab).expand(n, -1),
                                                         self.r.expand(n, -1).clone(), self.vocab))


@pytest.fixture(scope="module")
def exact():
    return exact_memo()


def min_pvalue(drafter: str, sampling: SamplingConfig, exact, fmt: str = "q8_0") -> float:
    """Chi-square of every position against the exact target-only marginals (`exact`: a `sampled.exact_memo()`);
    the smallest p-value. `fmt`: the models' weights (Q8_0 passes take the fused route, float32 ones torch's
    row-wise route: the tree rounds under test are the same on both, and some cases keep each)."""
    target = tiny_model(V, seed=5, logit_scale=0.2, fmt=fmt)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    drafter, _, governed = drafter.partition("-")  # "-governed": plain rounds between tree rounds
    governor = GovernorConfig("on", probe=2, hold=2, max_hold=4) if governed else GovernorConfig()
    n_tok = 5 if governed else 4
    exp = exact(fmt, target, prompt, sampling, n_tok)
    # every run's engine: models keep no run's state (a block format's rows are blocks of 32 values)
    draft = tiny_model(V, seed=6, logit_scale=0.2, dim=16 if fmt == "float32" else 32, layers=1, fmt=fmt)

    def engine_for(i: int) -> Engine:
        if drafter == "lookup_tree":
            return Engine(target, method=MethodConfig("lookup_tree", lookup=LookupConfig(2, 1),
                                                      lookup_tree=LookupTreeConfig(3, 6, 3), governor=governor))
        if drafter == "draft_tree":  # sampled chain tokens with their q, runner-up siblings one-hot
            return Engine(target, draft, MethodConfig("draft_tree", DraftLengthConfig(k=2, schedule="fixed", max_k=2),
                                                      draft_model=DraftModelConfig(0.0), draft_tree=DraftTreeConfig(2),
                                                      governor=governor))
        kind = WrongQ if drafter == "wrong" else RandomTree
        return with_drafter(Engine(target, method=MethodConfig("lookup")),
                            kind(V, [3, 2], "without" if drafter == "wrong" else drafter, seed=i))

    r = sample_runs(engine_for, prompt, sampling, n_tok, V, RUNS)
    r.check_rounds(bool(governed))
    return min(r.pvalues(exp))


FLOAT32 = [("draft_tree", PENALTIES)]  # the case that runs float32 models; the others Q8_0 (min_pvalue)


@pytest.mark.parametrize("drafter, sampling", [
    ("lookup_tree", SamplingConfig(1.0)),
    ("lookup_tree", PENALTIES),
    ("draft_tree", SamplingConfig(1.0)),
    ("draft_tree", PENALTIES),
    ("lookup_tree-governed", SamplingConfig(0.9)),
    ("draft_tree-governed", PENALTIES),
    ("topb", SamplingConfig(0.9, top_k=3)),
    ("iid", SamplingConfig(1.0, top_p=0.9)),
    ("without", SamplingConfig(1.0)),
    ("without", PENALTIES),
    ("iid", PENALTIES),
])
def test_every_position_has_the_targets_distribution(drafter, sampling, exact):
    fmt = "float32" if (drafter, sampling) in FLOAT32 else "q8_0"
    assert min_pvalue(drafter, sampling, exact, fmt) > 1e-4


def test_the_distribution_check_catches_a_wrong_q(exact):
    assert min_pvalue("wrong", SamplingConfig(1.0), exact) < 1e-6


@pytest.mark.real
def test_real_smollm2_tree_rounds_match_ar(real_model_cache):
    target = real_model_cache("smollm2-135m-instruct", "gguf")
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    ref = Engine(target).generate(prompt, gen)
    tree = Engine(target, method=parse_method("lookup_tree:branches=4,nodes=16")).generate(prompt, gen)
    assert tree.token_ids == ref.token_ids and tree.stats.accepted_tokens > 0
    rand = with_drafter(Engine(target, method=MethodConfig("lookup")),
                        RandomTree(target.config.vocab_size, [4, 2, 1], "topb", taps=(FINAL_HIDDEN,)))
    assert rand.generate(prompt, gen).token_ids == ref.token_ids
