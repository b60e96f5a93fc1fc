"""`train-heads` on a tiny target: held-out loss falls, the checkpoint resumes, the head drafts exactly."""

import json
from dataclasses import replace

import pytest
import torch

from conftest import tiny_model
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.errors import SpeculantError
from speculant.training.data import DataConfig, sequences
from speculant.methods.heads import HeadsConfig
from speculant.training.train import TrainConfig, train
from speculant.models import load_model


@pytest.fixture
def corpus(tmp_path):
    g = torch.Generator().manual_seed(0)
    files = []
    for i in range(12):  # documents of a random walk over 32 words: enough to split into train and validation
        ids = torch.randint(0, 32, (700,), generator=g)
        f = tmp_path / "text" / f"doc{i}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text(" ".join(f"t{t}" for t in ids.tolist()))
        files.append(f)
    return files


@pytest.mark.parametrize("method", ["medusa", "eagle2", "eagle3", "dflash"])
def test_train_resume_and_draft(method, corpus, tmp_path):
    target = tiny_model(32, seed=3, layers=4, logit_scale=3.0)
    dcfg = DataConfig(seq_len=64, tokens=2048, val_fraction=0.2)
    tcfg = TrainConfig(method, minutes=2.0, batch=4, draft_vocab=24, medusa_heads=2, eval_every=5, epochs=3)
    out = tmp_path / "heads" / method
    stats = train(target, tcfg, dcfg, corpus, out, progress=False)
    assert stats["steps"] > 5 and not stats["resumed"]
    assert stats["val"]["loss"] < stats["val_start"]["loss"]
    from speculant.heads.formats import head_method

    assert head_method(out) == method  # dflash: z-lab's layout
    # the same recipe with more epochs continues from the checkpoint
    again = train(target, replace(tcfg, epochs=5), dcfg, corpus, out, progress=False)
    assert again["resumed"] and again["steps"] > stats["steps"]
    gen = GenerationConfig(max_new_tokens=30)
    prompt = [1, 5, 9, 2, 7, 7, 3]
    ref = Engine(target).generate(prompt, gen).token_ids
    e = Engine(target, method=MethodConfig(method, heads=HeadsConfig(name=str(out), nodes=6)))
    done = e.generate(prompt, gen)
    # a block drafter on this random target drafts, but its blocks are rarely right (test_dflash_trained trains one
    # on a target that has learned a text, and counts its accepted drafts)
    assert done.token_ids == ref and (done.stats.accepted_tokens if method != "dflash" else done.stats.drafted_tokens) > 0


def test_heads_train_in_bf16_only_where_the_cpu_multiplies_it():
    """bf16 autocast where the CPU has bf16 instructions; elsewhere (AVX2, AVX512 without BF16) oneDNN emulates
    bf16 matmuls many times slower than float32 ones, so training runs in float32 there."""
    from speculant.heads.config import default_config
    from speculant.heads.modules import build_head
    from speculant.models.native import bf16_native
    from speculant.training.train import Trainer

    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    assert not bf16_native({"avx2", "fma", "f16c"}) and not bf16_native(avx512)
    assert bf16_native(avx512 | {"avx512_bf16"}) and bf16_native({"avx2", "amx_bf16"})
    target = tiny_model(32)
    head = build_head(default_config("eagle3", target.config, 24))
    assert Trainer(target.model, head, TrainConfig("eagle3")).bf16 == bf16_native()


def test_no_bf16_where_torchs_kernels_are_capped_below_avx512(monkeypatch):
    """A CPU with AVX512-BF16 whose torch runs capped to AVX2 (how a larger host measures AVX2 speed) emulates
    bf16 again: training stays in float32 there."""
    import torch

    from speculant.models import native

    flags = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert native.bf16_native()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not native.bf16_native()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert native.bf16_native()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not native.bf16_native() and native.bf16_native(flags)  # another CPU's flags: hardware only


