"""The real Gemma 3 270M (`speculant pull gemma3-270m`: Q4_K_M, its Q5_0 / Q4_K / Q6_K / Q8_0 blocks as the
file stores them; 15 of its 18 layers slide over 512 positions): its config and tokenizer as the file
says, and every method greedy-identical to ar on it past the window (a prompt of more than 512 tokens)."""

from __future__ import annotations

import pytest

from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.methods.base import DraftLengthConfig


@pytest.fixture(scope="module")
def gemma(real_model_cache):
    return real_model_cache("gemma3-270m", "gguf")


def test_the_file_reads_as_gemma3(gemma):
    cfg = gemma.config
    assert cfg.arch == "gemma3" and cfg.vocab_size == 262144 and cfg.tie_embeddings
    assert cfg.sliding_window == 512 and cfg.local_layers == ((True,) * 5 + (False,)) * 3
    text = "The capital of France is\n\ndef f(x):\n    return x  # naïve café 東京"
    ids = gemma.tokenizer.encode(text)
    assert ids[0] == gemma.tokenizer.bos_id == 2  # Gemma needs its <bos>
    assert gemma.tokenizer.decode(ids, skip_special=True) == text


def test_methods_match_ar_past_the_sliding_window(gemma):
    text = " ".join(f"Item {i}: the value is {i * 7 % 13}." for i in range(60))  # ~ 600 tokens, repetitive
    ids = gemma.tokenizer.encode(text)
    assert len(ids) > 512
    gen = GenerationConfig(max_new_tokens=16)
    want = Engine(gemma).generate(ids, gen).token_ids
    cfg = DraftLengthConfig(k=4, schedule="fixed")
    # the 270M drafts for itself (the only Gemma model here with its tokenizer)
    for method, draft in (("lookup", None), ("lookup_tree", None), ("draft", gemma), ("hybrid", gemma),
                          ("draft_tree", gemma)):
        got = Engine(gemma, draft, MethodConfig(method, cfg)).generate(ids, gen).token_ids
        assert got == want, method
