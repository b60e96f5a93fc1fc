"""The decoding loop on tiny random models: every method is exact, stops land right, seeds repeat (sampled
output's distribution: test_engine_dist*.py)."""

import pytest
import torch

from conftest import tiny_model
from speculant.decoding.engine import Chunk, Done, Engine, GenerationConfig
from speculant.methods.config import MethodConfig, parse_method
from speculant.errors import SpeculantError
from speculant.methods.base import DraftLengthConfig
from speculant.models.cache import kv_dtype as kv_dtype_of
from speculant.methods.draft_model import DraftModelConfig, DraftModelDrafter, reduced_head
from speculant.methods.hybrid import HybridConfig, HybridDrafter
from speculant.methods.lookup import LookupConfig, LookupDrafter
from speculant.exact.sampler import Sampler, SamplingConfig
from test_sampling import INF, reference_adjust

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(32, seed=1, logit_scale=3.0)
    draft = tiny_model(32, seed=2, logit_scale=3.0, dim=16, layers=1)
    return target, draft


def engines(target, draft, **dl):
    cfg = DraftLengthConfig(**dl) if dl else DraftLengthConfig()
    return {
        "ar": Engine(target),
        "lookup": Engine(target, method=MethodConfig("lookup", cfg)),
        "draft": Engine(target, draft, MethodConfig("draft", cfg)),
        "self": Engine(target, target, MethodConfig("draft", cfg)),
        "confident": Engine(target, draft, MethodConfig("draft", cfg, draft_model=DraftModelConfig(0.5))),
        "hybrid": Engine(target, draft, MethodConfig("hybrid", cfg)),
        "hybrid-2": Engine(target, draft, MethodConfig("hybrid", cfg, LookupConfig(max_ngram=3, min_ngram=2))),
        "hybrid-always": Engine(target, draft, MethodConfig("hybrid", cfg, hybrid=HybridConfig("always"))),
        "hybrid-never": Engine(target, draft, MethodConfig("hybrid", cfg, hybrid=HybridConfig("never"))),
        # the draft reads only the prompt's last 5 tokens (PROMPT has 15)
        "draft-context": Engine(target, draft, MethodConfig("draft", cfg, draft_model=DraftModelConfig(context=5))),
    }


@pytest.mark.parametrize("schedule", ["fixed", "heuristic", "auto"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_identical_for_every_method(pair, k, schedule):
    target, draft = pair
    gen = GenerationConfig(max_new_tokens=40)
    # auto: greedy runs are timed, so after the first round every k is the measured choice
    outs = {name: e.generate(PROMPT, gen)
            for name, e in engines(target, draft, k=k, schedule=schedule, max_k=8, warmup=1).items()}
    ref = outs["ar"].token_ids
    assert len(ref) == 40
    for name, done in outs.items():
        assert done.token_ids == ref, name
    assert outs["self"].stats.acceptance_rate == 1.0  # a model drafting for itself accepts everything
    assert outs["self"].stats.target_forwards < 40


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_greedy_output_identical_for_every_method_with_smaller_caches(kv):
    """--kv-dtype f16 or q8_0 (target and draft): every method's output is still ar's, token for token. Heads of
    32 values (q8_0's block), 2 of them in the target."""
    target = tiny_model(32, seed=1, logit_scale=3.0, dim=64, heads=2, kv_heads=1, kv_dtype=kv)
    draft = tiny_model(32, seed=2, logit_scale=3.0, dim=32, heads=1, kv_heads=1, layers=1, kv_dtype=kv)
    gen = GenerationConfig(max_new_tokens=40)
    outs = {name: e.generate(PROMPT, gen) for name, e in engines(target, draft, k=3, max_k=8, warmup=1).items()}
    ref = outs["ar"].token_ids
    assert len(ref) == 40 and target.model.new_cache(4).k.dtype == kv_dtype_of(kv)
    for name, done in outs.items():
        assert done.token_ids == ref, name
    assert outs["self"].stats.acceptance_rate == 1.0


def test_greedy_with_penalties_and_bias_is_identical_for_every_method(pair):
    """Greedy decoding takes the top token after logit bias and penalties: every method emits what a
    token-by-token loop over the reference penalties emits."""
    target, draft = pair
    sampling = SamplingConfig(0.0, repeat_penalty=1.8, repeat_last_n=4, presence_penalty=0.5, frequency_penalty=0.5,
                              logit_bias={7: -INF, 11: 0.5})
    gen = GenerationConfig(max_new_tokens=30, sampling=sampling)
    ctx = list(PROMPT)
    for _ in range(30):
        c = target.model.new_cache(64)
        logits = target.model(torch.tensor(ctx), c, logit_rows=slice(-1, None)).logits[0]
        ctx.append(int(reference_adjust(logits, sampling, ctx).argmax()))
    ref = ctx[len(PROMPT):]
    assert ref != Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=30)).token_ids  # they matter
    assert 7 not in ref
    for name, e in engines(target, draft, k=3, schedule="heuristic", max_k=6).items():
        assert e.generate(PROMPT, gen).token_ids == ref, name


