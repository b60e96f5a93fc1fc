"""Parity with an independent reference: HF transformers loading the same GGUF file in float32.

Our float32 path must give the same logits (up to float rounding) and the same greedy continuation.
"""

import pytest
import torch
from parity import greedy_mismatch, hf_gguf_loading, logit_gap

from speculant.decoding.engine import Engine, GenerationConfig
from speculant.hub import resolve_model

pytestmark = [pytest.mark.real, pytest.mark.heavy]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def pair(request, real_model_cache):
    from transformers import AutoModelForCausalLM

    name = request.param
    path = resolve_model(name)
    with hf_gguf_loading():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    yield name, real_model_cache(name, "float32"), hf
    del hf


def test_logits_match_transformers(pair):
    name, ours, hf = pair
    worst, agree, total = logit_gap(ours, hf, [ours.tokenizer.encode(text) for text in PROMPTS])
    print(f"\n{name}: max |logit diff| = {worst:.2e}, top-1 agreement = {agree}/{total}")
    assert worst < 2e-3
    assert agree == total


def test_greedy_continuation_matches_transformers(pair):
    name, ours, hf = pair
    engine = Engine(ours)
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        done = engine.generate(ids, GenerationConfig(max_new_tokens=32, ignore_eos=True))
        assert len(done.token_ids) == 32 and greedy_mismatch(hf, ids, done.token_ids) is None, (name, text)


def test_bench_peers_run_transformers_generate_with_each_method(real_model_cache):
    """`bench methods --against transformers`: its plain, assisted and prompt-lookup generate calls give
    the target's greedy tokens (SmolLM2 as its own assistant), as our float32 engine does."""
    from speculant.bench.peers import TransformersPeers

    name = "smollm2-135m-instruct"
    ours = real_model_cache(name, "float32")
    path = resolve_model(name)
    with hf_gguf_loading():
        peers = TransformersPeers(path, path, ours.tokenizer.eos_id)
    assert peers.methods == ("hf-ar", "hf-assisted", "hf-lookup")
    ids = ours.tokenizer.encode(PROMPTS[1])
    ref = Engine(ours).generate(ids, GenerationConfig(max_new_tokens=16, ignore_eos=True)).token_ids
    for method in peers.methods:
        tokens, seconds = peers.generate(method, ids, 16)
        assert tokens == ref, method
        assert seconds > 0
