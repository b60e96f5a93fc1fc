"""The command line as a user meets it: one clear line and exit code 2 for every kind of bad input."""

import json

import numpy as np
import pytest

from speculant.cli import main

SMALL = "smollm2-135m-instruct"


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc, err, *needles):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def write_gguf(path, arch="llama", bad_type=False, dim=8, hidden=16, quant=None, embed_quant=None):
    """A tiny, complete GGUF model file (random weights, a 4-token byte-level vocabulary; the matrices in
    `quant`, a GGMLQuantizationType name, or float32; the embedding table in `embed_quant`, else as they)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    vocab = 4
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["a", "b", "c", "ab"])
    w.add_token_types([1, 1, 1, 1])
    w.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,), "blk.0.attn_norm.weight": (dim,),
              "blk.0.ffn_norm.weight": (dim,), "blk.0.attn_q.weight": (dim, dim), "blk.0.attn_k.weight": (dim // 2, dim),
              "blk.0.attn_v.weight": (dim // 2, dim), "blk.0.attn_output.weight": (dim, dim),
              "blk.0.ffn_gate.weight": (hidden, dim), "blk.0.ffn_up.weight": (hidden, dim),
              "blk.0.ffn_down.weight": (dim, hidden)}
    for name, shape in shapes.items():
        if bad_type and name == "blk.0.ffn_up.weight":  # Q8_1 (40-byte blocks): the gguf package cannot dequantize it
            w.add_tensor(name, np.zeros((hidden, 40), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
            continue
        data = rng.standard_normal(shape).astype(np.float32)
        qname = (embed_quant or quant) if name == "token_embd.weight" else quant
        if qname and len(shape) == 2:
            qtype = gguf.GGMLQuantizationType[qname]
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            continue
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("dim, hidden, quant, expect", [
    (32, 64, None, "q4_0"),  # float32 blocks: requantized
    (32, 64, "Q8_0", "q4_0"),
    (32, 64, "Q4_0", "gguf"),  # already 4-bit: kept
    (32, 16, None, "gguf"),  # ffn_down's rows of 16 values: no whole Q4_0 blocks
])
def test_a_draft_model_loads_in_q4_0_unless_its_file_is_4_bit(tmp_path, monkeypatch, dim, hidden, quant, expect):
    from speculant.gguf_file import GGUFFile
    from speculant.models import draft_dtype, load_model

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "tiny.gguf", dim=dim, hidden=hidden, quant=quant)
    assert draft_dtype(GGUFFile(path).tensors) == expect
    assert load_model(str(path), progress=False, draft=True).dtype == expect
    assert load_model(str(path), progress=False).dtype == "gguf"  # a target runs its file's own blocks


def test_a_requantized_gguf_keeps_its_embedding_table_in_its_own_type(tmp_path, monkeypatch):
    """The conversion cache keeps a .gguf's embedding table as the file stores it (rows dequantized on lookup,
    as --dtype gguf runs it): the float32 table's values, a quarter of its bytes for Q8_0."""
    import torch
    from safetensors import safe_open

    from speculant.models import load_model
    from speculant.models.formats import GGMLEmbedding
    from speculant.models.load_gguf import GGUFSource

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "tiny.gguf", dim=32, hidden=64, quant="Q8_0")
    ids = torch.tensor([0, 1, 2, 3, 1])
    want = GGUFSource(path).get("embed")[ids]
    logits = []
    for load in ("converted", "cached"):
        model = load_model(str(path), "q4_0", progress=False).model
        assert isinstance(model.embed, GGMLEmbedding) and model.embed.part.qtype == 8, load  # Q8_0, as stored
        assert torch.equal(model.embed(ids), want), load
        logits.append(model(ids, model.new_cache(len(ids))).logits)
    assert torch.equal(*logits)
    (entry,) = (tmp_path / "home" / "converted").glob("*.safetensors")
    with safe_open(str(entry), framework="pt") as f:
        keys = set(f.keys())
    assert "embed.ggml_data" in keys and "embed" not in keys


def test_a_requantized_gguf_whose_embedding_type_the_kernels_lack_keeps_a_float_table(tmp_path, monkeypatch):
    import torch

    from speculant.models import load_model
    from speculant.models.load_gguf import GGUFSource

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    # TQ2_0: the gguf package dequantizes it, speculant's kernels do not multiply it
    path = write_gguf(tmp_path / "tiny.gguf", dim=256, hidden=256, quant="Q8_0", embed_quant="TQ2_0")
    ids = torch.tensor([0, 3, 1])
    for load in ("converted", "cached"):
        model = load_model(str(path), "q4_0", progress=False).model
        assert torch.equal(model.embed(ids), GGUFSource(path).get("embed")[ids]), load
        assert model(ids, model.new_cache(3)).logits.isfinite().all(), load


