"""Speculative decoding on the real default models: exact greedy output, self-drafting, seeded sampling."""

import pytest

from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.methods.draft_model import DraftModelConfig
from speculant.exact.sampler import SamplingConfig

pytestmark = [pytest.mark.real, pytest.mark.heavy]

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = [
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "import numpy as np\n\ndef softmax(x):\n",
    "The three laws of robotics are",
]


# first in the file: the real-model cache still holds its two models for the gguf tests that follow
def test_every_method_matches_autoregressive_greedy_with_a_q8_0_cache(real_model_cache, monkeypatch):
    """--kv-dtype q8_0 (target and draft: heads of 128 and 64 values, 4 and 2 blocks) on the real models: draft,
    lookup and hybrid still emit ar's tokens."""
    import torch

    target, draft = real_model_cache(TARGET, "gguf"), real_model_cache(DRAFT, "q4_0")
    for m in (target, draft):
        monkeypatch.setattr(m.model, "kv_dtype", torch.int8)  # cache.KV_DTYPES["q8_0"]; restored after the test
    assert target.model.new_cache(4).c_type == draft.model.new_cache(4).c_type == 2
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    ref = Engine(target).generate(PROMPTS[0], gen)
    for method in ("draft", "lookup", "hybrid"):
        done = Engine(target, draft if method != "lookup" else None, MethodConfig(method)).generate(PROMPTS[0], gen)
        assert done.token_ids == ref.token_ids, method
        assert done.stats.target_forwards < ref.stats.target_forwards, method


@pytest.fixture(scope="module", params=[("gguf", "q4_0"), ("int8", "int8")], ids=["gguf", "int8"])
def models(request, real_model_cache):
    # Exactness is relative to the target as it runs, in each fast weight format; the draft in its default
    # format beside a .gguf target (models.draft_dtype: Q4_0 for the 0.5B's Q5_0 file).
    target, draft = request.param
    return real_model_cache(TARGET, target), real_model_cache(DRAFT, draft)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_draft_lookup_and_hybrid_match_autoregressive_greedy(models, prompt):
    target, draft = models
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    ref = Engine(target).generate(prompt, gen)
    assert len(ref.token_ids) == 64
    spec = Engine(target, draft, MethodConfig("draft")).generate(prompt, gen)
    look = Engine(target, method=MethodConfig("lookup")).generate(prompt, gen)
    hybrid = Engine(target, draft, MethodConfig("hybrid")).generate(prompt, gen)
    assert spec.token_ids == ref.token_ids
    assert look.token_ids == ref.token_ids
    assert hybrid.token_ids == ref.token_ids
    assert spec.stats.accepted_tokens > 0 and spec.stats.target_forwards < ref.stats.target_forwards


def test_model_drafting_for_itself_accepts_everything(models):
    _, draft = models
    # the full vocabulary: a draft restricted to the first ids (the default) could not propose the rest
    method = MethodConfig("draft", draft_model=DraftModelConfig(vocab=0))
    done = Engine(draft, draft, method).generate(PROMPTS[1], GenerationConfig(max_new_tokens=48, ignore_eos=True))
    assert done.stats.drafted_tokens > 0
    assert done.stats.acceptance_rate == 1.0


def test_seeded_sampling_repeats_on_real_models(models):
    target, draft = models
    e = Engine(target, draft, MethodConfig("draft"))
    gen = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.8, top_k=40, top_p=0.95, seed=3))
    a, b = e.generate(PROMPTS[2], gen), e.generate(PROMPTS[2], gen)
    assert a.token_ids == b.token_ids and a.text == b.text