def test_the_saved_head_is_the_best_held_out_one(tmp_path):
    """A head that got worse on held-out text after its best evaluation is not what the run leaves:
    the folder keeps the weights of the best evaluation, the run's last metrics beside them; a resumed
    run starts from that score."""
    from safetensors.torch import load_file

    from speculant.heads.config import default_config
    from speculant.heads.modules import build_head
    from speculant.training.train import _Best

    target = tiny_model(32)
    head = build_head(default_config("eagle3", target.config, 24))
    out = tmp_path / "best"
    best = _Best(out, resumed=False)
    weights = []
    for step, chain in ((5, 0.1), (10, 0.3), (15, 0.2)):
        with torch.no_grad():
            head.fc.weight.fill_(step)
        weights.append(head.fc.weight.clone())
        metrics = {"loss": 1.0, "acc": [chain], "chain": chain}
        best.offer(head, metrics, step, {"steps": step} if step == 15 else None)
    saved = json.loads((out / "config.json").read_text())["stats"]
    assert saved["best_step"] == 10 and saved["val"]["chain"] == 0.3 and saved["val_last"]["chain"] == 0.2
    assert saved["steps"] == 15
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], weights[1])
    again = _Best(out, resumed=True)
    assert again.score == (0.3, -1.0)
    again.offer(head, {"loss": 0.5, "acc": [0.3], "chain": 0.3}, 20)  # same chain, lower loss: better
    assert json.loads((out / "config.json").read_text())["stats"]["best_step"] == 20


def test_data_split_and_errors(corpus, tmp_path):
    target = tiny_model(32)
    tr, val, fp = sequences(target.tokenizer, corpus, DataConfig(seq_len=64, tokens=2048, val_fraction=0.2))
    assert tr.shape == (32, 64) and val.shape[1] == 64 and val.shape[0] >= 1
    assert fp == sequences(target.tokenizer, corpus, DataConfig(seq_len=64, tokens=2048, val_fraction=0.2))[2]
    with pytest.raises(SpeculantError, match="--minutes"):
        TrainConfig("eagle3", minutes=0)
    with pytest.raises(SpeculantError, match="unknown --method"):
        TrainConfig("eagle9")
    with pytest.raises(SpeculantError, match="not enough training text"):
        sequences(target.tokenizer, corpus[:1], DataConfig(seq_len=4096, tokens=8192))


def test_training_on_the_targets_answers(corpus, tmp_path):
    """--prompts: the target answers every prompt (greedy: its own continuation, kept as a document in a
    folder a rerun reuses), the answers come first in the training text, and a budget with no time left
    for a single answer is a clear error."""
    from speculant.training.answers import AnswerConfig, answer, answers_folder

    target = tiny_model(32, seed=3, layers=2, logit_scale=3.0)
    prompts = [" ".join(f"t{(7 * i + j) % 32}" for j in range(6)) for i in range(10)]
    acfg = AnswerConfig(max_tokens=40)
    tcfg = TrainConfig("eagle3", minutes=2.0, batch=4, draft_vocab=24, eval_every=5, epochs=2)
    stats = train(target, tcfg, DataConfig(seq_len=32, tokens=512, val_fraction=0.2), corpus, tmp_path / "heads" / "h",
                  progress=False, prompts=prompts, acfg=acfg)
    assert stats["answers"] == 10
    folder = answers_folder(tmp_path / "heads" / ".answers", target, prompts, acfg)
    docs = sorted(folder.glob("*.txt"))
    assert len(docs) == 10
    for p, doc in zip(prompts, docs):
        ref = Engine(target).generate(p, GenerationConfig(max_new_tokens=40)).token_ids
        assert target.tokenizer.encode(doc.read_text()) == target.tokenizer.encode(p) + ref
    # answers already there are reused, whatever the deadline; none left to answer past it
    before = [d.stat().st_mtime_ns for d in docs]
    assert answer(target, prompts, acfg, folder, deadline=0.0) == docs
    assert [d.stat().st_mtime_ns for d in docs] == before
    assert answer(target, prompts + ["t1 t2"], acfg, tmp_path / "other", deadline=0.0) == []
    # the training text starts with the answers (512 tokens fit in them)
    tr, _, _ = sequences(target.tokenizer, corpus, DataConfig(seq_len=32, tokens=512, val_fraction=0.2), docs)
    answer_ids = {t for d in docs for t in target.tokenizer.encode(d.read_text())}
    assert set(tr.flatten().tolist()) <= answer_ids
    with pytest.raises(SpeculantError, match="no time to answer"):
        train(target, replace(tcfg, minutes=1e-6), DataConfig(seq_len=32, tokens=512), corpus, tmp_path / "x" / "h",
              progress=False, prompts=["t3 t4"], acfg=acfg)


