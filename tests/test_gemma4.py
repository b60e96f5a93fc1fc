"""Gemma 4 dense text models (tests/tiny_gemma4.py) against transformers and through the speculative methods.

- logits of a 40-token prompt (window 8), batched and token by token: max |diff| <= 1e-4 against transformers
  in float32 (per-layer inputs, KV-shared layers, k_eq_v global layers with their own heads, proportional rotary);
- greedy tokens equal to transformers' incremental decoding;
- short passes in a block format are batch-invariant, a tree row included (the KV-shared layers read their
  source's keys of the same pass);
- lookup, draft and draft_tree (the model drafting for itself) are greedy-identical to ar: rejected drafts roll
  back the shared layers' keys and the sliding windows with the cache;
- what is not run (mixture of experts, a bidirectional encoder) is refused with a SpeculantError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_tokenizer
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.config import MethodConfig
from speculant.methods.base import DraftLengthConfig
from speculant.models import LoadedModel, load_model
from speculant.models.gemma4_load import load_gemma4
from tiny_gemma4 import VARIANTS, VOCAB, save_gemma4

NAMES = tuple(VARIANTS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return lambda name: save_gemma4(root / name, name)


def reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def ref_logits(ref, ids: list[int], **kw):
    # output_hidden_states: transformers 5.24 otherwise slices the KV-shared layers' inputs to logits_to_keep and
    # fails on a model without per-layer inputs (its _maybe_slice_kv_shared_inputs indexes None)
    return ref(torch.tensor([ids]), output_hidden_states=True, **kw)


def prompt(n: int = 40, seed: int = 1) -> list[int]:
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(folders, name):
    folder = folders(name)
    model, ids = load_gemma4(folder, "float32"), prompt()
    with torch.no_grad():
        want = ref_logits(reference(folder), ids).logits[0]
    batched = model(torch.tensor(ids), model.new_cache(64)).logits
    cache = model.new_cache(64)
    one_by_one = torch.cat([model(torch.tensor([t]), cache).logits for t in ids])
    gap = max(float((batched - want).abs().max()), float((one_by_one - want).abs().max()))
    print(f"\ngemma4 {name}: max |logit diff| vs transformers {gap:.2e}")
    assert gap <= 1e-4, gap
    g = model.g
    assert g.base.sliding_window == 8 < len(ids) and g.kv_source == (0, 1, 2, 3, 3, 2)
    assert g.head_dims == (16, 16, 32, 16, 16, 32)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(folders, name):
    folder = folders(name)
    ref, ids = reference(folder), prompt(20, seed=2)
    want, out, x = [], None, ids
    with torch.no_grad():
        for _ in range(24):
            out = ref_logits(ref, x, past_key_values=None if out is None else out.past_key_values, use_cache=True)
            want.append(int(out.logits[0, -1].argmax()))
            x = want[-1:]
    tiny_tokenizer(VOCAB)._backend.save(str(folder / "tokenizer.json"))  # noqa: SLF001 - a folder load_model reads
    lm = load_model(str(folder), "float32", progress=False, use_cache=False)  # through load_model's Gemma 4 hook
    assert type(lm.model).__name__ == "Gemma4Model"
    assert Engine(lm, threads=1).generate(ids, GenerationConfig(max_new_tokens=24)).token_ids == want


@pytest.mark.parametrize("name", NAMES)
def test_short_passes_are_batch_invariant(folders, name):
    model = load_gemma4(folders(name), "q8_0")
    ids = prompt()
    new = torch.tensor([5, 17, 99, 3, 64])
    cache = model.new_cache(64)
    model(torch.tensor(ids), cache)
    n = len(ids)
    batched = model(new, cache).logits
    cache.rollback(n)
    alone = torch.cat([model(new[i : i + 1], cache).logits for i in range(len(new))])
    assert torch.equal(batched, alone)
    cache.rollback(n)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                        dtype=torch.bool)
    tree = model(new, cache, positions=torch.tensor([n, n + 1, n + 2, n + 1, n + 2]), mask=mask).logits
    for path in ([0, 1, 2], [0, 3, 4]):
        cache.rollback(n)
        assert torch.equal(tree[path], model(new[path], cache).logits), path


@pytest.mark.parametrize(("name", "fmt", "kv"), [("ple", "float32", "f32"), ("keqv", "float32", "f32"),
                                                 ("ple", "q8_0", "q8_0"), ("keqv", "q8_0", "f16")])
def test_speculative_methods_are_greedy_identical_to_ar(folders, name, fmt, kv):
    from speculant.models.cache import kv_dtype

    folder = folders(name)
    model = load_gemma4(folder, fmt)
    model.kv_dtype = kv_dtype(kv)
    lm = LoadedModel(name, folder, model, tiny_tokenizer(VOCAB), fmt)
    ids = prompt(12, seed=3) * 2  # a repeat, so lookup finds drafts
    gen = GenerationConfig(max_new_tokens=40)
    cfg = DraftLengthConfig(k=4, schedule="fixed")
    want = Engine(lm, threads=1).generate(ids, gen).token_ids  # one thread: a tiny model's passes are overhead
    assert len(want) == 40
    for method in ("lookup", "draft", "draft_tree"):
        draft = lm if method != "lookup" else None
        got = Engine(lm, draft, MethodConfig(method, cfg), threads=1).generate(ids, gen).token_ids
        assert got == want, method


@pytest.mark.parametrize(("edit", "needle"), [({"enable_moe_block": True}, "mixture-of-experts"),
                                              ({"use_bidirectional_attention": "all"}, "encoder"),
                                              ({"layer_types": ["chunked_attention"] * 6}, "layer_types")])
def test_what_is_not_run_is_refused(folders, tmp_path, edit, needle):
    folder = folders("ple")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    cfg = json.loads((folder / "config.json").read_text()) | edit
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculantError, match=needle):
        load_gemma4(bad, "float32")


def test_published_config_layout():
    """Gemma 4 E2B's config.json as Google publishes it (global_head_dim, no per_layer_config): the KV-shared
    layers read the last earlier sliding (13) and global (14) layers, their MLPs are double-wide, a quarter of a
    global head's frequencies turn; a last layer marked sliding is global, as transformers makes it."""
    from speculant.models.gemma4_config import gemma4_config

    types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    text = dict(model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144,
                num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                sliding_window=512, layer_types=types, num_kv_shared_layers=20, hidden_size_per_layer_input=256,
                vocab_size_per_layer_input=262144, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    g = gemma4_config({"model_type": "gemma4", "text_config": text})
    assert g.kv_source[:15] == tuple(range(15)) and set(g.kv_source[15:]) == {13, 14}
    assert g.kv_source[19] == 14 and g.kv_source[15] == 13 and len(g.kv_slots()) == 15
    assert g.head_dims[:5] == (256,) * 4 + (512,) and g.mlp_hidden[14:16] == (6144, 12288)
    assert sum(f > 0 for f in g.inv_freq(False)) == 64 and len(g.inv_freq(False)) == 256
    g = gemma4_config(text | {"layer_types": types[:-1] + ["sliding_attention"], "num_kv_shared_layers": 0})
    assert not g.base.is_local(34) and g.head_dims[34] == 512
