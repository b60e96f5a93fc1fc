"""The prompt cache: a conversation that goes on reuses its prefill, and the output does not change."""

import pytest
import torch

from conftest import tiny_model
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.governor import GovernorConfig
from speculant.methods.config import MethodConfig
from speculant.methods.base import DraftLengthConfig
from speculant.methods.draft_model import DraftModelConfig, window_start
from speculant.methods.hybrid import HYBRID_DRAFT_CONTEXT
from speculant.errors import SpeculantError
from speculant.models.prompt_cache import PASS_MAX, KeptPrefix, PromptCachePool, common_prefix, pass_starts
from speculant.exact.sampler import SamplingConfig

SEP = 7  # the tiny tokenizer's EOS: a special token, so prefill passes start at it (as at chat messages)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(32, seed=1, logit_scale=3.0, eos=SEP, context=512)
    draft = tiny_model(32, seed=2, logit_scale=3.0, dim=16, layers=1, eos=SEP, context=512)
    return target, draft


def engines(target, draft):
    # every round speculative (no governor), so each turn runs the draft's prefill (deferred to its first draft)
    dl, off = DraftLengthConfig(3, "heuristic", 6), GovernorConfig("off")
    return {
        "ar": Engine(target),
        "lookup": Engine(target, method=MethodConfig("lookup", dl, governor=off)),
        "draft": Engine(target, draft, MethodConfig("draft", dl, governor=off)),
        "hybrid": Engine(target, draft, MethodConfig("hybrid", dl, governor=off)),
        # a draft window of 40 tokens: it moves as the conversation grows (DraftModelConfig.context)
        "draft-window": Engine(target, draft, MethodConfig("draft", dl, draft_model=DraftModelConfig(context=40),
                                                           governor=off)),
    }


# the prompt tokens each method's draft model reads (0: all; hybrid's default window is its last 128 to 191)
DRAFT_CONTEXT = {"draft": 0, "hybrid": HYBRID_DRAFT_CONTEXT, "draft-window": 40}


def conversation():
    """User turns of a chat: each prompt is the previous prompt, its answer, SEP and a new message."""
    return [[SEP, 3, 1, 4, 1, 5, 9, 2, 6] * 6, [SEP, 5, 3, 5, 8, 9] * 3, [SEP, 2, 3, 8, 4, 6, 2, 6, 4, 3] * 5,
            [SEP, 1, 2, 3, 4, 5]]


def test_pass_starts_depend_on_the_prefix_only():
    ids = [1, 2, SEP, 3, 4, SEP, 5] + [6] * (PASS_MAX + 10)
    starts = pass_starts(ids, frozenset({SEP}))
    assert starts == [0, 2, 5, 5 + PASS_MAX]
    for n in range(1, len(ids)):  # the starts within a prefix are the prefix's own starts
        assert [s for s in starts if s < n] == pass_starts(ids[:n], frozenset({SEP}))
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["ar", "lookup", "draft", "hybrid", "draft-window"])
def test_output_with_the_prompt_cache_equals_output_without(pair, method, temperature):
    """Greedy and seeded sampling, every method: each turn of a conversation gives the same tokens with
    the cache as a fresh engine run without it, while the cache reuses the earlier turns' prefill."""
    target, draft = pair
    engine = engines(target, draft)[method]
    gen = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature, seed=5), ignore_eos=True)
    cache = engine.prompt_cache()
    prompt: list[int] = []
    expected = 0  # the previous prompt's last pass start, or its end if the answer opens a pass
    for turn, message in enumerate(conversation()):
        prompt = prompt + message
        with_cache = engine.generate(prompt, gen, cache=cache)
        without = engine.generate(prompt, gen)
        assert with_cache.token_ids == without.token_ids, (method, turn)
        assert without.stats.cached_prompt_tokens == 0
        # Reused up to the start of the previous turn's last message (its answer is prefilled again).
        assert with_cache.stats.cached_prompt_tokens == expected
        if cache.draft is not None:  # the draft's prefill of this turn is kept too: its window of the prompt
            assert cache.draft.tokens == prompt[window_start(len(prompt), DRAFT_CONTEXT[method]):-1], (method, turn)
        expected = len(prompt) if with_cache.token_ids[0] == SEP else max(i for i, t in enumerate(prompt) if t == SEP)
        prompt = prompt + with_cache.token_ids


