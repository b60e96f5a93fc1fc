"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) from an HF folder: logits against transformers, batch
invariance of its recurrent passes, a cache that rolls back exactly, and greedy identity of every chain method."""

import random

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from qwen35_tiny import VOCAB, prompt, reference, save_qwen35
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.config import MethodConfig
from speculant.models import LoadedModel, load_model
from speculant.models import qwen35
from speculant.models.load_qwen35 import load_qwen35
from speculant.models.qwen35_config import is_qwen35_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny")


@pytest.fixture(scope="module")
def model(folder):
    return load_qwen35(folder, "float32", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("n", [1, 7, 40, 300])
def test_logits_match_transformers(folder, model, n):
    ids = prompt(n)
    with torch.no_grad():
        want = reference(folder)(torch.tensor([ids])).logits[0]
    got = model(torch.tensor(ids), model.new_cache(n + 1)).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert want.abs().max().item() > 0.1  # logits that say something


def test_load_model_reads_the_folder(folder, model):
    loaded = load_model(str(folder), progress=False, use_cache=False)
    assert loaded.dtype == "float32" and loaded.model.cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert loaded.tokenizer.encode("t5 t7", add_special=False) == [5, 7]
    ids = torch.tensor(prompt(9))
    assert torch.equal(loaded.model(ids, loaded.model.new_cache(9)).logits, model(ids, model.new_cache(9)).logits)


@pytest.mark.parametrize("route", ["native", "torch"])
def test_a_pass_of_k_rows_is_k_one_token_passes_bit_for_bit(model, route, monkeypatch):
    if route == "native" and qwen35.layer_kernels() is None:
        pytest.skip("the x86 kernels do not run here")
    if route == "torch":  # the layers' torch ops (the route where delta.c's layer calls do not run)
        monkeypatch.setattr(qwen35, "layer_kernels", lambda: None)
    ids = prompt(20)
    a, b = model.new_cache(40), model.new_cache(40)
    model(torch.tensor(ids[:12]), a)
    model(torch.tensor(ids[:12]), b)
    together = model(torch.tensor(ids[12:]), a).logits
    alone = torch.cat([model(torch.tensor([t]), b).logits for t in ids[12:]])
    assert torch.equal(together, alone)
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_layer_kernels_serve_and_agree_with_the_torch_ops(model, monkeypatch):
    """Where delta.c builds, each DeltaNet layer and each short pass's gated attention is its one C call, and the
    logits and caches are those of the torch ops to float tolerance (exp and the sums' order differ)."""
    if qwen35.layer_kernels() is None:
        pytest.skip("the x86 kernels do not run here")
    calls = {"deltanet": 0, "attention": 0}
    layer, attend = qwen35.deltanet_layer, qwen35.GatedAttention._attend_native

    def counted_layer(*a, **k):
        calls["deltanet"] += 1
        return layer(*a, **k)

    def counted_attend(*a, **k):
        calls["attention"] += 1
        return attend(*a, **k)

    monkeypatch.setattr(qwen35, "deltanet_layer", counted_layer)
    monkeypatch.setattr(qwen35.GatedAttention, "_attend_native", counted_attend)
    ids = torch.tensor(prompt(12))
    a, b = model.new_cache(20), model.new_cache(20)
    native = torch.cat([model(ids[:8], a).logits, model(ids[8:], a).logits])
    assert calls == {"deltanet": 6, "attention": 2}  # 3 + 1 layers, two short passes
    monkeypatch.setattr(qwen35, "layer_kernels", lambda: None)
    ops = torch.cat([model(ids[:8], b).logits, model(ids[8:], b).logits])
    assert calls == {"deltanet": 6, "attention": 2}
    assert not torch.equal(native, ops)  # the two routes did run: their last bits differ
    assert torch.allclose(native, ops, atol=1e-5, rtol=1e-5) and native.abs().max() > 0.1
    sa, sb = a.snapshot(), b.snapshot()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-5, rtol=1e-4) for k in sa)


def test_rollback_restores_the_cache_of_plain_decoding(model):
    """Rounds of 1 + k rows, partly accepted (every pattern, random), rolled back: after each, the cache (keys,
    values, convolution windows, recurrent states) equals bit for bit that of feeding the same tokens one by one."""
    rng = random.Random(0)
    ids = prompt(8)
    spec, plain = model.new_cache(200), model.new_cache(200)
    model(torch.tensor(ids), spec)
    model(torch.tensor(ids), plain)
    stream = prompt(150, seed=7)
    pos = 0
    for round_ in range(40):
        k = rng.randint(0, 6)
        rows = stream[pos : pos + k + 1]
        base = spec.length
        model(torch.tensor(rows), spec)
        n = rng.randint(0, len(rows) - 1)  # drafts accepted: the pending token and n drafts stay
        spec.rollback(base + 1 + n)
        for t in rows[: n + 1]:
            model(torch.tensor([t]), plain)
        pos += n + 1
        a, b = spec.snapshot(), plain.snapshot()
        assert all(torch.equal(a[key], b[key]) for key in a), f"round {round_}"
    assert spec.length == plain.length == 8 + pos