@pytest.mark.real
def test_cli_loads_the_default_draft_in_q4_0_and_draft_dtype_overrides(monkeypatch):
    from speculant.cli import build_parser, load_engine

    monkeypatch.setenv("SPECULANT_THREADS", "1")
    base = ["generate", "--model", "qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "hi"]
    # --dtype names the draft's format too, even the file's own one that the draft rule would replace (that
    # --dtype reaches both models, e.g. float32, test_kv_dtype_reaches_both_models_and_generates shows on a tiny file; the real int8 loads
    # cost half a minute and are test_real_spec's)
    for extra, target, draft in ((), "gguf", "q4_0"), (("--draft-dtype", "gguf"), "gguf", "gguf"), \
            (("--dtype", "gguf"), "gguf", "gguf"):
        engine = load_engine(build_parser().parse_args([*base, *extra]))
        assert (engine.target.dtype, engine.draft.dtype) == (target, draft), extra


def test_tiny_gguf_file_generates(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "tiny.gguf")
    rc, out, err = run(capsys, "generate", "--model", str(path), "--dtype", "float32", "-n", "5", "--stats", "--no-progress", "ab")
    assert rc == 0, err
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["generated_tokens"] == 5 and stats["method"] == "lookup"  # the default without --draft
    assert set(out.strip()) <= set("abc")


def test_kv_dtype_reaches_both_models_and_generates(capsys, tmp_path, monkeypatch):
    import torch

    from speculant.cli import build_parser, load_engine
    from speculant.models import load_model

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    path = str(write_gguf(tmp_path / "tiny.gguf"))
    args = ["generate", "--model", path, "--draft", path, "--dtype", "float32", "-n", "5", "--no-progress"]
    engine = load_engine(build_parser().parse_args([*args, "--kv-dtype", "f16", "ab"]))
    assert engine.target.model.kv_dtype == engine.draft.model.kv_dtype == torch.float16
    reference = load_engine(build_parser().parse_args([*args, "ab"]))  # float32 weights: a float32 cache
    assert reference.target.model.kv_dtype == reference.draft.model.kv_dtype == torch.float32
    plain = [a for a in args if a not in ("--dtype", "float32")]
    default = load_engine(build_parser().parse_args([*plain, "ab"]))  # the file's own blocks: float16
    assert (default.target.dtype, default.target.model.kv_dtype, default.draft.model.kv_dtype) == \
        ("gguf", torch.float16, torch.float16)
    assert load_model(path, "int8", progress=False).model.kv_dtype == torch.float16
    assert load_model(path, "int8", progress=False, kv_dtype="f32").model.kv_dtype == torch.float32
    outs = [run(capsys, *args, *kv, "ab") for kv in ((), ("--kv-dtype", "f16"))]
    assert all(rc == 0 for rc, _, _ in outs), outs
    # q8_0: heads of whole 32-value blocks (this file's are 4 values: one clear line), then a file whose are 32
    rc, _, err = run(capsys, *args, "--kv-dtype", "q8_0", "ab")
    assert rc != 0 and "q8_0 needs heads of whole 32-value blocks; this model's heads have 4 values" in err, err
    assert "Traceback" not in err
    wide = str(write_gguf(tmp_path / "wide.gguf", dim=64, hidden=32))
    q8 = [a if a != path else wide for a in args]
    engine = load_engine(build_parser().parse_args([*q8, "--kv-dtype", "q8_0", "ab"]))
    assert engine.target.model.kv_dtype == engine.draft.model.kv_dtype == torch.int8  # q8_0's blocks as bytes
    rc, out, err = run(capsys, *[a for a in q8 if a not in ("--dtype", "float32")], "--kv-dtype", "q8_0", "ab")
    assert rc == 0 and out.strip(), err
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'q8' (choose from f32, f16, q8_0)"
        build_parser().parse_args([*args, "--kv-dtype", "q8", "ab"])
    assert "invalid choice: 'q8'" in capsys.readouterr().err


def test_a_shape_a_block_format_cannot_hold_is_a_clear_error(tmp_path, monkeypatch):
    from speculant.errors import SpeculantError
    from speculant.models import load_model

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    path = str(write_gguf(tmp_path / "tiny.gguf"))  # rows of 8 values
    with pytest.raises(SpeculantError, match=r"to q8_0: its rows of 8 values are not whole 32-value blocks; choose "
                                             r"another --dtype"):
        load_model(path, "q8_0", progress=False, use_cache=False)


@pytest.mark.parametrize("argv, needles", [
    (["--model", "no-such-model"], ["unknown model", "qwen2.5-coder-1.5b-instruct"]),
    (["--model", "/nonexistent/model.gguf"], ["not found"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--top-p", "0"], ["top-p"]),
    (["--top-p", "1.5"], ["top-p"]),
    (["--top-k", "-3"], ["top-k"]),
    (["--min-p", "1.5"], ["min-p"]),
    (["--repeat-penalty", "0"], ["repeat penalty"]),
    (["--repeat-last-n", "-2"], ["repeat-last-n"]),
    (["--presence-penalty", "inf"], ["presence penalty"]),
    (["--frequency-penalty", "nan"], ["frequency penalty"]),
    (["--logit-bias", "12"], ["--logit-bias", "ID=BIAS"]),
    (["--logit-bias", "a=1"], ["--logit-bias"]),
    (["--logit-bias=-4=1"], ["logit bias token ids"]),
    (["--logit-bias", "7=inf"], ["logit bias", "-inf"]),
    (["--max-tokens", "0"], ["max tokens"]),
    (["--method", "draft"], ["--draft"]),
])
def test_argument_errors(capsys, argv, needles):
    rc, _, err = run(capsys, "generate", *argv, "hello")
    assert_user_error(rc, err, *needles)


def test_sampler_flags_reach_the_engine(capsys, tmp_path, monkeypatch):
    """Banning every token but one with --logit-bias leaves one possible output; the other flags pass."""
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "tiny.gguf")
    flags = ["--temperature", "0.8", "--top-p", "0.9", "--min-p", "0.01", "--repeat-penalty", "1.3",
             "--repeat-last-n", "8", "--presence-penalty", "0.2", "--frequency-penalty", "0.1", "--seed", "3"]
    from speculant.models import load_model

    vocab = load_model(str(path), "float32", progress=False).config.vocab_size
    ban = [f"--logit-bias={i}=-inf" for i in range(vocab) if i != 1]
    rc, out, err = run(capsys, "generate", "--model", str(path), "--dtype", "float32", "-n", "4", "--no-progress",
                       "--method", "lookup", *flags, *ban, "ab")
    assert rc == 0, err
    rc, out2, err = run(capsys, "generate", "--model", str(path), "--dtype", "float32", "-n", "4", "--no-progress",
                        *flags, *ban, "--logit-bias", f"{vocab}=1", "ab")
    assert_user_error(rc, err, "outside the model's vocabulary")
    rc, out3, _ = run(capsys, "generate", "--model", str(path), "--dtype", "float32", "-n", "4", "--no-progress",
                      *flags, *ban, "ab")
    assert rc == 0 and out == out3 and len(set(out.split())) == 1  # token 1, four times


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    rc, _, err = run(capsys, "generate", "--model", str(bad), "hi")
    assert_user_error(rc, err, "corrupt")


def test_truncated_gguf(capsys, tmp_path):
    from speculant.hub import resolve_model

    src = resolve_model(SMALL)
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(src.stat().st_size // 2))
    rc, _, err = run(capsys, "generate", "--model", str(cut), "hi")
    assert_user_error(rc, err, "truncated")


def test_unsupported_architecture(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--model", str(write_gguf(tmp_path / "g.gguf", arch="gpt2")), "hi")
    assert_user_error(rc, err, "unsupported architecture", "gpt2")


def test_unsupported_tensor_type(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    rc, _, err = run(capsys, "generate", "--no-progress", "--model", str(write_gguf(tmp_path / "q.gguf", bad_type=True)), "hi")
    assert_user_error(rc, err, "Q8_1")


def test_hf_folder_without_weights(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path), "hi")
    assert_user_error(rc, err, "safetensors")


@pytest.mark.real
def test_empty_prompt(capsys):
    rc, _, err = run(capsys, "generate", "--no-progress", "--model", SMALL, "   ")
    assert_user_error(rc, err, "empty")


@pytest.mark.real
def test_prompt_longer_than_context(capsys):
    rc, _, err = run(capsys, "generate", "--no-progress", "--model", SMALL, "word " * 9000)
    assert_user_error(rc, err, "context", "8192")


@pytest.mark.real
def test_incompatible_draft(capsys):
    rc, _, err = run(capsys, "generate", "--no-progress", "--model", SMALL, "--draft", "qwen2.5-coder-0.5b-instruct", "hi")
    assert_user_error(rc, err, "vocabulary")


@pytest.mark.real
@pytest.mark.parametrize("method", ["ar", "lookup"])
def test_generate_real_model_with_stats(capsys, method):
    # float32: the file's Q4_1 weights with int8 activations (--dtype gguf) turn this answer's first token,
    # a near tie (KL to float32 there: 0.003 nats after a bf16 prefill, 0.015 scored in short passes), to "L'Étoile, ..."; the dequantized file says Paris
    rc, out, err = run(capsys, "generate", "--no-progress", "--model", SMALL, "--dtype", "float32", "--method", method,
                       "--chat", "-n", "24", "--stats", "What is the capital of France?")
    assert rc == 0, err
    assert "Paris" in out
    stats = json.loads(err.strip().splitlines()[-1])
    for key in ("prompt_tokens", "generated_tokens", "prefill_seconds", "decode_seconds", "decode_tokens_per_second",
                "target_forwards", "method", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_accepted_tokens", "accepted_length_histogram", "draft_seconds", "target_seconds"):
        assert key in stats, key
    assert stats["method"] == method and 1 <= stats["generated_tokens"] <= 24
