"""Qwen3.5 GGUF files (arch qwen35) as llama.cpp's convert_hf_to_gguf.py writes them, with llama.cpp as the reference
(tests/llama_cpp_ref.py).

A tiny Qwen3.5 (tests/qwen35_tiny.py: head_dim 256, so llama.cpp's default M-RoPE sections cover the rotary, and 4
value heads over 2 key heads, so the converter reorders the value heads) with an MTP layer and Qwen2.5's tokenizer
(from the real preset's GGUF; the converter recognizes it by its hash) is converted to F32 and quantized by
llama-quantize to F16 and Q8_0. It is built to be predictable enough for drafting to matter: the output layer is a
row permutation of the embedding, so the last token's embedding alone would pick a fixed "next token", and the layers'
outputs (scaled) move the choice with the context; the MTP layer's fc passes the embedding through (plus a little of
the hidden state), so its drafts are right when the target follows the embedding's pick. Then:

(a) the GGUF model (float32) gives the HF folder's logits, and transformers', over a 300-token prompt (the recurrence
    runs long), and the same MTP logits;
(b) greedy tokens of the F32, F16 and Q8_0 files (each side's default kernels and f16 KV cache) equal llama.cpp's;
(c) `--method mtp` on the GGUF target is greedy-identical to `ar`, and is the default method of such a file;
(d) round by round, the MTP drafts and accepted counts equal llama-speculative-simple --spec-type draft-mtp's;
(e) qwen35 GGUFs that are MoE, lack a tensor or have M-RoPE sections short of the rotary are clear errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_tokenizer import gguf_tokenizer
from llama_cpp_ref import convert_hf_to_gguf, equal_rounds, greedy_tokens, llama_cpp_bin, quantize, speculative_rounds
from qwen35_tiny import save_qwen35

from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.config import MethodConfig, parse_method
from speculant.methods.mtp import MTPDrafter
from speculant.models import load_model
from speculant.models.transformer import FINAL_HIDDEN
from speculant.decoding.stats import Stats

pytestmark = pytest.mark.real  # Qwen2.5's tokenizer comes from the real preset's GGUF

REAL = "qwen2.5-coder-0.5b-instruct"
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
N, K = 32, 3
SHARP = 20.0  # the output layer's scale: greedy choices clear of ties
LAYER_SCALE = 1.2  # of every layer's output projections: the context moves the next token at times
HIDDEN_SHARE = 0.3  # of the MTP fc's hidden-state half


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return llama_cpp_bin()


@pytest.fixture(scope="module")
def files(tmp_path_factory, bin_dir) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    from speculant.hub import resolve_model

    root = tmp_path_factory.mktemp("qwen35-gguf")
    real = resolve_model(REAL)
    tok = gguf_tokenizer(real)
    folder = save_qwen35(root / "hf", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    tok.save_pretrained(folder)  # replaces the word-level tokenizer
    f = folder / "model.safetensors"
    t = load_file(str(f))
    g = torch.Generator().manual_seed(5)
    embed = t["model.embed_tokens.weight"]
    D = embed.shape[1]
    t["lm_head.weight"] = SHARP * embed[torch.randperm(embed.shape[0], generator=g)]
    for k in t:
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t[k] = t[k] * LAYER_SCALE
    t["mtp.fc.weight"] = torch.cat([torch.eye(D), HIDDEN_SHARE * torch.randn(D, D, generator=g) * D**-0.5], 1)
    save_file(t, str(f), metadata={"format": "pt"})
    f32 = convert_hf_to_gguf(folder, root / "f32.gguf")
    return {"hf": folder, "f32": f32, "f16": quantize(bin_dir, f32, root / "f16.gguf", "F16"),
            "q8_0": quantize(bin_dir, f32, root / "q8_0.gguf", "Q8_0")}


@pytest.fixture(scope="module")
def loaded(files):
    """Loaded models by (file, dtype, kv_dtype), shared by the module's tests."""
    cache = {}

    def get(name: str, dtype: str | None = None, kv: str | None = None):
        if (name, dtype, kv) not in cache:
            cache[name, dtype, kv] = load_model(str(files[name]), dtype, progress=False, use_cache=False, kv_dtype=kv)
        return cache[name, dtype, kv]

    return get