def test_stats_are_consistent(pair):
    target, draft = pair
    done = Engine(target, draft, MethodConfig("draft")).generate(PROMPT, GenerationConfig(max_new_tokens=30))
    s = done.stats
    assert s.generated_tokens == 30 and s.prompt_tokens == len(PROMPT)
    # the governor's plain rounds (if it found them faster) are counted apart from the speculative ones
    assert s.rounds + s.paused_rounds == s.target_forwards - 1 and s.rounds == sum(s.accepted_length_histogram)
    assert s.accepted_tokens == sum(i * c for i, c in enumerate(s.accepted_length_histogram))
    assert s.emitted_in_rounds + s.paused_rounds == 29  # the prefill gave the first token
    assert s.mean_accepted_tokens == pytest.approx(s.emitted_in_rounds / s.rounds)


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_the_drafts_deferred_prompt_prefill_counts_as_prefill(pair, method, monkeypatch):
    """The draft model prefills its prompt at the first speculative round (draft_model.py: ready): that is
    the generation's prefill, and decode seconds (decode tok/s, `bench methods`' decode speedup) leave it out."""
    import time

    from speculant.methods.draft_model import DraftModelDrafter

    target, draft = pair
    begin, calls = DraftModelDrafter._begin, []

    # The pause must dwarf 12 tiny decode steps even on a loaded machine (two test workers on two cores).
    pause = 2.0

    def slow_begin(self):
        calls.append(1)
        time.sleep(pause)
        begin(self)

    monkeypatch.setattr(DraftModelDrafter, "_begin", slow_begin)
    s = Engine(target, draft, MethodConfig(method)).generate(PROMPT, GenerationConfig(max_new_tokens=12)).stats
    assert calls == [1] and s.rounds > 0
    assert s.prefill_seconds >= pause > s.decode_seconds


@pytest.mark.parametrize("method", ["ar", "lookup", "draft", "hybrid"])
def test_stop_token_in_the_middle_of_an_accepted_run(pair, method):
    target, draft = pair
    e = engines(target, draft)["self" if method == "draft" else method]
    ref = Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=40)).token_ids
    stop = ref[17]
    first = ref.index(stop)
    done = e.generate(PROMPT, GenerationConfig(max_new_tokens=40, stop_token_ids=(stop,)))
    assert done.token_ids == ref[:first] and done.finish_reason == "stop"
    for n in (1, 2, 7, 23):
        done = e.generate(PROMPT, GenerationConfig(max_new_tokens=n))
        assert done.token_ids == ref[:n] and done.finish_reason == "length"


def test_stop_strings_cut_text_and_stream_equals_final_text(pair):
    target, _ = pair
    e = Engine(target, target, MethodConfig("draft"))
    full = Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=30)).text
    words = full.split()
    stop = " ".join(words[5:7])
    events = list(e.stream(PROMPT, GenerationConfig(max_new_tokens=30, stop_strings=(stop,))))
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert done.text == full[: full.find(stop)]
    assert "".join(ev.text for ev in events if isinstance(ev, Chunk)) == done.text


@pytest.mark.parametrize("method", ["ar", "lookup", "draft", "hybrid"])
def test_seeded_sampling_repeats_exactly(pair, method):
    target, draft = pair
    e = engines(target, draft)[method]
    gen = GenerationConfig(max_new_tokens=25, sampling=SamplingConfig(0.9, top_k=20, top_p=0.95, seed=42))
    a, b = e.generate(PROMPT, gen), e.generate(PROMPT, gen)
    assert a.token_ids == b.token_ids
    others = [e.generate(PROMPT, GenerationConfig(max_new_tokens=25, sampling=SamplingConfig(0.9, top_k=20, top_p=0.95,
                                                                                           seed=s))).token_ids
              for s in (43, 44, 45)]
    assert any(o != a.token_ids for o in others)  # the tiny model is sharp: two seeds can agree


# Penalties over a 3-token window: the counts change inside every drafted run (k=3), and tokens leave the
# window as drafts enter it (the tree and head methods' distribution tests sample with it too).
PENALTIES = SamplingConfig(1.0, repeat_penalty=1.5, repeat_last_n=3, presence_penalty=1.0, frequency_penalty=0.8)


