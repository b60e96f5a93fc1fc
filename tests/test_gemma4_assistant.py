"""Gemma 4's assistant drafter (--method assistant) on the tiny Gemma 4 targets (tests/tiny_gemma4.py).

- the assistant's logits and projected state against transformers' Gemma4AssistantForCausalLM fed the same
  inputs (the target's scaled embedding, its last hidden state, its shared keys/values at a 21-token prompt, past
  the window of 8): two chained steps, with and without the clustered output layer;
- greedy output through the engine identical to `ar`, with drafts accepted and rejected;
- sampled output through the engine has the target's distribution (chi-square of each position and of the
  joint of the first two tokens against the enumerated target-only distribution), and the same check rejects
  an engine verifying against a biased p (the negative control).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_tokenizer
from sampled import biased_acceptance, exact_joint, exact_paths, sample_runs
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.governor import GovernorConfig
from speculant.heads.assistant import Assistant
from speculant.methods.config import MethodConfig, drafter_method
from speculant.methods.base import DraftLengthConfig
from speculant.models import LoadedModel
from speculant.models.gemma4_load import load_gemma4
from speculant.exact.sampler import SamplingConfig
from tiny_gemma4 import VOCAB, save_assistant, save_gemma4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma4_assistant")


def method(folder: Path, k: int = 3) -> MethodConfig:
    base = MethodConfig(draft_length=DraftLengthConfig(k=k, schedule="fixed"), governor=GovernorConfig("off"))
    return drafter_method(str(folder), base)


@pytest.mark.parametrize("ordered", (True, False))
@pytest.mark.parametrize("name", ("ple", "keqv"))
def test_assistant_matches_transformers(root, name, ordered):
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    tf, af = save_gemma4(root / name, name), save_assistant(root / f"assistant{int(ordered)}", ordered)
    ref = AutoModelForCausalLM.from_pretrained(str(tf), dtype=torch.float32).eval()
    aref = Gemma4AssistantForCausalLM.from_pretrained(str(af), dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(4))
    n = 20
    model = load_gemma4(tf, "float32")
    asst = Assistant(af, model)
    cache = model.new_cache(64)
    h = model(ids[:n], cache, taps=(-1,)).taps[-1][-1:]
    with torch.no_grad():
        out = ref(ids[None, :n], output_hidden_states=True, return_shared_kv_states=True)
        want_h, tok, gap = out.hidden_states[-1][0, -1:], ids[n : n + 1], 0.0
        assert float((h - want_h).abs().max()) < 1e-4
        for _ in range(2):  # two chained steps at the same position, as a round drafts
            emb = ref.model.embed_tokens(tok[None])
            a = aref(inputs_embeds=torch.cat([emb, want_h[None]], -1), position_ids=torch.tensor([[n]]),
                     shared_kv_states=out.shared_kv_states)
            logits, h = asst.step(cache, n, n, model.embed(tok) * model.cfg.embed_scale, h)
            gap = max(gap, float((logits - a.logits[0]).abs().max()), float((h - a.last_hidden_state[0]).abs().max()))
            want_h, tok = a.last_hidden_state[0], a.logits[0].argmax(-1)
    print(f"\nassistant on {name} (ordered {ordered}): max |diff| vs transformers {gap:.2e}")
    assert gap <= 1e-4, gap


@pytest.mark.parametrize("name", ("ple", "keqv"))
def test_assistant_is_greedy_identical_to_ar(root, name):
    tf, af = save_gemma4(root / name, name), save_assistant(root / "assistant1")
    lm = LoadedModel(name, tf, load_gemma4(tf, "float32"), tiny_tokenizer(VOCAB), "float32")
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    gen = GenerationConfig(max_new_tokens=40)
    want = Engine(lm, threads=1).generate(ids, gen).token_ids
    done = Engine(lm, method=method(af), threads=1).generate(ids, gen)
    assert done.token_ids == want
    assert done.stats.method == "assistant" and done.stats.drafted_tokens > done.stats.accepted_tokens


def test_assistant_needs_a_gemma4_target_and_its_folder(root, tmp_path):
    from conftest import tiny_model

    af = save_assistant(root / "assistant1")
    with pytest.raises(SpeculantError, match="Gemma 4 target"):
        Engine(tiny_model(VOCAB), method=method(af))
    tf = save_gemma4(root / "ple", "ple")
    lm = LoadedModel("ple", tf, load_gemma4(tf, "float32"), tiny_tokenizer(VOCAB), "float32")
    with pytest.raises(SpeculantError, match="--drafter"):
        Engine(lm, method=MethodConfig("assistant"))


# a sharpened sampler (the tiny target is flat): top 3 at temperature 0.2
SAMPLING = SamplingConfig(0.2, top_k=3)
PROMPT = [5, 17, 99, 3, 64, 5, 17, 99, 3, 64, 8, 21]
CHECKED, JOINT, GENERATED = 2, 2, 6


def _runs(root, runs: int):
    tf, af = save_gemma4(root / "ple", "ple"), save_assistant(root / "assistant1")
    lm = LoadedModel("ple", tf, load_gemma4(tf, "q8_0"), tiny_tokenizer(VOCAB), "q8_0")
    e = Engine(lm, method=method(af, k=3), threads=1)  # one thread: a tiny model's passes are all overhead
    r = sample_runs(lambda i: e, PROMPT, SAMPLING, CHECKED, VOCAB, runs, generate=GENERATED, joint=JOINT)
    levels = exact_paths(lm, PROMPT, SAMPLING, CHECKED)
    marginals = torch.stack([sum(w * p for _, w, p in level) for level in levels])
    return r, r.pvalues(marginals), r.joint_pvalue(exact_joint(levels, JOINT))


def test_assistant_sampling_has_the_targets_distribution(root):
    r, marginal, joint = _runs(root, 400)
    print(f"\nassistant sampled: drafted {r.drafted}, accepted {r.accepted}, p-values {marginal}, joint {joint:.3g}")
    assert 0 < r.accepted < r.drafted, (r.accepted, r.drafted)
    assert min(marginal) > 1e-4 and joint > 1e-4, (marginal, joint)


def test_assistant_sampling_check_rejects_a_biased_acceptance(root, monkeypatch):
    biased_acceptance(monkeypatch)
    _, marginal, _ = _runs(root, 150)
    assert min(marginal) < 1e-6, marginal


def test_cli_drafter_runs_the_assistant(root, capsys):
    from speculant.cli import main

    tf, af = save_gemma4(root / "ple", "ple"), save_assistant(root / "assistant1")
    tiny_tokenizer(VOCAB)._backend.save(str(tf / "tokenizer.json"))  # noqa: SLF001 - a folder the CLI loads
    outs = []
    for extra in (["--method", "ar"], ["--drafter", str(af), "--stats"]):
        rc = main(["generate", "--model", str(tf), "--dtype", "float32", "--threads", "1", "-n", "16", *extra,
                   "t5 t17 t99 t3 t64 t5 t17 t99"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, err))
    assert outs[1][0] == outs[0][0] and '"method": "assistant"' in outs[1][1]  # the stats go to stderr