# ---------------------------------------------------------------- (a) the GGUF model is the HF folder's
def test_gguf_logits_equal_the_hf_folder_and_transformers(files, loaded):
    from transformers import AutoModelForCausalLM

    hf, gg = loaded("hf", "float32"), loaded("f32", "float32")
    assert gg.model.cfg.n_layers == 4 and gg.model.cfg.mtp_layers == 1 and gg.model.cfg.lin_v_heads == 4
    ids = torch.randint(0, hf.config.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (hf.model, gg.model):
        cache = m.new_cache(len(ids) + 8)
        fwd = m(ids, cache, taps=(FINAL_HIDDEN,))
        step = m(torch.tensor([7, 8, 9]), cache).logits  # short passes on the long recurrent state
        outs.append((fwd.logits, step, fwd.taps[FINAL_HIDDEN]))
    ref = AutoModelForCausalLM.from_pretrained(str(files["hf"]), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    gap_hf = (outs[1][0] - outs[0][0]).abs().max().item()
    gap_step = (outs[1][1] - outs[0][1]).abs().max().item()
    gap_tf = (outs[1][0] - want).abs().max().item()
    # the MTP layer over (t_p, h_{p-1}) of the whole prompt, from each model's own hidden states
    mtp = []
    for m, (_, _, h) in zip((hf.model, gg.model), outs):
        hidden = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
        mtp.append(m.mtp(m, ids, hidden, m.mtp.new_cache(m, len(ids)))[1])
    gap_mtp = (mtp[1] - mtp[0]).abs().max().item()
    print(f"\nmax |logit diff| over 300 tokens (scale {want.abs().max().item():.1f}): GGUF vs HF folder {gap_hf:.2e}, "
          f"vs transformers {gap_tf:.2e}; 3 decode rows {gap_step:.2e}; MTP {gap_mtp:.2e}")
    assert max(gap_hf, gap_tf, gap_step, gap_mtp) <= 1e-4


# ---------------------------------------------------------------- (b) greedy: llama.cpp on the same files
@pytest.mark.parametrize("name", ["f32", "f16", "q8_0"])
def test_greedy_equals_llama_cpp(files, loaded, bin_dir, name):
    model = loaded(name)
    assert model.dtype == "gguf"
    ref = greedy_tokens(bin_dir, files[name], PROMPT, N)
    ids = model.tokenizer.encode(PROMPT)
    assert ids == ref.prompt
    ours = Engine(model).generate(ids, GenerationConfig(max_new_tokens=N, ignore_eos=True)).token_ids
    print(f"\n{name}: {sum(a == b for a, b in zip(ours, ref.tokens))}/{N} greedy tokens equal llama.cpp's")
    assert ours == ref.tokens


# ---------------------------------------------------------------- (c) --method mtp on the GGUF target
@pytest.mark.parametrize("name", ["f32", "q8_0"])
def test_mtp_on_gguf_is_ar(loaded, name):
    model = loaded(name)
    assert model.model.mtp is not None
    ids = model.tokenizer.encode(PROMPT)
    gen = GenerationConfig(max_new_tokens=N, ignore_eos=True)
    ar = Engine(model).generate(ids, gen).token_ids
    done = Engine(model, method=MethodConfig("mtp")).generate(ids, gen)
    assert done.token_ids == ar
    assert 0 < done.stats.accepted_tokens < done.stats.drafted_tokens


def test_mtp_is_the_default_method_of_a_gguf_that_ships_it(files, tmp_path, capsys, monkeypatch):
    import json

    from speculant.cli import main
    from speculant.cli_options import default_method

    assert default_method(str(files["q8_0"]), None) == "mtp"
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    outs = []
    for extra in ([], ["--method", "ar"]):
        rc = main(["generate", "--model", str(files["q8_0"]), *extra, "-n", "12", "--stats", "--no-progress", PROMPT])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    assert outs[0][1]["method"] == "mtp" and outs[0][1]["drafted_tokens"] > 0
    assert outs[0][0] == outs[1][0]


# ---------------------------------------------------------------- (d) llama-speculative-simple --spec-type draft-mtp
def test_mtp_rounds_against_llama_speculative_simple(files, loaded, bin_dir, monkeypatch):
    """Both in the same state before their first round: llama-speculative-simple drafts from its prompt's last token
    (the target has run the rest), speculant after its prefill from the token that prefill chose; so llama.cpp gets
    the prompt with that first token appended. Then round by round the K drafts and the accepted counts must be equal
    (a differing draft only at a near-tie of llama.cpp's probabilities, after which the runs part)."""
    model = loaded("f32", "float32", "f32")
    ids = model.tokenizer.encode(PROMPT)
    chains, counts = [], []
    propose, record = MTPDrafter.propose, Stats.record_round
    monkeypatch.setattr(MTPDrafter, "propose",
                        lambda self, p, k: (d := propose(self, p, k), chains.append(d.tokens.tolist()))[0])
    monkeypatch.setattr(Stats, "record_round", lambda self, d, a: (counts.append(a), record(self, d, a))[1])
    method = parse_method(f"mtp:k={K},schedule=fixed,governor=off")
    done = Engine(model, method=method).generate(ids, GenerationConfig(max_new_tokens=N + 1, ignore_eos=True))
    prompt = PROMPT + model.tokenizer.decode([done.token_ids[0]])
    assert model.tokenizer.encode(prompt) == ids + [done.token_ids[0]]
    text, theirs, drafted, accepted = speculative_rounds(bin_dir, files["f32"], prompt, "draft-mtp", k=K, n=N)
    assert model.tokenizer.decode(ids + done.token_ids) in text  # the same greedy text
    s = done.stats
    print(f"\nllama.cpp drafted {drafted} accepted {accepted} in {len(theirs)} rounds {[r.accepted for r in theirs]}; "
          f"speculant drafted {s.drafted_tokens} accepted {s.accepted_tokens} in {s.rounds} rounds {counts}")
    same = equal_rounds(chains, counts, theirs, K)
    matched = sum(counts[:same])
    assert same >= 6 and 0 < matched < K * same  # drafts both accepted and rejected, alike


# ---------------------------------------------------------------- (e) qwen35 files speculant cannot run
def _rewrite(src: Path, dst: Path, *, arch: str = "qwen35", drop: tuple[str, ...] = (), add: dict | None = None,
             meta: dict | None = None) -> Path:
    """A copy of the F32 file's model (metadata and tensors, no tokenizer; a 256-row vocabulary) with edits."""
    import gguf

    from speculant.gguf_file import GGUFFile

    f = GGUFFile(src)
    w = gguf.GGUFWriter(str(dst), arch)
    for key, value in f.fields.items():
        if key.startswith("qwen35.") and key.removeprefix("qwen35.") not in (meta or {}):
            vtype, sub = f.field_types[key]
            w.add_key_value(f"{arch}.{key.removeprefix('qwen35.')}", value, vtype, sub)
    for key, value in (meta or {}).items():
        if isinstance(value, list):
            w.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        elif value is not None:
            w.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.UINT32)
    for t in f.tensors:
        if t.name not in drop:
            a = f.dequantize(t)
            w.add_tensor(t.name, a[:256] if t.name in ("token_embd.weight", "output.weight") else a)
    for name, a in (add or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_files_it_cannot_run_are_clear_errors(files, tmp_path):
    f32 = files["f32"]
    ok = _rewrite(f32, tmp_path / "ok.gguf")
    from speculant.models.qwen35_gguf import Qwen35GGUFSource

    assert Qwen35GGUFSource(ok).config.vocab_size == 256  # the copy itself reads
    cases = [
        ({"arch": "qwen35moe"}, "mixture of experts"),
        ({"add": {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}}, "mixture-of-experts"),
        ({"meta": {"expert_count": 8}}, "mixture-of-experts"),
        ({"drop": ("blk.1.ssm_a",)}, "has no tensor blk.1.ssm_a"),
        ({"drop": ("blk.4.nextn.eh_proj.weight",)}, "has no tensor blk.4.nextn.eh_proj.weight"),
        ({"add": {"blk.4.nextn.embed_tokens.weight": np.zeros((256, 64), np.float32)}}, "no place for"),
        ({"meta": {"rope.dimension_sections": [11, 11, 5, 0]}}, "rotary pair"),
        ({"meta": {"ssm.time_step_rank": 3}}, "ssm.time_step_rank"),
        ({"meta": {"block_count": None}}, "lacks metadata qwen35.block_count"),
    ]
    with pytest.raises(SpeculantError, match="--dtype int8 is not available for a Qwen3.5 GGUF file; choose gguf"):
        load_model(str(ok), "int8", progress=False, use_cache=False)
    for i, (edit, message) in enumerate(cases):
        bad = _rewrite(f32, tmp_path / f"bad{i}.gguf", **edit)
        with pytest.raises(SpeculantError, match=message):
            load_model(str(bad), progress=False, use_cache=False)


def test_architecture_is_read_wherever_the_header_has_it(tmp_path):
    """The dispatch's quick read of the first metadata entry, and the whole header where the entry is later."""
    import gguf

    from speculant.gguf_file import architecture

    for first in (True, False):
        w = gguf.GGUFWriter(str(tmp_path / f"{first}.gguf"), "qwen35")
        w.add_uint32("qwen35.block_count", 1)
        if not first:
            kv = w.kv_data[0]
            kv["general.architecture"] = kv.pop("general.architecture")
        w.add_tensor("x", np.zeros(4, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert architecture(tmp_path / f"{first}.gguf") == "qwen35"
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    assert architecture(tmp_path / "text.gguf") is None
