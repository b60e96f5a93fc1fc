"""Published EAGLE-3 drafters (--drafter): tiny random drafters written in each published layout (the EAGLE
repo / AngelSlim's `midlayer.*` in pytorch_model.bin, SpecForge's `midlayer.*` + `embed_tokens` in
safetensors, speculators' `layers.0.*` under `transformer_layer_config`) on a tiny Qwen3 target (HF folder
written by transformers):

(a) the drafts equal those of a reference EAGLE-3 step built from transformers' own Llama layer with the
    EAGLE-3 first-layer forward written out as speculators' `eagle3/model_definitions.py`
    (Eagle3FirstLayerMixin.forward) and SpecForge's `llama3_eagle.py` (LlamaDecoderLayer.forward) have it,
    fed the target's HF hidden_states[i] for the config's layer ids (vLLM's aux hidden states);
(b) greedy output identical to `ar`, through the engine and the CLI;
(c) sampled output with the target's distribution (and the biased-acceptance negative control);
(d) drafters that do not fit the target, or cannot be read, are clear errors.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_ref import ReferenceEagle3
from sampled import biased_acceptance, exact_marginals, sample_runs
from speculant import Engine, GenerationConfig, MethodConfig, SamplingConfig, drafter_method, load_model
from speculant.cli import main
from speculant.errors import SpeculantError
from speculant.heads.formats import load_head
from speculant.heads.modules import target_rows
from speculant.methods.heads import HeadsConfig, load_heads
from speculant.methods.eagle import EagleDrafter

LAYERS, D, FF = 6, 64, 96  # the target (Qwen3, head_dim 24, rope_theta 1e6)
H, HKV, HD, DFF = 4, 2, 16, 96  # the drafter's layer: its own head_dim and rotary
LAYOUTS = ("eagle", "specforge", "speculators")


def save_qwen3(folder, vocab: int, seed: int = 0, logit_std: float = 0.02):
    """A tiny Qwen3 HF folder (transformers' save_pretrained, random norms) with a word-level tokenizer t0..t{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    cfg = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                               rms_norm_eps=1e-6, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
        model.lm_head.weight.normal_(0, logit_std)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3-128"), 128, logit_std=0.3)


def _layer_config(vocab: int, hidden: int, rope: dict) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": DFF, "num_attention_heads": H,
            "num_key_value_heads": HKV, "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "vocab_size": vocab, "max_position_embeddings": 256, **rope}


ROPE = {"eagle": {"rope_theta": 10000.0},
        "specforge": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                               "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 64}},
        "speculators": {"rope_theta": 1e6}}


def write_drafter(folder, layout: str, *, vocab: int, draft_vocab: int, seed: int = 0, ids=None, hidden: int = D,
                  scale: float = 1.0, norm_before_residual: bool = False, prefix: str = "", extra: dict | None = None,
                  target_rows: torch.Tensor | None = None, qwen3_layer: bool = False):
    """A random EAGLE-3 drafter in `layout`; returns (folder, its tensors as written)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std if std is not None else scale / shape[-1] ** 0.5)

    p = "layers.0." if layout == "speculators" else "midlayer."
    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t = {"fc.weight": rnd(hidden, 3 * hidden), "norm.weight": 1 + rnd(hidden, std=0.2),
         "lm_head.weight": rnd(draft_vocab, hidden, std=1.0) if target_rows is None else target_rows[draft_ids].clone(),
         f"{p}input_layernorm.weight": 1 + rnd(hidden, std=0.2), f"{p}hidden_norm.weight": 1 + rnd(hidden, std=0.2),
         f"{p}post_attention_layernorm.weight": 1 + rnd(hidden, std=0.2),
         f"{p}self_attn.q_proj.weight": rnd(H * HD, 2 * hidden), f"{p}self_attn.k_proj.weight": rnd(HKV * HD, 2 * hidden),
         f"{p}self_attn.v_proj.weight": rnd(HKV * HD, 2 * hidden), f"{p}self_attn.o_proj.weight": rnd(hidden, H * HD),
         f"{p}mlp.gate_proj.weight": rnd(DFF, hidden), f"{p}mlp.up_proj.weight": rnd(DFF, hidden),
         f"{p}mlp.down_proj.weight": rnd(hidden, DFF),
         "d2t": draft_ids - torch.arange(draft_vocab), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, draft_ids, True)}
    layer = _layer_config(vocab, hidden, ROPE[layout])
    if layout == "speculators":
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": draft_vocab,
               "norm_before_residual": norm_before_residual, "transformer_layer_config": layer,
               "eagle_aux_hidden_state_layer_ids": ids,
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-qwen3"}}}
    else:
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": draft_vocab}
        if ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    if layout == "specforge":
        t["embed_tokens.weight"] = rnd(vocab, hidden, std=1.0)  # SpecForge saves the (frozen) embedding too
    cfg.update(extra or {})
    if qwen3_layer:  # speculators' qwen3 first layer: q/k norms over each head
        cfg["transformer_layer_config"]["model_type"] = "qwen3"
        t[f"{p}self_attn.q_norm.weight"], t[f"{p}self_attn.k_norm.weight"] = 1 + rnd(HD, std=0.2), 1 + rnd(HD, std=0.2)
    if cfg.get("norm_before_fc"):  # speculators: one RMSNorm over the concatenated taps, then fc
        t["input_norm.weight"] = 1 + rnd(3 * hidden, std=0.2)
    if cfg.get("fc_norm"):  # speculators: an RMSNorm per tap
        for i in range(3):
            t[f"fc_norm.{i}.weight"] = 1 + rnd(hidden, std=0.2)
    folder.mkdir(parents=True, exist_ok=True)
    written = {prefix + k if k not in ("d2t", "t2d", "lm_head.weight") else k: v.contiguous() for k, v in t.items()}
    if layout == "eagle":  # the EAGLE repo and AngelSlim ship pytorch_model.bin
        torch.save(written, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(written, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, t


# ---------------------------------------------------------------- (a) drafts as the reference's (tests/eagle3_ref.py)
SPECULATORS_OPTIONS = {"concat": {"norm_before_fc": True}, "per_tap": {"fc_norm": True, "norm_output": True}, "qwen3": {}}


@pytest.mark.parametrize("layout", [*LAYOUTS, "speculators-concat", "speculators-per_tap", "speculators-qwen3"])
def test_drafts_match_the_reference(layout, qwen3, tmp_path):
    from transformers import AutoModelForCausalLM

    layout, _, variant = layout.partition("-")
    options = SPECULATORS_OPTIONS.get(variant, {})
    ids = [1, 3, 5] if layout != "specforge" else None  # specforge: EAGLE-3's default (2, N/2, N-3) = (2, 3, 3)
    nbr = layout == "speculators" and not variant
    # the specforge drafter's names under `model.` (a wrapper's save_pretrained) read the same
    folder, t = write_drafter(tmp_path / layout, layout, vocab=128, draft_vocab=40, seed=11, ids=ids,
                              norm_before_residual=nbr, prefix="model." if layout == "specforge" else "", extra=options,
                              qwen3_layer=variant == "qwen3")
    target = load_model(str(qwen3), "float32")
    head, _ = load_heads(target, "eagle3", HeadsConfig(str(folder), fmt="float32"))
    assert head.cfg.taps == tuple(i - 1 for i in (ids or (2, 3, 3)))
    prompt = [int(x) for x in torch.randint(0, 128, (14,), generator=torch.Generator().manual_seed(3))]
    k = 4
    # speculant: the target's taps, the drafter's chain (topk 1: the tree is the greedy chain)
    m = target.model
    out = m(torch.tensor(prompt), m.new_cache(64), taps=head.cfg.taps)
    pending = int(out.logits[0, -1].argmax())
    drafter = EagleDrafter(head, m, HeadsConfig(nodes=k, depth=k, topk=1, fmt="float32"), 64)
    drafter.start(prompt, out.taps)
    tree = drafter.propose(pending, k)
    fresh = EagleDrafter(head, m, HeadsConfig(fmt="float32"), 64)  # the first step's logits, on a cache of its own
    # the reference: transformers' Qwen3 hidden_states[i] (the input of layer i) for the config's ids
    ref_model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = ref_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in (ids or (2, 3, 3))], -1)
        ref = ReferenceEagle3(t, _layer_config(128, D, ROPE[layout]), {"norm_before_residual": nbr, **options})
        drafts, first = ref.draft_chain(feats, ref_model.model.embed_tokens.weight, prompt[1:] + [pending], k)
        ours = head.logits(fresh._pass(head.first_feature(torch.cat([out.taps[x] for x in head.cfg.taps], -1)),
                                         torch.tensor(prompt[1:] + [pending]), None, torch.arange(len(prompt)))[-1])
    torch.testing.assert_close(ours.float(), first, rtol=1e-4, atol=1e-4)
    assert tree.tokens.tolist() == drafts and tree.parents == [-1, 0, 1, 2][:k], (tree.tokens.tolist(), drafts)


# ---------------------------------------------------------------- (b) greedy output identical to ar
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_identical_to_ar(layout, qwen3, tmp_path):
    target = load_model(str(qwen3))
    rows = target_rows(target.model, torch.arange(128))  # drafts start at the target's own output rows
    folder, _ = write_drafter(tmp_path / layout, layout, vocab=128, draft_vocab=64, seed=5,
                              ids=None if layout == "specforge" else [2, 3, 6], target_rows=rows)
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    prompt = [int(x) for x in torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(7))]
    ref = Engine(target).generate(prompt, gen).token_ids
    method = drafter_method(str(folder))
    assert method.name == "eagle3" and method.heads.name == str(folder)
    done = Engine(target, method=method).generate(prompt, gen)
    assert done.token_ids == ref
    assert done.stats.drafted_tokens > 0


def test_cli_drafter_picks_eagle3_and_matches_ar(qwen3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    folder, _ = write_drafter(tmp_path / "spec", "speculators", vocab=128, draft_vocab=32, seed=2, ids=[2, 3, 6])
    common = ["generate", "--model", str(qwen3), "-n", "16", "--stats", "--no-progress",
              "t5 t17 t99 t3 t64 t8"]
    outs = []
    for extra in (["--method", "ar"], ["--drafter", str(folder)]):
        rc = main(common[:1] + extra + common[1:])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    assert outs[0][0] == outs[1][0] and outs[1][1]["method"] == "eagle3" and outs[1][1]["drafted_tokens"] > 0
    rc = main(["generate", "--model", str(qwen3), "--drafter", str(folder), "--heads", str(folder), "t1"])
    err = capsys.readouterr().err
    assert rc == 2 and "not both" in err


# ---------------------------------------------------------------- (c) the target's distribution
V = 4


@pytest.fixture(scope="module")
def qwen3_v4(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3-4"), V, seed=4, logit_std=0.1)


def _sampled(qwen3_v4, tmp_path, runs):
    target = load_model(str(qwen3_v4))
    folder, _ = write_drafter(tmp_path / "d", "speculators", vocab=V, draft_vocab=3, seed=9, ids=[2, 3, 6],
                              target_rows=target_rows(target.model, torch.arange(V)))
    prompt, n_tok, sampling = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], 4, SamplingConfig(1.0)
    exp = exact_marginals(target, prompt, sampling, n_tok)
    e = Engine(target, method=drafter_method(str(folder), MethodConfig(heads=HeadsConfig(nodes=4, depth=3, topk=2))))
    return sample_runs(lambda i: e, prompt, sampling, n_tok, V, runs), exp


def test_sampled_distribution_exact(qwen3_v4, tmp_path):
    r, exp = _sampled(qwen3_v4, tmp_path, 300)
    r.check_rounds(False)
    assert min(r.pvalues(exp)) > 1e-3, r.pvalues(exp)


def test_the_check_rejects_a_biased_acceptance(qwen3_v4, tmp_path, monkeypatch):
    biased_acceptance(monkeypatch)
    r, exp = _sampled(qwen3_v4, tmp_path, 150)
    assert r.accepted > 0
    assert min(r.pvalues(exp)) < 1e-6, r.pvalues(exp)


# ---------------------------------------------------------------- (d) drafters that do not fit, or cannot be read
@pytest.mark.parametrize("change, needle", [
    (dict(hidden=32), "hidden_size is 32, the target's hidden size is 64"),
    (dict(vocab=100), "vocabulary of 100 tokens, the target has 128"),
    (dict(ids=[2, 3, 7]), "the target has 6 layers"),
    (dict(ids=[0, 3, 5]), "0 = the embeddings"),
    (dict(extra={"norm_before_fc": True, "fc_norm": True}), "norm_before_fc and fc_norm are exclusive"),
    (dict(extra={"draft_vocab_size": 20}), "lm_head has 40 rows, draft_vocab_size says 20"),
])
def test_mismatched_drafters_are_clear_errors(change, needle, qwen3, tmp_path):
    target = load_model(str(qwen3), "float32")
    kw = dict(vocab=128, draft_vocab=40, ids=[2, 3, 5]) | change
    folder, _ = write_drafter(tmp_path / "bad", "speculators", **kw)
    with pytest.raises(SpeculantError, match=needle.replace("(", r"\(")):
        load_head(folder, target.config)


def test_unreadable_files_are_clear_errors(qwen3, tmp_path, capsys):
    target = load_model(str(qwen3), "float32")
    folder, t = write_drafter(tmp_path / "bin", "eagle", vocab=128, draft_vocab=40)
    head, _ = load_head(folder, target.config)  # pytorch_model.bin through the weights-only loader
    assert torch.equal(head.d2t, t["d2t"] + torch.arange(40))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not a checkpoint")
    with pytest.raises(SpeculantError, match="convert it to model.safetensors"):
        load_head(folder, target.config)

    class Payload:  # a pickle that would run code: the weights-only loader refuses it
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"fc.weight": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(SpeculantError, match="weights-only"):
        load_head(folder, target.config)
    bad, _ = write_drafter(tmp_path / "t2d", "speculators", vocab=128, draft_vocab=40, ids=[2, 3, 5])
    from safetensors.torch import load_file, save_file

    d2t = load_file(str(bad / "model.safetensors"))
    d2t["t2d"] = torch.zeros(128, dtype=torch.bool)
    save_file(d2t, str(bad / "model.safetensors"))
    with pytest.raises(SpeculantError, match="d2t and t2d disagree"):
        load_head(bad, target.config)
    rc = main(["generate", "--model", str(qwen3), "--drafter", str(bad), "--no-progress", "t1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("speculant: error:") and "d2t and t2d disagree" in err


def test_models_endpoint_names_the_drafter(qwen3, tmp_path):
    from fastapi.testclient import TestClient

    from speculant.server.app import ServerConfig, create_app

    folder, _ = write_drafter(tmp_path / "spec", "speculators", vocab=128, draft_vocab=32, ids=[2, 3, 6])
    engine = Engine(load_model(str(qwen3)), method=drafter_method(str(folder)), threads=1)
    with TestClient(create_app(engine, ServerConfig("tiny-qwen3", shutdown_grace=0.0))) as client:
        entry = client.get("/v1/models").json()["data"][0]
    assert entry["method"] == "eagle3" and entry["drafter"] == str(folder)


def test_speculators_options_survive_export_and_our_format(qwen3, tmp_path):
    """A drafter with fc_norm and norm_output written back (speculators layout, speculant's own) drafts the same."""
    from speculant.heads.formats import export_speculators, save_head

    target = load_model(str(qwen3), "float32")
    folder, _ = write_drafter(tmp_path / "d", "speculators", vocab=128, draft_vocab=40, seed=4, ids=[1, 3, 5],
                              extra=SPECULATORS_OPTIONS["per_tap"])
    heads = [load_head(folder, target.config)[0]]
    heads.append(load_head(export_speculators(heads[0], tmp_path / "exported", target.config), target.config)[0])
    heads.append(load_head(save_head(heads[0], tmp_path / "ours"), target.config)[0])
    prompt = list(range(3, 40, 3))
    m = target.model
    out = m(torch.tensor(prompt), m.new_cache(64), taps=heads[0].cfg.taps)
    trees = []
    for head in heads:
        assert head.cfg.feature_norm == "per_tap" and head.cfg.norm_output
        d = EagleDrafter(head, m, HeadsConfig(nodes=6, depth=3, topk=2, fmt="float32"), 64)
        d.start(prompt, out.taps)
        tree = d.propose(7, 6)
        trees.append((tree.tokens.tolist(), tree.parents))
    assert trees[0] == trees[1] == trees[2]
