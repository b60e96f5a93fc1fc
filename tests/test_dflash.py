"""DFlash block drafters (--method dflash --drafter PATH): tiny random drafters in z-lab's layout on a tiny Qwen3
target (HF folders written by transformers):

(a) the drafter's logits equal the reference DFlashDraftModel's (tests/dflash_ref.py, and z-lab's package itself
    where it is installed), in the first round and after a partly accepted one (the context rows kept);
(b) greedy output identical to `ar` through the engine and the CLI, and the accepted drafts per round equal to
    dflash_generate's greedy loop (recomputed from scratch with the reference);
(c) sampled output with the target's distribution, with and without penalties (and the biased-acceptance
    negative control);
(d) drafter folders that do not fit the target, or lack what a DFlash drafter needs, are clear errors.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ref import ReferenceDFlash, features, greedy_rounds
from sampled import biased_acceptance, exact_marginals, sample_runs
from test_eagle3_published import D, LAYERS, save_qwen3
from speculant import Engine, GenerationConfig, SamplingConfig, drafter_method, load_model
from speculant.cli import main
from speculant.errors import SpeculantError
from speculant.methods.heads import HeadsConfig, load_dflash_drafter
from speculant.methods.config import parse_method
from speculant.methods.dflash import DFlashDrafter
from speculant.exact.sampler import Sampler

BLOCK = 8


def write_dflash(folder, *, vocab: int, layer_ids=(1, 3, 5), block: int = BLOCK, mask: int | None = None, seed: int = 0,
                 hidden: int = D, n_layers: int = 2, scale: float = 1.0, dflash: dict | None = None,
                 drop: str | None = None, kv_heads: int = 2):
    """A random DFlash drafter in z-lab's layout (config.json as DFlashDraftModel's save_pretrained writes it,
    model.safetensors); `drop` leaves a tensor out."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    H, HKV, HD, FF = 4, kv_heads, 16, 96
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std if std is not None else scale / shape[-1] ** 0.5)

    t = {"fc.weight": rnd(hidden, len(layer_ids) * hidden), "hidden_norm.weight": 1 + rnd(hidden, std=0.2),
         "norm.weight": 1 + rnd(hidden, std=0.2)}
    for i in range(n_layers):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + rnd(hidden, std=0.2),
              p + "post_attention_layernorm.weight": 1 + rnd(hidden, std=0.2),
              p + "self_attn.q_proj.weight": rnd(H * HD, hidden), p + "self_attn.k_proj.weight": rnd(HKV * HD, hidden),
              p + "self_attn.v_proj.weight": rnd(HKV * HD, hidden), p + "self_attn.o_proj.weight": rnd(hidden, H * HD),
              p + "self_attn.q_norm.weight": 1 + rnd(HD, std=0.2), p + "self_attn.k_norm.weight": 1 + rnd(HD, std=0.2),
              p + "mlp.gate_proj.weight": rnd(FF, hidden), p + "mlp.up_proj.weight": rnd(FF, hidden),
              p + "mlp.down_proj.weight": rnd(hidden, FF)}
    if drop:
        t.pop(drop)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=FF, num_hidden_layers=n_layers,
                      num_attention_heads=H, num_key_value_heads=HKV, head_dim=HD, rms_norm_eps=1e-6,
                      max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      num_target_layers=LAYERS).to_dict()
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["dflash_config"] = {"block_size": block, "target_layer_ids": list(layer_ids),
                            "mask_token_id": vocab - 1 if mask is None else mask, **(dflash or {})}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3-128"), 128, logit_std=0.3)


def _prompt(n: int, vocab: int, seed: int = 3) -> list[int]:
    return [int(x) for x in torch.randint(0, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed))]


# ---------------------------------------------------------------- (a) logits as the reference's
@pytest.mark.parametrize("layer_ids, dflash", [((1, 3, 5), {}),  # 5: the last layer, HF's final normed state
                                               ((0, 2), {"input_embedding_scale": 1.5, "output_multiplier": 0.7,
                                                         "final_logit_softcapping": 4.0})])
