"""llama.cpp's DFlash drafter GGUF as a `--drafter`, with llama-speculative-simple as the reference.

A tiny Qwen3 target (SmolLM2's tokenizer, which llama.cpp's converter recognizes; F32 GGUF) and a DFlash drafter in
z-lab's layout (tests/test_dflash.py's writer) converted by llama.cpp's converter (--target-model-dir), F32 and
quantized by llama-quantize to Q8_0. Random drafters are never right, so both are built for drafts to be right at
times, without training:

- the target follows a fixed successor map: its output layer is a scaled row permutation of its embedding, so the
  last token's embedding alone picks its successor; its layers' outputs (scaled by LAYER_SCALE) move the choice
  with the context now and then;
- the drafter passes the block's anchor (the pending token) through to every draft row: its queries are zero, so
  each row attends evenly to the context and the block; its values keep every direction but the mask token's
  embedding, so of the block only the anchor adds; its output projection (PASS) makes that the row's direction,
  which the target's output layer maps to the pending token's successor. The context's rows (hidden_norm scaled
  by CONTEXT_SHARE) add noise that the target's features shape, so some drafts are wrong; the MLP adds nothing.
  Every row is the same, so the first draft is right when the target follows the map and the drafter's noise
  lets it: accepted counts are 0 or 1.

The drafter reads target layers 1, 2, 3: llama.cpp's graph has no layer input for the target's last layer (its
DFlash run aborts with "layer input tensor is null" when the ids name layer N-1).

(a) the GGUF reads as the same drafter as its folder (config and every tensor equal);
(b) greedy output with it (F32 and Q8_0) is identical to `ar` and to llama.cpp's plain greedy, through the engine
    and the CLI;
(c) llama-speculative-simple --spec-type draft-dflash runs the same pair greedily with blocks of BLOCK-1 drafts
    (every KV cache f32): round by round its drafts and accepted counts equal speculant's (the drafter in float32
    from the file's weights, the same fixed draft length), for the F32 and the Q8_0 drafter, and for the Q8_0
    drafter's own blocks through the block kernels (the default);
(d) a DFlash GGUF given to the EAGLE-3 loader says which method runs it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_ref import convert_hf_to_gguf, equal_rounds, greedy_tokens, llama_cpp_bin, quantize, speculative_rounds
from test_dflash import BLOCK, write_dflash

from speculant import Engine, GenerationConfig, MethodConfig, drafter_method, load_model
from speculant.decoding.stats import Stats
from speculant.errors import SpeculantError
from speculant.heads.formats import head_method, load_head
from speculant.methods.base import DraftLengthConfig
from speculant.methods.dflash import DFlashDrafter
from speculant.methods.governor import GovernorConfig
from speculant.methods.heads import HeadsConfig, load_dflash_drafter
from speculant.models import native
from speculant.models.formats import GGMLLinear

pytestmark = pytest.mark.real  # SmolLM2's tokenizer comes from the real preset's GGUF

REAL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
N = 32  # as _llama_speculative's
D = 64
SHARP = 20.0  # the target's output layer scale: greedy choices clear of ties
LAYER_SCALE = 0.6  # of the target's o_proj/down_proj: the context overrides the successor map at times
CONTEXT_SHARE = 0.1  # the drafter's hidden_norm: how much the context's rows blur the anchor
PASS = 10.0  # the drafter's o_proj: the anchor's share over the mask token's embedding in the residual
DRAFTERS = ("dflash.gguf", "dflash-q8_0.gguf")


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return llama_cpp_bin()


def _target(folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from speculant.hub import resolve_model

    real = resolve_model(REAL)
    tok = AutoTokenizer.from_pretrained(str(real.parent), gguf_file=real.name)
    cfg = AutoConfig.for_model("qwen3", vocab_size=len(tok), hidden_size=D, intermediate_size=96, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                               rms_norm_eps=1e-6, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(SHARP * embed[torch.randperm(embed.shape[0], generator=g)])
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(LAYER_SCALE)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _drafter(folder: Path, target: Path) -> Path:
    """The module docstring's drafter: one layer, 4 query and 4 key/value heads of 16 (values as wide as D)."""
    from safetensors.torch import load_file, save_file

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    write_dflash(folder, vocab=vocab, seed=3, layer_ids=(1, 2, 3), n_layers=1, kv_heads=4)
    t = load_file(str(folder / "model.safetensors"))
    mask = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"][vocab - 1]
    u = mask / mask.norm()
    t["layers.0.self_attn.q_proj.weight"] = torch.zeros(D, D)
    t["layers.0.input_layernorm.weight"] = torch.ones(D)  # the mask row's value is then along u alone
    t["layers.0.self_attn.v_proj.weight"] = torch.eye(D) - torch.outer(u, u)
    t["layers.0.self_attn.o_proj.weight"] = PASS * torch.eye(D)
    t["layers.0.mlp.down_proj.weight"] = torch.zeros(D, 96)
    t["hidden_norm.weight"] = CONTEXT_SHARE * t["hidden_norm.weight"]
    t["norm.weight"] = torch.ones(D)
    save_file(t, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory, bin_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash-gguf")
    target = _target(root / "target")
    folder = _drafter(root / "dflash", target)
    f32 = convert_hf_to_gguf(folder, root / "dflash.gguf", extra_args=["--target-model-dir", target])
    return {"target": target, "target.gguf": convert_hf_to_gguf(target, root / "target.gguf"), "dflash": folder,
            "dflash.gguf": f32, "dflash-q8_0.gguf": quantize(bin_dir, f32, root / "dflash-q8_0.gguf", "Q8_0")}


@pytest.fixture(scope="module")
def target(files):
    return load_model(str(files["target.gguf"]), None, progress=False, use_cache=False, kv_dtype="f32")


def test_gguf_drafter_equals_its_folder(files, target):
    assert head_method(files["dflash.gguf"]) == "dflash" and drafter_method(str(files["dflash.gguf"])).name == "dflash"
    hf, gg = (load_dflash_drafter(target, HeadsConfig(str(files[k]), fmt="float32")) for k in ("dflash", "dflash.gguf"))
    assert replace(gg.cfg, norm_eps=hf.cfg.norm_eps) == hf.cfg and gg.cfg.norm_eps == pytest.approx(hf.cfg.norm_eps)
    sh, sg = hf.state_dict(), gg.state_dict()
    assert sh.keys() == sg.keys()
    for k in sh:
        torch.testing.assert_close(sg[k], sh[k], rtol=0, atol=0, msg=k)
    q8 = load_dflash_drafter(target, HeadsConfig(str(files["dflash-q8_0.gguf"]), fmt="float32")).state_dict()
    gap = max((q8[k] - sh[k]).abs().max().item() for k in sh)
    assert 0 < gap < 0.05  # quantized, near the F32 weights


def test_greedy_with_gguf_drafters_equals_ar_and_llama_cpp(files, target, bin_dir, capsys, monkeypatch):
    from speculant.cli import main

    ids = target.tokenizer.encode(PROMPT)
    gen = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    ar = Engine(target).generate(ids, gen).token_ids
    ref = greedy_tokens(bin_dir, files["target.gguf"], PROMPT, N)
    assert ref.prompt == ids and ref.tokens == ar
    for name in DRAFTERS:
        done = Engine(target, method=drafter_method(str(files[name]))).generate(ids, gen)
        assert done.token_ids == ar, name
        assert 0 < done.stats.accepted_tokens < done.stats.drafted_tokens, name
    monkeypatch.setenv("SPECULANT_HOME", str(files["target"].parent / "home"))
    common = ["--model", str(files["target.gguf"]), "-n", "12", "--stats", "--no-progress", PROMPT]
    outs = []
    for extra in (["--method", "ar"], ["--drafter", str(files["dflash.gguf"])]):
        rc = main(["generate", *extra, *common])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    assert outs[0][0] == outs[1][0] and outs[1][1]["method"] == "dflash" and outs[1][1]["accepted_tokens"] > 0


def test_block_format_keeps_the_files_blocks_in_tiles(files, target):
    """A Q8_0 drafter GGUF multiplies the file's own blocks (no dequantize-requantize), and every layer that makes
    whole 16-row tiles, from the file or quantized on load from a folder, is repacked into them (the kernel a
    16-row round wants)."""
    q8 = load_dflash_drafter(target, HeadsConfig(str(files["dflash-q8_0.gguf"])))
    folder = load_dflash_drafter(target, HeadsConfig(str(files["dflash"])))
    lib = native.gq_library()
    for model in (q8, folder):
        linears = {n: m for n, m in model.named_modules() if isinstance(m, GGMLLinear)}
        assert len(linears) == 7 + 1  # one layer's seven and fc
        for n, m in linears.items():
            p = m.parts[0]
            assert (m.tiles()[0] is not None) == bool(lib.gq_packable(p.qtype, p.rows, m.in_features)), n
        assert linears["layers.0.q_proj"].tiles()[0] is not None
    for n, m in q8.named_modules():
        if isinstance(m, GGMLLinear):
            assert isinstance(m.parts[0].data.base, np.memmap) or isinstance(m.parts[0].data, np.memmap), n


@pytest.mark.parametrize("name,fmt", [(n, "float32") for n in DRAFTERS] + [("dflash-q8_0.gguf", None)])
def test_rounds_against_llama_speculative_simple(files, target, bin_dir, name, fmt, monkeypatch):
    """As test_eagle3_llama_cpp's: llama.cpp gets the prompt with speculant's first token appended, so both draft
    their first block from the same state; then every round's drafts and accepted count must be equal. fmt None:
    the Q8_0 file's own blocks through the block kernels, as the engine runs it by default."""
    k = BLOCK - 1
    ids = target.tokenizer.encode(PROMPT)
    method = drafter_method(str(files[name]), MethodConfig(
        draft_length=DraftLengthConfig(k, "fixed", k), governor=GovernorConfig("off"), heads=HeadsConfig(fmt=fmt)))
    chains, counts = [], []
    propose, record = DFlashDrafter.propose, Stats.record_round
    monkeypatch.setattr(DFlashDrafter, "propose", lambda self, p, n: (t := propose(self, p, n), chains.append(t.tokens.tolist()))[0])
    monkeypatch.setattr(Stats, "record_round", lambda self, d, a: (counts.append(a), record(self, d, a))[1])
    done = Engine(target, method=method).generate(ids, GenerationConfig(max_new_tokens=N + 1, ignore_eos=True))
    first = done.token_ids[0]
    prompt = PROMPT + target.tokenizer.decode([first])
    assert greedy_tokens(bin_dir, files["target.gguf"], prompt, 1).prompt == ids + [first]
    text, theirs, drafted, accepted = speculative_rounds(bin_dir, files["target.gguf"], prompt, "draft-dflash", k=k,
                                                         n=N, drafter=files[name])
    assert target.tokenizer.decode(ids + done.token_ids) in text
    print(f"\n{name}: llama.cpp drafted {drafted} accepted {accepted} in {len(theirs)} rounds "
          f"{[r.accepted for r in theirs]}; speculant {done.stats.drafted_tokens} / {done.stats.accepted_tokens} in "
          f"{done.stats.rounds} rounds {counts}")
    same = equal_rounds(chains, counts, theirs, k)
    matched = counts[:same]
    assert same >= 10 and 0 < sum(matched) < same  # drafts both right and wrong, alike in both


def test_dflash_gguf_is_not_an_eagle3_head(files, target):
    with pytest.raises(SpeculantError, match="a DFlash drafter; run it with --method dflash"):
        load_head(files["dflash.gguf"], target.config)
