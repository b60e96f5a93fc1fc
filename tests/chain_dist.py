"""The chain methods' distribution check through the whole engine, shared by test_engine_dist*.py.

Speculative sampling through `Engine.generate` reproduces target-only sampling: 3000 seeded runs, each
position's counts against the exact marginals (enumerated with the full-sort reference sampler and
reference penalties, tests/sampled.py) by chi-square.

Four tokens a run (six for the heuristic, governed and auto schedules): the first from the prefill, then a
round drafting up to three, then whatever is left, so accepted, resampled and bonus tokens all appear at
the checked positions. The tiny draft's top probability is 0.3-0.45: a confidence stop of 0 always drafts
(2.7 tokens a run), 0.35 ("conf") stops many drafts early (1.9 a run; Q8_0 models).

The models are Q8_0 (`FMT`) unless a case asks for float32: a block format's pass is one C call over the blocks
(the fused route, as real GGUF models decode), a float32 one goes layer by layer through torch (the row-wise
route); the verification under test is the same on both, and a few cases keep each route.
"""

from collections import Counter

from conftest import tiny_model
from speculant.decoding.engine import Engine
from speculant.methods.base import DraftLength, DraftLengthConfig
from speculant.methods.config import MethodConfig
from speculant.methods.draft_model import DraftModelConfig, window_start
from speculant.methods.governor import GovernorConfig
from speculant.methods.hybrid import HybridConfig
from speculant.methods.lookup import LookupConfig
from speculant.exact.sampler import SamplingConfig
from sampled import sample_runs

V, RUNS, FMT = 4, 3000, "q8_0"


def check_chain_method(method: str, sampling: SamplingConfig, monkeypatch, exact, fmt: str = FMT) -> None:
    """`method` is a method name and a variant ("draft-conf", "hybrid-q8"); `exact` a `sampled.exact_memo()`;
    `fmt` the weight format of target and draft."""
    name, _, variant = method.partition("-")
    # heuristic: 6 tokens, so that a round after a fully accepted one has room to draft more than k=1
    n_tok = 6 if variant in ("heuristic", "governed", "auto") else 4
    kv = {"f16": "f16", "q8": "q8_0"}.get(variant, "f32")
    heads = dict(heads=1, kv_heads=1) if kv == "q8_0" else {}  # q8_0 blocks of 32 values: heads of 32
    target = tiny_model(V, seed=5, logit_scale=0.2, kv_dtype=kv, fmt=fmt, **heads)
    # a block format's rows are blocks of 32 values; at twice the width, a smaller scale keeps the draft's top
    # probabilities about where the confidence stop below needs them (0.31-0.46)
    wide = bool(heads) or fmt != "float32"
    draft = tiny_model(V, seed=6, logit_scale=0.12 if wide else 0.2, dim=32 if wide else 16, layers=1, kv_dtype=kv,
                       fmt=fmt, **heads)
    prompt = [0, 1, 2, 3] * (17 if variant == "window" else 2) + [0, 1]  # repeats, so lookup drafts every round
    window = 4 if variant == "window" else None  # DraftModelConfig.context
    assert variant != "window" or window_start(len(prompt), window) == 64  # the draft skips the first 64
    exp = exact((fmt, kv), target, prompt, sampling, n_tok)
    # hybrid: only 3-gram matches give the draft model a lookup guess to check (one-hot proposals where
    # it agrees), other rounds are the model's alone; plain lookup takes any match so it drafts every round
    confidence = 0.35 if variant == "conf" else 0.0
    lookup = LookupConfig(3, min_ngram=3 if name == "hybrid" else 1)
    length = DraftLengthConfig(k=1, schedule=variant, max_k=3, warmup=1) if variant in ("heuristic", "auto") else \
        DraftLengthConfig(k=3, schedule="fixed")
    dm = DraftModelConfig(min_confidence=confidence, vocab=3 if variant == "vocab" else 0, context=window)
    check = variant if variant in ("always", "never") else "auto"
    governed = variant in ("governed", "auto")
    governor = GovernorConfig("on", probe=2, hold=2, max_hold=4) if governed else GovernorConfig()
    e = Engine(target, draft if name in ("draft", "hybrid") else None,
               MethodConfig(name, length, lookup, dm, HybridConfig(check), governor=governor))
    chosen = Counter()  # the auto schedule's measured choices of k (a spy: the real method runs)
    best = DraftLength.best

    def spy(self):
        k = best(self)
        chosen[k] += 1
        return k

    monkeypatch.setattr(DraftLength, "best", spy)
    r = sample_runs(lambda i: e, prompt, sampling, n_tok, V, RUNS)
    assert r.drafted >= (RUNS if confidence == 0 else RUNS // 4)
    r.check_rounds(governed=governed)  # seeded: the default governor (auto) does not govern
    if variant == "auto":
        assert len(chosen) > 1, chosen  # the measured choice varied k
    else:
        assert not chosen  # untimed or other schedules never measure
    if confidence:
        assert r.drafted < 2 * RUNS  # the stop cut drafts short
    if variant == "heuristic":
        assert r.grew  # from k=1, only the schedule drafts more
    if variant == "vocab":
        assert r.counts[1:, 3].sum() > 0  # the target still emits the id the draft cannot propose
    assert min(r.pvalues(exp)) > 1e-4, r.pvalues(exp)