def test_bad_inputs_are_clear_errors(pair):
    target, draft = pair
    e = Engine(target)
    with pytest.raises(SpeculantError, match="empty"):
        e.generate("   ")
    with pytest.raises(SpeculantError, match="empty"):
        e.generate([])
    with pytest.raises(SpeculantError, match="context"):
        e.generate(list(range(32)) * 10)
    with pytest.raises(SpeculantError, match="max tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(SpeculantError, match="needs a draft"):
        Engine(target, None, MethodConfig("draft"))
    with pytest.raises(SpeculantError, match="unknown method"):
        MethodConfig("medusa-9000")
    other = tiny_model(40, seed=3)
    with pytest.raises(SpeculantError, match="vocabulary"):
        Engine(target, other, MethodConfig("draft"))


def test_generation_stops_at_the_end_of_the_context():
    target = tiny_model(16, context=24)
    done = Engine(target, target, MethodConfig("draft")).generate(list(range(10)), GenerationConfig(max_new_tokens=100))
    assert done.finish_reason == "length" and 10 + len(done.token_ids) <= 25
    ref = Engine(target).generate(list(range(10)), GenerationConfig(max_new_tokens=100))
    assert ref.token_ids == done.token_ids


def test_reduced_draft_vocabulary_stays_exact(pair):
    target, draft = pair
    gen = GenerationConfig(max_new_tokens=30)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    e = Engine(target, draft, MethodConfig("draft", draft_model=DraftModelConfig(vocab=12)))
    done = e.generate(PROMPT, gen)
    assert done.token_ids == ref
    sampled = e.generate(PROMPT, GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(1.0, seed=5)))
    assert len(sampled.token_ids) == 30


def test_parse_method_variants():

    m = parse_method("draft:k=3,schedule=fixed,conf=0.4,vocab=32768")
    assert (m.name, m.draft_length.k, m.draft_length.schedule) == ("draft", 3, "fixed")
    assert (m.draft_model.min_confidence, m.draft_model.vocab) == (0.4, 32768)
    assert parse_method("lookup:ngram=5,k=20").draft_length.limit() == 20
    with pytest.raises(SpeculantError, match="bad method option"):
        parse_method("draft:speed=11")
    with pytest.raises(SpeculantError, match="must be int"):
        parse_method("draft:k=many")
    with pytest.raises(SpeculantError, match="unknown method"):
        parse_method("mystery:k=2")


def test_a_guess_checked_by_the_draft_saves_forwards_but_not_tokens(pair):
    """Hybrid hands prompt lookup's continuation to the draft model as a guess: one forward scores it,
    and the leading tokens the draft agrees with are its proposal, as if it had drafted them one by one."""
    target, draft = pair
    calls = []
    model = draft.model

    def counting(*a, **kw):
        calls.append(a[0].shape[0])
        return type(model).forward(model, *a, **kw)

    def drafter():
        d = DraftModelDrafter(model, Sampler(SamplingConfig(0.0), 32), DraftModelConfig(min_confidence=0.0), 64, 32)
        d.start(PROMPT)
        return d

    plain = drafter().propose(7, 5).tokens.tolist()
    assert len(plain) == 5
    for agree in range(5):
        guess = plain[:agree] + [(plain[agree] + 1) % 32] + plain[agree + 1 :]
        d = drafter()
        calls.clear()
        model.forward = counting
        try:
            got = d.propose(7, 5, guess=guess).tokens.tolist()
        finally:
            del model.forward
        assert got == plain, agree
        assert calls[0] == len(PROMPT) - 1  # the prompt's prefill, deferred to the first draft
        calls.pop(0)
        assert len(calls) == 5 - agree and calls[0] == 1 + 1 + min(len(guess), 4)  # unfed + pending + guess
        # the draft's cache holds what propose() promises: the context, pending and all drafts but the last
        d.commit([7] + got, len(got))
        fresh = DraftModelDrafter(model, Sampler(SamplingConfig(0.0), 32), DraftModelConfig(min_confidence=0.0), 64, 32)
        fresh.start(PROMPT + [7] + got)
        assert torch.equal(d.propose(11, 3).tokens, fresh.propose(11, 3).tokens)


class _FixedGuess(LookupDrafter):
    """Prompt lookup that always guesses token 31 (which the 16-id draft below never proposes)."""

    def guess(self, pending: int, k: int) -> list[int]:
        return [31] * k


@pytest.mark.parametrize("lookup_right", [True, False])
def test_auto_hybrid_sends_guesses_unchecked_only_while_they_yield_more(pair, lookup_right):
    """check="auto" weighs what unchecked guesses would have given against the checked rounds'
    tokens per cost. A simulated target accepts either the guesses or the draft's own tokens."""
    _, draft = pair
    cfg = DraftModelConfig(min_confidence=0.0, vocab=16)
    model = DraftModelDrafter(draft.model, Sampler(SamplingConfig(0.0), 32), cfg, 256, 32, reduced_head(draft.model, cfg))
    h = HybridDrafter(_FixedGuess(LookupConfig()), model, HybridConfig("auto", explore=8), draft_cost=0.3)
    h.start(PROMPT)
    pending, checked = 7, 0
    for _ in range(24):
        tokens = h.propose(pending, 4).tokens.tolist()
        assert len(tokens) == 4
        checked += h.checked
        n = 0
        while n < 4 and (tokens[n] == 31) == lookup_right:
            n += 1
        h.commit([pending] + tokens[:n], len(tokens))
        pending = 5
    if lookup_right:  # the first round (no numbers yet) and every 8th guess round are checked
        assert checked == 1 + 24 // 8
    else:  # unchecked guesses would yield 1 token per round; checked ones 5 for 1 + 4 x 0.3 steps
        assert checked == 24