def test_repeated_prompt_reuses_all_but_the_last_pass_and_repeats_seeded_output(pair):
    target, draft = pair
    engine = engines(target, draft)["hybrid"]
    cache = engine.prompt_cache()
    prompt = sum(conversation(), [])
    gen = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(0.9, seed=11), ignore_eos=True)
    first = engine.generate(prompt, gen, cache=cache)
    again = engine.generate(prompt, gen, cache=cache)
    assert again.token_ids == first.token_ids
    assert again.stats.cached_prompt_tokens == len(prompt) - len(conversation()[-1])
    other = engine.generate(prompt[:20], gen, cache=cache)  # a shorter, different prompt: reuse what matches
    assert other.token_ids == engine.generate(prompt[:20], gen).token_ids
    assert other.stats.cached_prompt_tokens == 18  # the last pass start of prompt[:20] (its SEPs: 0, 9, 18)


def test_kept_prefix_grows_its_cache_and_keeps_the_prefix(pair):
    target, _ = pair
    kept = KeptPrefix(target.model, frozenset({SEP}))
    ids = [3, 4, SEP, 5, 6, SEP, 1]
    kept.prefill(ids, 16, logits=False)
    k_before = kept.cache.k[:, :, :5].clone()
    longer = ids + [SEP] + [2] * 40
    res = kept.prefill(longer, 64, logits=True)
    assert kept.cache.max_len == 64 and res.reused == len(ids)  # ids ended where `longer` starts a pass
    assert (kept.cache.k[:, :, :5] == k_before).all()
    assert res.logits.shape == (1, 32)


def test_interrupted_prefill_leaves_a_valid_prefix(pair):
    """A prefill stopped between passes (Ctrl-C) keeps what it finished; the next one redoes the rest."""
    target, _ = pair
    engine = Engine(target)
    cache = engine.prompt_cache()
    prompt = sum(conversation(), [])
    calls = 0
    model = target.model
    original = type(model).__call__

    class Stop(Exception):
        pass

    def flaky(self, *a, **kw):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Stop
        return original(self, *a, **kw)

    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    type(model).__call__ = flaky
    try:
        with pytest.raises(Stop):
            engine.generate(prompt, gen, cache=cache)
    finally:
        type(model).__call__ = original
    assert 0 < len(cache.target.tokens) < len(prompt)
    assert engine.generate(prompt, gen, cache=cache).token_ids == engine.generate(prompt, gen).token_ids


CHAT = ["Write a Python function that checks whether a number is prime.",
        "Now make it faster for large numbers.",
        "Explain the time complexity in one paragraph.",
        "Write three unit tests for it."]


