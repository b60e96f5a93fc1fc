"""llama.cpp's EAGLE-3 drafter GGUF as a `--drafter`, with llama.cpp as the reference (tests/llama_cpp_ref.py).

A tiny Qwen3 target (SmolLM2's tokenizer, which llama.cpp's converter recognizes) and EAGLE-3 drafters in
the EAGLE repo / SpecForge layout are converted by llama.cpp's convert_hf_to_gguf.py (F32; the drafter with
--target-model-dir). Then:

(a) speculant reads the drafter GGUF as the same head as its HF folder: equal tensors (the q/k row
    permutation undone, d2t's absolute ids back to offsets, Llama 3 rope scaling from rope_freqs) and
    first-step draft logits within float tolerance;
(b) greedy output with the GGUF drafter is identical to `ar` and to llama.cpp's greedy on the target GGUF;
(c) llama-speculative-simple --spec-type draft-eagle3 runs the same pair greedily with chains of K drafts
    (all KV caches f32): its output, and round by round its K drafts and accepted count, against
    speculant's (topk 1, K nodes: the same chain of the same drafter). A random drafter is almost never
    right, so `repeat` is built to be: the target's last layer is nearly the identity, the drafter's fc
    passes that layer's input (tap id N-1) through and its lm_head and norm are the target's, with small
    random attention and MLP weights on top, so it proposes "the pending token again" (what the target
    does once it settles into a repetition). (Tap id N, the target's last hidden state, is no use here:
    llama.cpp reads it from the graph's MTP output, which its Qwen3 graph does not set, so its drafts
    there are never right.) The head runs in float32 like the F32 file (speculant's default q8_0 head on the
    CPU drafts differently at near-ties, and its chains part from llama.cpp's within a few rounds);
(d) GGUF files that are not an EAGLE-3 drafter, or not for this target, are clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_tokenizer import gguf_tokenizer
from llama_cpp_ref import convert_all, equal_rounds, greedy_tokens, llama_cpp_bin, speculative_rounds
from safetensors.torch import load_file, save_file

from speculant import Engine, GenerationConfig, MethodConfig, drafter_method, load_model
from speculant.errors import SpeculantError
from speculant.methods.governor import GovernorConfig
from speculant.heads.formats import head_method, load_head
from speculant.methods.heads import HeadsConfig, load_heads
from speculant.methods.eagle import EagleDrafter
from speculant.decoding.stats import Stats

# SmolLM2's tokenizer (from the real preset's GGUF): real-marked like tests/test_llama_cpp_parity.py
pytestmark = pytest.mark.real

REAL = "smollm2-135m-instruct"
LAYERS = 6
PROMPT = "The capital of France is"
N, K = 32, 4


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return llama_cpp_bin()


@pytest.fixture(scope="module")
def files(tmp_path_factory, bin_dir) -> dict[str, Path]:
    """The target (HF folder and F32 GGUF) and two drafters (HF folders and F32 GGUFs): `random`, in SpecForge's
    layout with Llama 3 rope scaling, and `repeat` (the module docstring's (c))."""
    import test_eagle3_published as pub
    from transformers import AutoConfig, AutoModelForCausalLM

    from speculant.hub import resolve_model

    root = tmp_path_factory.mktemp("eagle3-gguf")
    real = resolve_model(REAL)
    tok = gguf_tokenizer(real)
    vocab = len(tok)
    cfg = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=pub.D, intermediate_size=pub.FF,
                               num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # greedy choices clear of ties
        last = model.model.layers[-1]  # nearly the identity: the input of the last layer predicts as its output
        last.self_attn.o_proj.weight.mul_(0.01)
        last.mlp.down_proj.weight.mul_(0.01)
    target = root / "target"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    out = {"target": target}
    jobs = [(target, root / "target.gguf", ["--outtype", "f32"])]
    sd = {k: v.float() for k, v in model.state_dict().items()}
    for name in ("random", "repeat"):
        ids = [1, 3, LAYERS - 1]
        kw = dict(draft_vocab=256, seed=3) if name == "random" else dict(draft_vocab=vocab, seed=4, scale=0.05)
        folder, _ = pub.write_drafter(root / name, "specforge", vocab=vocab, ids=None, **kw)
        t = load_file(str(folder / "model.safetensors"))
        # llama.cpp drafts with the file's own embedding where it has one; EAGLE-3's is the target's
        t["embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        if name == "repeat":
            t["fc.weight"] = torch.cat([torch.zeros(pub.D, 2 * pub.D), torch.eye(pub.D)], 1)
            t["norm.weight"], t["lm_head.weight"] = sd["model.norm.weight"], sd["lm_head.weight"]
        save_file(t, str(folder / "model.safetensors"))
        c = json.loads((folder / "config.json").read_text())
        # the converter reads the ids at the top level only (not under eagle_config)
        (folder / "config.json").write_text(json.dumps({**c, "eagle_aux_hidden_state_layer_ids": ids}))
        out[name] = folder
        jobs.append((folder, root / f"{name}.gguf", ["--outtype", "f32", "--target-model-dir", target]))
    for name, path in zip(("target", "random", "repeat"), convert_all(jobs)):  # one converter process
        out[f"{name}.gguf"] = path
    return out


@pytest.fixture(scope="module")
def target(files):
    return load_model(str(files["target.gguf"]), None, progress=False, use_cache=False, kv_dtype="f16")


# ---------------------------------------------------------------- (a) the GGUF drafter is the HF folder's head
@pytest.mark.parametrize("name", ["random", "repeat"])
def test_gguf_drafter_equals_its_hf_folder(files, target, name):
    heads = [load_heads(target, "eagle3", HeadsConfig(str(files[k]), fmt="float32"))[0] for k in (name, f"{name}.gguf")]
    hf, gg = heads
    assert head_method(files[f"{name}.gguf"]) == "eagle3" and gg.cfg.taps == hf.cfg.taps
    assert gg.cfg.draft_vocab == hf.cfg.draft_vocab and torch.equal(gg.d2t, hf.d2t)
    torch.testing.assert_close(torch.tensor(gg.cfg.rope_inv_freq), torch.tensor(hf.cfg.rope_inv_freq), rtol=1e-6, atol=0)
    if name == "random":  # SpecForge's llama3 rope scaling: the converter's rope_freqs divisors
        assert gg.cfg.rope_inv_freq[-1] == pytest.approx(500000.0 ** (-14 / 16) / 8, rel=1e-5)
    sh, sg = hf.state_dict(), gg.state_dict()
    assert sh.keys() == sg.keys()
    for k in sh:
        torch.testing.assert_close(sg[k], sh[k], rtol=0, atol=0, msg=k)
    # first-step draft logits, each on a cache of its own, from the target's taps of one prompt
    prompt = target.tokenizer.encode(PROMPT)
    m = target.model
    fwd = m(torch.tensor(prompt), m.new_cache(64), taps=hf.cfg.taps)
    pending = int(fwd.logits[0, -1].argmax())
    logits = []
    with torch.inference_mode():
        for head in heads:
            d = EagleDrafter(head, m, HeadsConfig(fmt="float32"), 64)
            feats = head.first_feature(torch.cat([fwd.taps[x] for x in head.cfg.taps], -1))
            logits.append(head.logits(d._pass(feats, torch.tensor(prompt[1:] + [pending]), None,
                                              torch.arange(len(prompt)))[-1]).float())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- (b) greedy: ar, llama.cpp, the GGUF drafter
def test_greedy_with_gguf_drafter_equals_ar_and_llama_cpp(files, target, bin_dir):
    ref = greedy_tokens(bin_dir, files["target.gguf"], PROMPT, N)
    ids = target.tokenizer.encode(PROMPT)
    assert ids == ref.prompt
    gen = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    ar = Engine(target).generate(ids, gen).token_ids
    assert ar == ref.tokens
    for name in ("random.gguf", "repeat.gguf"):
        method = drafter_method(str(files[name]))
        assert method.name == "eagle3"
        done = Engine(target, method=method).generate(ids, gen)
        assert done.token_ids == ar, name
        assert done.stats.drafted_tokens > 0


# ---------------------------------------------------------------- (c) llama-speculative-simple's counts
@pytest.mark.parametrize("name", ["repeat", "random"])
def test_rounds_against_llama_speculative_simple(files, bin_dir, name, monkeypatch):
    """Both runners in the same state before their first round: llama-speculative-simple drafts from its prompt's
    last token (the target has run the rest), speculant after its prefill from the token that prefill chose; so
    llama.cpp gets the prompt with that first token appended. Then round by round the K drafts and the accepted
    count must be equal, up to a near-tie in the drafter's choice (two implementations' float sums: llama.cpp's
    probability of our draft within llama_cpp_ref.NEAR_TIE of its top one), after which the runs part."""
    model = load_model(str(files["target.gguf"]), None, progress=False, use_cache=False, kv_dtype="f32")
    ids = model.tokenizer.encode(PROMPT)
    method = drafter_method(str(files[f"{name}.gguf"]), MethodConfig(governor=GovernorConfig("off"),
                                                                    heads=HeadsConfig(nodes=K, depth=K, topk=1, fmt="float32")))
    chains, counts = [], []  # speculant's rounds, by spying on its drafter and its stats
    propose, record = EagleDrafter.propose, Stats.record_round
    monkeypatch.setattr(EagleDrafter, "propose", lambda self, p, k: (t := propose(self, p, k), chains.append(t.tokens.tolist()))[0])
    monkeypatch.setattr(Stats, "record_round", lambda self, d, a: (counts.append(a), record(self, d, a))[1])
    done = Engine(model, method=method).generate(ids, GenerationConfig(max_new_tokens=N + 1, ignore_eos=True))
    first = done.token_ids[0]
    prompt = PROMPT + model.tokenizer.decode([first])
    assert greedy_tokens(bin_dir, files["target.gguf"], prompt, 1).prompt == ids + [first]
    text, theirs, drafted, accepted = speculative_rounds(bin_dir, files["target.gguf"], prompt, "draft-eagle3", k=K, n=N,
                                                         drafter=files[f"{name}.gguf"])
    assert model.tokenizer.decode(ids + done.token_ids) in text  # the same greedy text
    s = done.stats
    print(f"\n{name}: llama.cpp drafted {drafted} accepted {accepted} in {len(theirs)} rounds "
          f"{[r.accepted for r in theirs]}; speculant drafted {s.drafted_tokens} accepted {s.accepted_tokens} in "
          f"{s.rounds} rounds {counts}")
    same = equal_rounds(chains, counts, theirs, K)
    matched = sum(counts[:same])
    assert same >= 10
    if name == "repeat":
        assert matched >= 4  # the drafter is right in those rounds: not 0 against 0


# ---------------------------------------------------------------- (d) files that are not a drafter for this target
def test_not_a_drafter_gguf_is_a_clear_error(files, target):
    with pytest.raises(SpeculantError, match="architecture 'qwen3'.*--draft MODEL"):
        drafter_method(str(files["target.gguf"]))
    with pytest.raises(SpeculantError, match="architecture 'qwen3'"):
        load_head(files["target.gguf"], target.config)
    smollm2 = load_model(REAL, None, progress=False)
    with pytest.raises(SpeculantError, match="hidden_size is 64, the target's hidden size is 576"):
        load_head(files["random.gguf"], smollm2.config)


def test_cli_drafter_gguf_matches_ar(files, capsys, monkeypatch):
    from speculant.cli import main

    monkeypatch.setenv("SPECULANT_HOME", str(files["target"].parent / "home"))
    common = ["--model", str(files["target.gguf"]), "-n", "12", "--stats", "--no-progress", PROMPT]
    outs = []
    for extra in (["--method", "ar"], ["--drafter", str(files["repeat.gguf"])]):
        rc = main(["generate", *extra, *common])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    assert outs[0][0] == outs[1][0] and outs[1][1]["method"] == "eagle3" and outs[1][1]["drafted_tokens"] > 0