def test_prompt_files_and_their_errors(tmp_path):
    from speculant.training.answers import AnswerConfig, answer, read_prompts

    txt = tmp_path / "p.txt"
    txt.write_text("Write a haiku.\n\n  Explain zip().  \n")
    assert read_prompts(txt) == ["Write a haiku.", "Explain zip()."]
    js = tmp_path / "p.jsonl"
    js.write_text(json.dumps({"prompt": "line one\nline two"}) + "\n" + json.dumps({"prompt": "b", "id": 2}) + "\n")
    assert read_prompts(js) == ["line one\nline two", "b"]
    for body, match in (("{not json\n", "line 1: not JSON"), ('{"text": "x"}\n', "line 1: expected an object"),
                        ("\n\n", "no prompts")):
        js.write_text(body)
        with pytest.raises(SpeculantError, match=match):
            read_prompts(js)
    with pytest.raises(SpeculantError, match="cannot read"):
        read_prompts(tmp_path / "missing.txt")
    with pytest.raises(SpeculantError, match="--answer-tokens"):
        AnswerConfig(max_tokens=0)
    target = tiny_model(32, context=16)
    with pytest.raises(SpeculantError, match="prompt 2: .*context"):
        answer(target, ["t1", " ".join(["t2"] * 20)], AnswerConfig(4), tmp_path / "a", deadline=float("inf"))


@pytest.mark.real
def test_real_smollm2_trained_eagle3_matches_ar(real_model_cache, tmp_path):
    """A short self-distillation of SmolLM2 on the default corpus (stdlib text), then greedy decoding of
    a code prompt with the trained eagle3 head: identical to `ar`."""
    from speculant.training.data import default_sources

    target = real_model_cache("smollm2-135m-instruct", "gguf")
    out = tmp_path / "smol-eagle3"
    # bounded by 2 epochs of 64-token sequences (16 of them: 8 steps, the real shapes but for the sequence
    # length); the 5 minutes are room for slow or shared hosts (too short a budget leaves no training step
    # after the feature extraction: validation loss unchanged)
    stats = train(target, TrainConfig("eagle3", minutes=5.0, batch=4, draft_vocab=8192, epochs=2),
                  DataConfig(seq_len=64, tokens=1024), default_sources(), out, progress=False)
    assert stats["epochs"] == 2 and stats["steps"] == 8  # the whole recipe ran, not a time-cut part of it
    assert stats["val"]["loss"] < stats["val_start"]["loss"]
    prompt = "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n"
    gen = GenerationConfig(max_new_tokens=48)
    ref = Engine(target).generate(prompt, gen).token_ids
    done = Engine(target, method=MethodConfig("eagle3", heads=HeadsConfig(name=str(out)))).generate(prompt, gen)
    assert done.token_ids == ref
    assert done.stats.drafted_tokens > 0


def test_train_heads_cli_trains_a_dflash_drafter(corpus, tmp_path, capsys):
    """`speculant train-heads --method dflash` writes a drafter in z-lab's layout that `--drafter` runs, greedy output
    as `ar`'s (tests/test_dflash_trained.py trains one until it drafts well and checks its rounds)."""
    from test_eagle3_published import save_qwen3

    from speculant.cli import main
    from speculant.methods.heads import HeadsConfig

    model = save_qwen3(tmp_path / "qwen3", 32)
    out = tmp_path / "drafter"
    rc = main(["train-heads", "--method", "dflash", "--model", str(model), "--dtype", "float32", "--data",
               str(corpus[0].parent), "--tokens", "1024", "--seq-len", "32", "--batch", "4", "--anchors", "4",
               "--block", "4", "--minutes", "0.5", "--draft-vocab", "32", "--out", str(out), "--no-progress"])
    printed, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(printed.strip().splitlines()[-1])["heads"] == str(out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["block_size"] == 4
    target = load_model(str(model), "float32", progress=False)
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    prompt = [1, 5, 9, 2, 7, 7, 3]
    done = Engine(target, method=MethodConfig("dflash", heads=HeadsConfig(str(out)))).generate(prompt, gen)
    assert done.token_ids == Engine(target).generate(prompt, gen).token_ids and done.stats.drafted_tokens > 0
    with pytest.raises(SpeculantError, match="--block must be in 2..64"):
        TrainConfig("dflash", block=1)
    with pytest.raises(SpeculantError, match="leaves no anchor for a block of 16"):
        train(target, TrainConfig("dflash", block=16), DataConfig(seq_len=16, tokens=32), corpus, tmp_path / "x", progress=False)
