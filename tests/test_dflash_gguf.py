"""llama.cpp's DFlash drafter GGUF as a `--drafter`, with llama-speculative-simple as the reference.

The tiny Qwen3 target of tests/test_eagle3_llama_cpp.py (its `files` fixture: SmolLM2's tokenizer, F32 GGUF) and
a random DFlash drafter in z-lab's layout (tests/test_dflash.py's writer) converted by llama.cpp's converter
(--target-model-dir). The drafter reads target layers 1, 2, 3: llama.cpp's graph has no layer input for the
target's last layer (its DFlash run aborts with "layer input tensor is null" when the ids name layer N-1).

(a) the GGUF reads as the same drafter as its folder (config and every tensor equal);
(b) greedy output with it is identical to `ar`, through the engine and the CLI;
(c) llama-speculative-simple --spec-type draft-dflash runs the same pair greedily with blocks of BLOCK-1 drafts
    (every KV cache f32): round by round its drafts and accepted count against speculant's (float32 drafter,
    the same fixed draft length);
(d) a DFlash GGUF given to the EAGLE-3 loader says which method runs it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from llama_cpp_ref import convert_hf_to_gguf
from test_dflash import BLOCK, write_dflash
from test_eagle3_llama_cpp import NEAR_TIE, PROMPT, _llama_speculative, bin_dir, files  # noqa: F401 (fixtures)

from speculant import Engine, GenerationConfig, MethodConfig, drafter_method, load_model
from speculant.errors import SpeculantError
from speculant.methods.governor import GovernorConfig
from speculant.heads.formats import head_method, load_head
from speculant.methods.heads import HeadsConfig, load_dflash_drafter
from speculant.methods.base import DraftLengthConfig
from speculant.methods.dflash import DFlashDrafter
from speculant.decoding.stats import Stats

pytestmark = pytest.mark.real

N = 32


@pytest.fixture(scope="module")
def drafter(files) -> dict:
    root = files["target"].parent
    vocab = json.loads((files["target"] / "config.json").read_text())["vocab_size"]
    folder = write_dflash(root / "dflash", vocab=vocab, seed=3, layer_ids=(1, 2, 3))
    return {"folder": folder, "gguf": convert_hf_to_gguf(folder, root / "dflash.gguf",
                                                         extra_args=["--target-model-dir", files["target"]])}


@pytest.fixture(scope="module")
def target(files):
    return load_model(str(files["target.gguf"]), None, progress=False, use_cache=False, kv_dtype="f32")


def test_gguf_drafter_equals_its_folder(drafter, target):
    assert head_method(drafter["gguf"]) == "dflash" and drafter_method(str(drafter["gguf"])).name == "dflash"
    hf, gg = (load_dflash_drafter(target, HeadsConfig(str(drafter[k]), fmt="float32")) for k in ("folder", "gguf"))
    assert replace(gg.cfg, norm_eps=hf.cfg.norm_eps) == hf.cfg and gg.cfg.norm_eps == pytest.approx(hf.cfg.norm_eps)
    sh, sg = hf.state_dict(), gg.state_dict()
    assert sh.keys() == sg.keys()
    for k in sh:
        torch.testing.assert_close(sg[k], sh[k], rtol=0, atol=0, msg=k)


def test_greedy_with_gguf_drafter_equals_ar(drafter, target, files, capsys, monkeypatch):
    from speculant.cli import main

    ids = target.tokenizer.encode(PROMPT)
    gen = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    done = Engine(target, method=drafter_method(str(drafter["gguf"]))).generate(ids, gen)
    assert done.token_ids == Engine(target).generate(ids, gen).token_ids and done.stats.drafted_tokens > 0
    monkeypatch.setenv("SPECULANT_HOME", str(files["target"].parent / "home"))
    common = ["--model", str(files["target.gguf"]), "-n", "12", "--stats", "--no-progress", PROMPT]
    outs = []
    for extra in (["--method", "ar"], ["--drafter", str(drafter["gguf"])]):
        rc = main(["generate", *extra, *common])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    assert outs[0][0] == outs[1][0] and outs[1][1]["method"] == "dflash" and outs[1][1]["drafted_tokens"] > 0


def test_rounds_against_llama_speculative_simple(drafter, files, target, bin_dir, monkeypatch):  # noqa: F811
    """As test_eagle3_llama_cpp's: llama.cpp gets the prompt with speculant's first token appended, so both draft
    their first block from the same state; then every round's drafts and accepted count must be equal."""
    k = BLOCK - 1
    ids = target.tokenizer.encode(PROMPT)
    method = drafter_method(str(drafter["gguf"]), MethodConfig(
        draft_length=DraftLengthConfig(k, "fixed", k), governor=GovernorConfig("off"), heads=HeadsConfig(fmt="float32")))
    chains, counts = [], []
    propose, record = DFlashDrafter.propose, Stats.record_round
    monkeypatch.setattr(DFlashDrafter, "propose", lambda self, p, n: (t := propose(self, p, n), chains.append(t.tokens.tolist()))[0])
    monkeypatch.setattr(Stats, "record_round", lambda self, d, a: (counts.append(a), record(self, d, a))[1])
    done = Engine(target, method=method).generate(ids, GenerationConfig(max_new_tokens=N + 1, ignore_eos=True))
    prompt = PROMPT + target.tokenizer.decode([done.token_ids[0]])
    text, theirs, drafted, accepted = _llama_speculative(bin_dir, files["target.gguf"], drafter["gguf"], prompt,
                                                         spec_type="draft-dflash", k=k)
    assert target.tokenizer.decode(ids + done.token_ids) in text
    full = [(c, n) for c, n in zip(chains, counts) if len(c) == k]  # speculant's last rounds draft fewer
    print(f"\nllama.cpp drafted {drafted} accepted {accepted} in {len(theirs)} rounds {[r.accepted for r in theirs]}; "
          f"speculant {done.stats.drafted_tokens} / {done.stats.accepted_tokens} in {done.stats.rounds} rounds {counts}")
    same = 0
    for (chain, n), r in zip(full, theirs):
        if chain != r.chain:  # allowed only at a near-tie of llama.cpp's own choice (float sums differ)
            j = next(i for i, (a, b) in enumerate(zip(chain, r.chain)) if a != b)
            p = r.candidates[j]
            print(f"round {same}: draft {j} ours {chain[j]}, llama.cpp {r.chain[j]} (its probabilities {p})")
            assert p.get(chain[j], 0.0) >= NEAR_TIE * p[r.chain[j]], "not a near-tie: the drafters differ"
            break
        assert n == r.accepted, f"round {same}: the same drafts, accepted {n} here, {r.accepted} by llama.cpp"
        same += 1
    print(f"{same} rounds equal (drafts and accepted counts) before the runs part")
    assert same >= 10


def test_dflash_gguf_is_not_an_eagle3_head(drafter, target):
    with pytest.raises(SpeculantError, match="a DFlash drafter; run it with --method dflash"):
        load_head(drafter["gguf"], target.config)