def test_rollback_past_the_last_pass_is_refused(model):
    cache = model.new_cache(50)
    model(torch.tensor(prompt(10)), cache)
    model(torch.tensor(prompt(3, 2)), cache)
    with pytest.raises(SpeculantError, match="last pass"):
        cache.rollback(5)
    cache.rollback(0)  # an empty cache is always reachable
    assert all(not s.any() for s in cache.state)


def test_trees_are_refused(model):
    with pytest.raises(SpeculantError, match="chain"):
        model(torch.tensor([1, 2]), model.new_cache(10), mask=torch.ones(2, 2, dtype=torch.bool).tril())
    with pytest.raises(SpeculantError, match="chain"):
        model.new_cache(10).keep(0, torch.tensor([0]))
    target = LoadedModel("qwen35", None, model, tiny_tokenizer(VOCAB), "float32")
    with pytest.raises(SpeculantError, match="trees"):
        Engine(target, method=MethodConfig("lookup_tree"))


def test_greedy_output_of_every_chain_method_is_ar(folder, model):
    target = LoadedModel("qwen35", folder, model, tiny_tokenizer(VOCAB), "float32")
    draft = tiny_model(VOCAB, seed=3)
    ids = prompt(30) + prompt(10, 2) * 3  # repeats: lookup drafts
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    want = Engine(target).generate(ids, gen).token_ids
    assert len(want) == 40
    for eng in (Engine(target, method=MethodConfig("lookup")), Engine(target, draft, MethodConfig("draft")),
                Engine(target, draft, MethodConfig("hybrid"))):
        done = eng.generate(ids, gen)
        assert done.token_ids == want, eng.method.name
        # twice through one prompt cache: no state is reused from the first generation
        pc = eng.prompt_cache()
        assert eng.generate(ids, gen, cache=pc).token_ids == want
        assert eng.generate(ids + want[:5], gen, cache=pc).token_ids == Engine(target).generate(ids + want[:5], gen).token_ids


def test_moe_is_refused():
    with pytest.raises(SpeculantError, match="mixture-of-experts"):
        is_qwen35_hf({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]})
    assert is_qwen35_hf({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"})
    assert not is_qwen35_hf({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})


def test_block_formats_are_batch_invariant_and_close(folder, model):
    """The linears in a GGML block format (q8_0 here, with the f16 KV cache it defaults to): a k-row pass is still k
    one-token passes bit for bit, and the logits stay near float32's."""
    q8 = load_model(str(folder), "q8_0", progress=False, use_cache=False).model
    ids = prompt(20)
    a, b = q8.new_cache(40), q8.new_cache(40)
    q8(torch.tensor(ids[:12]), a)
    q8(torch.tensor(ids[:12]), b)
    together = q8(torch.tensor(ids[12:]), a).logits
    assert torch.equal(together, torch.cat([q8(torch.tensor([t]), b).logits for t in ids[12:]]))
    want = model(torch.tensor(ids), model.new_cache(40)).logits[12:]
    assert 0 < (together - want).abs().max().item() < 0.05


def test_the_text_part_of_a_conditional_generation_folder(folder, model, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout (text config under text_config, tensors under model.language_model,
    a vision tower beside them) loads as the same text model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "vl"
    out.mkdir()
    shutil.copy(folder / "tokenizer.json", out)
    text = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                 "model_type": "qwen3_5", "text_config": text}))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, str(out / "model.safetensors"))
    vl = load_model(str(out), progress=False, use_cache=False).model
    ids = torch.tensor(prompt(9))
    assert torch.equal(vl(ids, vl.new_cache(9)).logits, model(ids, model.new_cache(9)).logits)
    assert vl.mtp is not None


def test_bench_speed_decode_timing_runs_on_a_recurrent_cache(model):
    """`bench speed`'s decode timing used to roll its cache back across the warm-up's one-token passes, which a
    recurrent state cannot do (an error); now each run has its own prefill, and the tokens are plain greedy's."""
    from speculant.bench.speed import decode_tps

    ids = prompt(12)
    tps, tokens = decode_tps(model, ids, 5, warmup=3)
    cache = model.new_cache(20)
    want = [int(model(torch.tensor(ids), cache).logits[-1].argmax())]
    for _ in range(5):
        want.append(int(model(torch.tensor(want[-1:]), cache).logits[-1].argmax()))
    assert tps > 0 and tokens == want