@pytest.mark.real
@pytest.mark.parametrize("method", ["ar", "draft", "hybrid"])
def test_real_chat_with_the_prompt_cache_equals_output_without(real_model_cache, method):
    """SmolLM2 in its GGUF format drafting for itself: a 4-turn chat gives the same greedy tokens with the cache
    as without it. Where its prompts are batch-invariant (the fused route) each turn reuses everything the
    last one held that the new prompt starts with, the answer included; elsewhere the kernels' last bits
    depend on how a prompt is cut into passes, and it reuses up to a shared pass start."""
    model = real_model_cache("smollm2-135m-instruct", "gguf")
    invariant = model.model.batch_invariant_prompts()
    engine = Engine(model, model if method != "ar" else None, MethodConfig(method))
    tok = engine.tokenizer
    cache = engine.prompt_cache()
    gen = GenerationConfig(max_new_tokens=48)
    messages: list[dict[str, str]] = []
    reused = []
    for text in CHAT:
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(messages), add_special=False)
        held = list(cache.target.tokens)
        with_cache = engine.generate(ids, gen, cache=cache)
        assert with_cache.token_ids == engine.generate(ids, gen).token_ids
        if invariant:
            assert with_cache.stats.cached_prompt_tokens == min(common_prefix(held, ids), len(ids) - 1)
            # the prompt, then the answer but its last token (or all of it, where a stop token ended it unemitted)
            answer = cache.target.tokens[len(ids):]
            assert cache.target.tokens[:len(ids)] == ids and answer == with_cache.token_ids[:len(answer)]
            assert len(answer) >= len(with_cache.token_ids) - 1
        reused.append(with_cache.stats.cached_prompt_tokens / len(ids))
        messages.append({"role": "assistant", "content": with_cache.text})
    assert reused[0] == 0 and min(reused[1:]) > 0.3, reused


@pytest.fixture
def fused_pair(prefill_route):
    """A tiny GGML (q8_0) target and draft on the fused prefill route: batch-invariant prompts."""
    prefill_route("fused")
    target = tiny_model(64, seed=3, fmt="q8_0", dim=64, heads=2, kv_heads=1, logit_scale=3.0, eos=SEP, context=512,
                        kv_dtype="f16")
    draft = tiny_model(64, seed=4, fmt="q8_0", dim=64, heads=2, kv_heads=1, layers=1, logit_scale=3.0, eos=SEP,
                       context=512)
    if not target.model.batch_invariant_prompts():
        pytest.skip("the fused blocks need the x86 kernels")
    return target, draft


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["ar", "draft", "hybrid", "draft_tree"])
def test_batch_invariant_prompts_reuse_the_whole_conversation(fused_pair, method, temperature):
    """On the fused route the cache reuses every token the conversation's last turn held: its prompt and
    the answer decoded after it (all but the answer's last token, never fed), not only up to a pass start;
    the draft model's cache keeps its committed context likewise. Each turn's output equals a fresh run's,
    and the kept keys/values (target's and draft's) equal a fresh prefill's bit for bit."""
    target, draft = fused_pair
    dl, off = DraftLengthConfig(3, "heuristic", 6), GovernorConfig("off")
    engine = Engine(target, None if method == "ar" else draft, MethodConfig(method, dl, governor=off))
    gen = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature, seed=5), ignore_eos=True)
    cache = engine.prompt_cache()
    draft_reused: list[int] = []
    if cache.draft is not None:  # what the draft's prefills reuse
        prefill = cache.draft.prefill
        cache.draft.prefill = lambda *a, **kw: draft_reused.append((r := prefill(*a, **kw)).reused) or r
    prompt: list[int] = []
    lengths: list[int] = []  # of each turn's prompt
    expected = 0
    for turn, message in enumerate(conversation()):
        prompt = prompt + message
        with_cache = engine.generate(prompt, gen, cache=cache)
        assert with_cache.token_ids == engine.generate(prompt, gen).token_ids, (method, turn)
        assert with_cache.stats.cached_prompt_tokens == expected, (method, turn)
        assert cache.target.tokens == prompt + with_cache.token_ids[:-1]
        expected = len(prompt) + len(with_cache.token_ids) - 1
        if cache.draft is not None:  # its window, then the answer as far as the draft committed it
            start = window_start(len(prompt), DRAFT_CONTEXT.get(method, 0))
            held = cache.draft.tokens
            assert held == (prompt + with_cache.token_ids)[start:start + len(held)]
            assert len(held) >= len(prompt) - start  # the window at least (the answer's last rounds may be unfed)
        lengths.append(len(prompt))
        prompt = prompt + with_cache.token_ids
    kept = [cache.target] + ([cache.draft] if cache.draft is not None else [])
    for k in kept:
        fresh = KeptPrefix(k.model, frozenset(), reuse=False)
        fresh.prefill(k.tokens, 512, logits=False)
        n = len(k.tokens)
        assert torch.equal(fresh.cache.k[:, :, :n], k.cache.k[:, :, :n])
        assert torch.equal(fresh.cache.v[:, :, :n], k.cache.v[:, :, :n])
    if method == "draft":  # the whole prompt is its window: each turn reuses the last prompt and (part of) its answer
        assert len(draft_reused) == len(lengths) and draft_reused[0] == 0
        assert all(r > n for r, n in zip(draft_reused[1:], lengths)), (draft_reused, lengths)