def test_logits_match_the_reference(layer_ids, dflash, qwen3, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_dflash(tmp_path / "d", vocab=128, layer_ids=layer_ids, seed=11, dflash=dflash)
    target = load_model(str(qwen3), "float32")
    model = load_dflash_drafter(target, HeadsConfig(str(folder), fmt="float32"))
    m = target.model
    drafter = DFlashDrafter(model, m, Sampler(SamplingConfig(), 128), 64)
    prompt = _prompt(14, 128)
    cache = m.new_cache(64)
    out = m(torch.tensor(prompt), cache, taps=drafter.taps)
    drafter.start(prompt, out.taps)
    ref_model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32).eval()
    ref = ReferenceDFlash(folder)
    embed, head = ref_model.model.embed_tokens.weight, ref_model.lm_head.weight
    mask = 127

    def reference(context: list[int], pending: int) -> torch.Tensor:
        with torch.no_grad():
            hs = ref_model(torch.tensor([context]), output_hidden_states=True).hidden_states
        return ref.logits(features(hs, layer_ids), [pending] + [mask] * (BLOCK - 1), len(context), embed, head)

    pending = int(out.logits[-1].argmax())
    ours = drafter.block_logits(pending, BLOCK - 1)
    torch.testing.assert_close(ours, reference(prompt, pending), rtol=1e-4, atol=1e-4)
    print("round 1 max |diff|", float((ours - reference(prompt, pending)).abs().max()))
    # a round that kept 2 of 5 drafts: the drafter gets the rows of [pending, d1, d2] only
    drafts = [5, 9, 77, 3, 4]
    fwd = m(torch.tensor([pending] + drafts), cache, taps=drafter.taps)
    drafter.commit([pending] + drafts[:2], len(drafts), hidden={t: h[:3] for t, h in fwd.taps.items()})
    context = prompt + [pending] + drafts[:2]
    ours = drafter.block_logits(42, BLOCK - 1)
    assert drafter.cache.length == len(context)
    torch.testing.assert_close(ours, reference(context, 42), rtol=1e-4, atol=1e-4)
    print("round 2 max |diff|", float((ours - reference(context, 42)).abs().max()))
    assert drafter.block_logits(7, 3).shape == (3, 128)  # k below the block: its first rows


def test_drafted_rows_alone_give_the_whole_blocks_bits(qwen3, tmp_path):
    """In the block formats block_logits runs the last layer's o_proj and MLP on the drafted rows alone: for every k
    its logits are, bit for bit, those of rows 1..k of the whole block's pass. float32 (torch's matmul, whose rows
    depend on the others) runs the whole block."""
    folder = write_dflash(tmp_path / "d", vocab=128, layer_ids=(1, 3), seed=11)
    target = load_model(str(qwen3), "float32")
    assert not load_dflash_drafter(target, HeadsConfig(str(folder), fmt="float32")).rows_invariant()
    model = load_dflash_drafter(target, HeadsConfig(str(folder), fmt="q8_0"))
    m = target.model
    drafter = DFlashDrafter(model, m, Sampler(SamplingConfig(), 128), 64)
    assert drafter._trim
    prompt = _prompt(14, 128)
    drafter.start(prompt, m(torch.tensor(prompt), m.new_cache(64), taps=drafter.taps).taps)
    drafter.block_logits(5, 1)  # the prompt's rows into the cache
    P = drafter.pos0 + drafter.cache.length
    x = m.embed(torch.tensor([5] + [127] * (BLOCK - 1))).float()
    with torch.inference_mode():
        whole = model.block(x, drafter.cache, drafter.cos[P : P + BLOCK], drafter.sin[P : P + BLOCK])
        for k in range(1, BLOCK):
            assert torch.equal(drafter.block_logits(5, k), drafter._logits(whole[1 : k + 1])), k


