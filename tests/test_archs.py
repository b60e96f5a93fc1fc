"""Qwen3, Gemma 3 and Llama 3.2-style models (tests/tiny_archs.py) against transformers, against their
llama.cpp GGUF conversions, and through every speculative method.

- logits of a 40-token prompt (batched prefill) and of decoding it token by token: max |diff| <= 1e-4
  against transformers in float32; greedy tokens equal to transformers' own incremental decoding;
- short passes in block formats are batch-invariant: a verification pass of k rows, and a tree of drafts,
  give each row the bits of scoring it alone on its path (Gemma's sliding-window layers included: the window is
  applied by position, so a tree row sees the keys its chain would);
- lookup, draft and draft_tree (the model drafting for itself) are greedy-identical to ar, in float32
  and in a block format (q8_0: the fused C blocks, sliding-window layers included);
- the GGUF llama.cpp's converter writes loads to the same logits as the HF folder (skipped with the
  reason where the converter's sdist cannot be fetched).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_tokenizer
from llama_cpp_ref import greedy_tokens, llama_cpp_bin
from parity import greedy_mismatch, reference_greedy
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.methods.base import DraftLengthConfig
from speculant.models import LoadedModel
from speculant.models.build import build_transformer
from speculant.models.load_gguf import GGUFSource
from speculant.models.load_hf import HFSource
from tiny_archs import VOCAB, converter, prompt, reference, save_arch, to_gguf

ALL = ("qwen3", "qwen3-tied", "gemma3", "gemma3-scaled", "smollm3", "llama3.2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return lambda name: save_arch(root / name, name)


def load(folder: Path, fmt: str = "float32"):
    return build_transformer(HFSource(folder), fmt, cache_dir=None, progress=False)


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(folders, name):
    folder = folders(name)
    model, ref, ids = load(folder), reference(folder), prompt()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    batched = model(torch.tensor(ids), model.new_cache(64)).logits
    cache = model.new_cache(64)
    one_by_one = torch.cat([model(torch.tensor([t]), cache).logits for t in ids])
    gap = max(float((batched - want).abs().max()), float((one_by_one - want).abs().max()))
    print(f"\n{name}: max |logit diff| vs transformers {gap:.2e}")
    assert gap <= 1e-4, gap
    cfg = model.cfg
    if name == "smollm3":
        assert cfg.nope_layers == (False, False, False, True, False, False)
    if name.startswith("gemma3"):
        assert cfg.local_layers == (True,) * 5 + (False,) and cfg.sliding_window == 8 < len(ids)


@pytest.mark.parametrize("name", ("qwen3", "gemma3", "gemma3-scaled", "smollm3", "llama3.2"))
def test_greedy_matches_transformers(folders, name):
    folder = folders(name)
    ids = prompt(20, seed=2)
    ref = reference(folder)
    want = reference_greedy(ref, ids, 24)
    lm = LoadedModel(name, folder, load(folder), tiny_tokenizer(VOCAB), "float32")
    got = Engine(lm).generate(ids, GenerationConfig(max_new_tokens=24)).token_ids
    assert got == want
    # the one-pass check the real models' parity tests use agrees with the incremental reference, and finds
    # a token that is not the reference's choice
    assert greedy_mismatch(ref, ids, want) is None
    assert greedy_mismatch(ref, ids, want[:7] + [(want[7] + 1) % VOCAB] + want[8:]) == 7


@pytest.mark.parametrize("fmt", ("q8_0", "q4_0"))  # the block formats' kernels are batch-invariant; torch's float32 GEMM is not
@pytest.mark.parametrize("name", ("qwen3", "gemma3", "gemma3-scaled", "smollm3"))
def test_short_passes_are_batch_invariant(folders, name, fmt):
    model = load(folders(name), fmt)
    ids = prompt()
    new = torch.tensor([5, 17, 99, 3, 64])
    cache = model.new_cache(64)
    model(torch.tensor(ids), cache)
    n = len(ids)
    batched = model(new, cache).logits
    cache.rollback(n)
    alone = torch.cat([model(new[i : i + 1], cache).logits for i in range(len(new))])
    assert torch.equal(batched, alone)
    # a tree: rows 0 -> 1 -> 2 and 0 -> 3 -> 4 (two branches), at positions n + depth
    cache.rollback(n)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                        dtype=torch.bool)
    tree = model(new, cache, positions=torch.tensor([n, n + 1, n + 2, n + 1, n + 2]), mask=mask).logits
    for path in ([0, 1, 2], [0, 3, 4]):
        cache.rollback(n)
        chain = model(new[path], cache).logits
        assert torch.equal(tree[path], chain), path


@pytest.mark.parametrize("fmt", ("float32", "q8_0"))
@pytest.mark.parametrize("name", ("qwen3", "gemma3", "smollm3"))
def test_speculative_methods_are_greedy_identical_to_ar(folders, name, fmt):
    folder = folders(name)
    lm = LoadedModel(name, folder, load(folder, fmt), tiny_tokenizer(VOCAB), fmt)
    ids = prompt(12, seed=3) * 2  # a repeat, so lookup finds drafts
    gen = GenerationConfig(max_new_tokens=40)
    cfg = DraftLengthConfig(k=4, schedule="fixed")
    want = Engine(lm).generate(ids, gen).token_ids
    assert len(want) == 40
    for method in ("lookup", "draft", "draft_tree"):
        draft = lm if method != "lookup" else None
        got = Engine(lm, draft, MethodConfig(method, cfg)).generate(ids, gen).token_ids
        assert got == want, method


CONVERTED = ("qwen3", "gemma3", "smollm3", "llama3.2")


@pytest.fixture(scope="module")
def ggufs(folders) -> dict[str, Path]:
    """The F32 GGUFs llama.cpp's converter writes for CONVERTED's folders, in one converter process."""
    from speculant.hub import speculant_home

    script = converter(speculant_home() / "llama-cpp-python-sdist")
    return dict(zip(CONVERTED, to_gguf([folders(name) for name in CONVERTED], script)))


@pytest.mark.parametrize("name", CONVERTED)
def test_llama_cpp_gguf_conversion_loads_to_the_same_logits(folders, ggufs, name):
    folder, gguf = folders(name), ggufs[name]
    src = GGUFSource(gguf)
    assert src.config.arch == {"qwen3": "qwen3", "gemma3": "gemma3", "smollm3": "smollm3", "llama3.2": "llama"}[name]
    ours_gguf = build_transformer(src, "float32", cache_dir=None, progress=False)
    ours_hf = load(folder)
    ids = prompt()
    a = ours_gguf(torch.tensor(ids), ours_gguf.new_cache(64)).logits
    b = ours_hf(torch.tensor(ids), ours_hf.new_cache(64)).logits
    gap = float((a - b).abs().max())
    print(f"\n{name}: GGUF (F32) vs HF folder max |logit diff| {gap:.2e}")
    assert gap <= 1e-4, gap
    if name == "gemma3":  # the norms are stored with Gemma's 1 added, and the 5:1 pattern is llama.cpp's default
        assert src.config.local_layers == (True,) * 5 + (False,) and src.config.rope_local_base == 10000.0


@pytest.mark.parametrize("name", CONVERTED)
def test_greedy_equals_llama_cpp_on_the_converted_file(ggufs, name):
    """Our greedy tokens on the converted F32 file equal llama.cpp's on the same file, token for token, from a
    prompt of 40 ids: five of Gemma 3's windows of 8, so its local layers drop keys both before and while
    generating."""
    path = ggufs[name]
    model = build_transformer(GGUFSource(path), "float32", cache_dir=None, progress=False)
    lm = LoadedModel(name, path, model, tiny_tokenizer(model.cfg.vocab_size), "float32")
    ids = prompt()
    got = Engine(lm, threads=1).generate(ids, GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
    ref = greedy_tokens(llama_cpp_bin(), path, ids, 24)
    assert ref.prompt == ids
    assert got == ref.tokens, (got, ref.tokens)


# layout change -> words the error must contain
REFUSED = {
    "gemma3 attention soft-capping": ("gemma3", {"attn_logit_softcapping": 50.0}, "soft-capping"),
    "gemma3 bidirectional (an encoder)": ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
    "gemma3 another activation": ("gemma3", {"hidden_activation": "silu"}, "hidden_activation"),
    "gemma3 scaled rotary on local layers": (
        "gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
        "sliding_attention.rope_type"),
    "gemma3 an unknown layer type": ("gemma3", {"layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
    "qwen3 attention_bias": ("qwen3", {"attention_bias": True}, "attention_bias"),
    "qwen3 sliding layers": ("qwen3", {"use_sliding_window": True, "sliding_window": 16,
                                       "layer_types": ["full_attention"] * 5 + ["sliding_attention"]}, "layer 5"),
    "smollm3 malformed no_rope_layers": ("smollm3", {"no_rope_layers": [1, 1]}, "no_rope_layers"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_these_archs_do_not_run_is_refused(folders, case):
    import json

    from speculant.errors import SpeculantError
    from speculant.models.hf_config import config_from_hf

    name, change, words = REFUSED[case]
    raw = json.loads((folders(name) / "config.json").read_text()) | change
    with pytest.raises(SpeculantError, match=words):
        config_from_hf(raw, source="config.json", has_lm_head=True)


@pytest.mark.parametrize("name", ("qwen3", "gemma3", "gemma3-scaled", "smollm3"))
def test_damaged_configs_give_clear_errors(folders, name):
    """The config.json fuzzer's mutations (fuzzing_hf_config.py) of these archs' configs: each parses or
    fails with a SpeculantError, never another exception."""
    import json
    import random

    from fuzzing_hf_config import mutate_tree
    from speculant.errors import SpeculantError
    from speculant.models.hf_config import config_from_hf

    raw = json.loads((folders(name) / "config.json").read_text())
    rng, parsed = random.Random(0), 0
    for _ in range(500):
        damaged = mutate_tree(json.loads(json.dumps(raw)), rng)
        try:
            config_from_hf(damaged, source="config.json", has_lm_head=True)
            parsed += 1
        except SpeculantError:
            pass
    assert 0 < parsed < 500  # some mutations are harmless (a dropped default), many are not