def test_decoded_tokens_are_kept_only_where_prompts_are_batch_invariant(fused_pair, prefill_route):
    """Another prefill route (SDPA chunks with gq_gemm) computes a prompt's rows otherwise than decoding
    does: the cache then keeps the prompt alone and reuses up to a shared pass start, as before."""
    target, _ = fused_pair
    prefill_route("gemm")
    assert not target.model.batch_invariant_prompts()
    engine = Engine(target)
    cache = engine.prompt_cache()
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    first = conversation()[0]
    out = engine.generate(first, gen, cache=cache)
    assert cache.target.tokens == first
    again = engine.generate(first + out.token_ids + [SEP, 4], gen, cache=cache)
    shared = len(first) if out.token_ids[0] == SEP else max(i for i, t in enumerate(first) if t == SEP)
    assert again.stats.cached_prompt_tokens == shared


def test_a_pool_keeps_interleaved_conversations(fused_pair):
    """Two conversations taking turns (a server's clients) over a shared system prompt: with two slots each
    turn reuses its own conversation's prompt and answer; with one they evict each other down to the system
    prompt. The output is the same either way."""
    target, _ = fused_pair
    engine = Engine(target)
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    system = [SEP, 1, 2, 3]
    with pytest.raises(SpeculantError, match="slots"):
        PromptCachePool(engine.prompt_cache, 0)
    pool = PromptCachePool(engine.prompt_cache, 2)  # the choice alone, on holdings set by hand
    a = pool.take([1, 2, 3])
    a.target.tokens = [1, 2, 3, 4, 5, 6, 7, 8]  # a prompt and its answer
    assert pool.take([1, 2, 3]) is a and pool.take([1, 2, 3, 4, 5, 6, 7, 8, 9]) is a  # the same again; goes on
    b = pool.take([1, 2, 9])  # shares 2 of a's 8 tokens: a free slot instead
    assert b is not a
    b.target.tokens = [1, 2, 9, 9]
    assert pool.take([5, 5]) is a and pool.caches[1] is b  # nothing shared, no room: the least recently used

    def run(slots: int) -> tuple[list[list[int]], list[int], list[int]]:
        pool = PromptCachePool(engine.prompt_cache, slots)
        prompts = {"a": system + [5, 6, 7, 8, 9], "b": system + [9, 8, 7]}
        outputs, reused, held = [], [], []
        for who in ("a", "b", "a", "b", "a"):
            cache = pool.take(prompts[who])
            held.append(len(cache.target.tokens))
            out = engine.generate(prompts[who], gen, cache=cache)
            outputs.append(out.token_ids)
            reused.append(out.stats.cached_prompt_tokens)
            prompts[who] = prompts[who] + out.token_ids + [SEP, 4, 1 if who == "a" else 2]
        return outputs, reused, held

    two, one = run(2), run(1)
    assert two[0] == one[0]
    assert two[1][:2] == [0, 0] and one[1][:2] == [0, len(system)]  # b's first turn: a free slot, or a's
    for turn in (2, 3, 4):  # each conversation's own last prompt and answer (but its last token)
        assert two[1][turn] == two[2][turn] > len(system)
        assert one[1][turn] == len(system)