def test_the_reference_is_z_labs_model(tmp_path):
    """tests/dflash_ref.py against DFlashDraftModel itself, on a drafter the package saves (so the layout the
    loader reads is the package's own)."""
    dflash = pytest.importorskip("dflash.model", reason="z-lab's dflash is not installed (pip install --no-deps "
                                                        "dflash==0.1.0)")
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=128, hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_target_layers=LAYERS)
    cfg.dflash_config = {"block_size": BLOCK, "target_layer_ids": [1, 3, 5], "mask_token_id": 127}
    torch.manual_seed(0)
    model = dflash.DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else p.shape[-1] ** -0.5) + (1.0 if p.dim() == 1 else 0))
    model.save_pretrained(tmp_path / "z")
    ref = ReferenceDFlash(tmp_path / "z")
    assert json.loads((tmp_path / "z" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    feats, noise, start = torch.randn(9, 3 * D), torch.randn(BLOCK, D), 9
    with torch.no_grad():
        theirs = model(position_ids=torch.arange(0, start + BLOCK)[None], noise_embedding=noise[None],
                       target_hidden=feats[None])[0]
    torch.testing.assert_close(ref.hidden(feats, noise, start), theirs, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- (b) greedy identical to ar, rounds as the reference's
V = 4


@pytest.fixture(scope="module")
def qwen3_v4(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3-4"), V, seed=4, logit_std=0.1)


def test_greedy_rounds_match_the_reference_loop(qwen3_v4, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_dflash(tmp_path / "d", vocab=V, seed=4)  # its drafts mostly the target's likeliest token
    target = load_model(str(qwen3_v4), "float32")
    prompt, n = [0, 1, 2, 3, 0, 1, 2, 0, 1], 40
    method = parse_method(f"dflash:k={BLOCK - 1},schedule=fixed,heads={folder}")
    ar = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=n, ignore_eos=True)).token_ids
    chunks = list(Engine(target, method=method).stream(prompt, GenerationConfig(max_new_tokens=n, ignore_eos=True)))
    tokens = [t for c in chunks[:-1] for t in c.token_ids]
    assert tokens == ar
    full = [c.drafted for c in chunks[:-1] if c.proposed == BLOCK - 1]  # rounds of a whole block
    ref_tokens, ref_accepted = greedy_rounds(ReferenceDFlash(folder), AutoModelForCausalLM.from_pretrained(
        str(qwen3_v4), dtype=torch.float32).eval(), prompt, n, BLOCK)
    assert ref_tokens[:n] == ar
    print("accepted per round", full, "reference", ref_accepted[:len(full)])
    assert full == ref_accepted[: len(full)] and sum(full) > 0 and len(full) >= 5


def test_greedy_identical_to_ar(qwen3, tmp_path):
    target = load_model(str(qwen3))
    folder = write_dflash(tmp_path / "d", vocab=128, seed=2)
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    prompt = _prompt(12, 128, seed=7)
    ref = Engine(target).generate(prompt, gen).token_ids
    method = drafter_method(str(folder))
    assert method.name == "dflash" and method.heads.name == str(folder)
    done = Engine(target, method=method).generate(prompt, gen)
    assert done.token_ids == ref and done.stats.drafted_tokens > 0
    # penalties and a logit bias: the drafts are chosen under them too, the output still the target's
    pen = GenerationConfig(max_new_tokens=30, ignore_eos=True,
                           sampling=SamplingConfig(repeat_penalty=1.3, logit_bias={5: 2.0}))
    assert Engine(target, method=method).generate(prompt, pen).token_ids == Engine(target).generate(prompt, pen).token_ids


def test_cli_drafter_picks_dflash_and_matches_ar(qwen3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    folder = write_dflash(tmp_path / "d", vocab=128, seed=2)
    common = ["generate", "--model", str(qwen3), "-n", "16", "--stats", "--no-progress", "t5 t17 t99 t3 t64 t8"]
    outs = []
    for extra in (["--method", "ar"], ["--drafter", str(folder)], ["--method", "dflash", "--drafter", str(folder)]):
        rc = main(common[:1] + extra + common[1:])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    assert outs[0][0] == outs[1][0] == outs[2][0]
    assert all(o[1]["method"] == "dflash" and o[1]["drafted_tokens"] > 0 for o in outs[1:])


# ---------------------------------------------------------------- (c) the target's distribution
SAMPLINGS = {"plain": SamplingConfig(1.0), "penalized": SamplingConfig(0.9, top_p=0.95, repeat_penalty=1.5,
                                                                      presence_penalty=0.3)}


def _sampled(qwen3_v4, tmp_path, runs, sampling):
    target = load_model(str(qwen3_v4))
    folder = write_dflash(tmp_path / "d", vocab=V, seed=9, scale=3.0, block=4)
    prompt, n_tok = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], 4
    exp = exact_marginals(target, prompt, sampling, n_tok)
    e = Engine(target, method=parse_method(f"dflash:k=3,schedule=fixed,heads={folder}"))
    return sample_runs(lambda i: e, prompt, sampling, n_tok, V, runs, generate=6), exp


@pytest.mark.parametrize("name", SAMPLINGS)
def test_sampled_distribution_exact(name, qwen3_v4, tmp_path):
    r, exp = _sampled(qwen3_v4, tmp_path, 300, SAMPLINGS[name])
    r.check_rounds(False)
    print(name, "p-values", r.pvalues(exp), "accepted", r.accepted, "of", r.drafted)
    assert min(r.pvalues(exp)) > 1e-3, r.pvalues(exp)


def test_the_check_rejects_a_biased_acceptance(qwen3_v4, tmp_path, monkeypatch):
    biased_acceptance(monkeypatch)
    r, exp = _sampled(qwen3_v4, tmp_path, 150, SAMPLINGS["plain"])
    assert r.accepted > 0
    assert min(r.pvalues(exp)) < 1e-6, r.pvalues(exp)


# ---------------------------------------------------------------- (d) drafters that do not fit, or cannot be read
@pytest.mark.parametrize("change, needle", [
    (dict(layer_ids=(1, 3, 6)), "reads target layers [1, 3, 6], the target has 6 layers"),
    (dict(layer_ids=(-1, 3)), "the target has 6 layers"),
    (dict(hidden=32), "hidden_size is 32, the target's hidden size is 64"),
    (dict(mask=500), "mask_token_id 500 is not a token id"),
    (dict(block=1), "block_size must be an integer in 2..1024"),
    (dict(drop="layers.1.self_attn.k_norm.weight"), "missing ['layers.1.k_norm']"),
    (dict(drop="fc.weight"), "tensor fc.weight is missing"),
    (dict(dflash={"mask_token_id": None}), "dflash_config lacks mask_token_id"),
])
def test_mismatched_drafters_are_clear_errors(change, needle, qwen3, tmp_path):
    target = load_model(str(qwen3), "float32")
    folder = write_dflash(tmp_path / "bad", vocab=128, **change)
    with pytest.raises(SpeculantError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_dflash_drafter(target, HeadsConfig(str(folder), fmt="float32"))


def test_bad_fc_shape_and_cli_errors(qwen3, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    target = load_model(str(qwen3), "float32")
    folder = write_dflash(tmp_path / "d", vocab=128)
    t = load_file(str(folder / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, : 2 * D].contiguous()
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(SpeculantError, match=r"fc.weight has shape \(64, 128\); 3 target layers of width 64"):
        load_dflash_drafter(target, HeadsConfig(str(folder), fmt="float32"))
    rc = main(["generate", "--model", str(qwen3), "--drafter", str(folder), "--no-progress", "t1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("speculant: error:") and "fc.weight has shape" in err
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["block_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    rc = main(["generate", "--model", str(qwen3), "--method", "dflash", "--drafter", str(folder), "--no-progress", "t1"])
    err = capsys.readouterr().err
    assert rc == 2 and "dflash_config lacks block_size" in err
