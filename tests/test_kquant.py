"""Q4_K / Q6_K quantization on load for Hugging Face models (`--dtype q4_k|q6_k`, kernels/kquant.c).

kquant.c writes out llama.cpp's reference quantizers again (quantize_row_q4_K_ref / quantize_row_q6_K_ref,
no importance matrix). Checked once byte for byte against ggml-quants.c itself, built from the
llama-cpp-python 0.3.36 sdist: normal, heavy-tailed, sparse, constant and 1e-6-scaled 256x1024 weights,
0 differing bytes for both types. Here: the error against the float weights, the same bytes on every
build and thread count, the real file's own blocks reproduced from their values, and the whole load path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from conftest import tiny_tokenizer
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.config import MethodConfig
from speculant.models import LoadedModel, native
from speculant.models.build import build_transformer
from speculant.models.formats import GGMLLinear
from speculant.models.formats.ggml_blocks import quantize_k
from speculant.models.load_hf import HFSource
from test_load_hf import save_tiny

KTYPES = (T.Q4_K, T.Q6_K)


def _weights(seed: int = 0, shape: tuple[int, int] = (48, 768)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w[3, 10] = 0.5  # an outlier, as real weights have
    w[5] = 0.0  # an all-zero row: zero blocks, no division by zero
    return w


def _rel_rmse(q: np.ndarray, qtype: T, w: np.ndarray) -> float:
    d = quants.dequantize(q, qtype)
    return float(np.sqrt(((d - w) ** 2).mean() / (w ** 2).mean()))


@pytest.mark.parametrize("qtype, worse", [(T.Q4_K, T.Q4_0), (T.Q6_K, T.Q5_0)])
def test_error_is_below_the_simpler_format_of_fewer_bits(qtype, worse):
    """Q4_K (4.5 bits) beats Q4_0 (4.5 bits) and Q6_K (6.56) beats Q5_0 (5.5) on the same weights; the
    zero row comes back as zeros."""
    w = _weights()
    q = quantize_k(native.gq_library(), w, qtype)
    assert q.shape == (48, 768 // 256 * (144 if qtype == T.Q4_K else 210))
    err, ref = _rel_rmse(q, qtype, w), _rel_rmse(quants.quantize(w, worse), worse, w)
    assert err < 0.85 * ref, (err, ref)
    assert not quants.dequantize(q, qtype)[5].any()


@pytest.mark.parametrize("qtype", KTYPES)
def test_same_bytes_on_every_build_and_thread_count(qtype):
    w = _weights(1)
    want = quantize_k(native.portable_library(), w, qtype, threads=1)
    libs = [native.library(isa) for isa in native.supported_isas()]
    assert libs or not native.cpu_ok()
    for lib in libs:
        for threads in (1, 2, 3):
            assert np.array_equal(quantize_k(lib, w, qtype, threads=threads), want)


def test_bad_weights_are_clear_errors():
    lib = native.gq_library()
    w = _weights(2)
    w[7, 100] = np.nan
    with pytest.raises(SpeculantError, match="NaN or infinite"):
        quantize_k(lib, w, T.Q4_K)
    with pytest.raises(SpeculantError, match="whole number of Q6_K blocks"):
        quantize_k(lib, _weights(3, (8, 96)), T.Q6_K)


@pytest.mark.real
def test_the_files_own_blocks_come_back_from_their_values():
    """Requantizing the real 1.5B's dequantized Q4_K / Q6_K tensors: llama.cpp made those blocks, so its
    algorithm, run again on their values, finds them again. Measured: Q4_K 99.5-100% of blocks byte for
    byte; Q6_K 82-85% byte for byte (a block has several encodings of the same values, and one step
    apart for the rest)."""
    from gguf import GGUFReader

    from speculant.hub import resolve_model

    reader = GGUFReader(resolve_model("qwen2.5-coder-1.5b-instruct"))
    lib = native.gq_library()
    seen = {T.Q4_K: 0, T.Q6_K: 0}
    for t in reader.tensors:
        qtype = T(t.tensor_type)
        if qtype not in seen or seen[qtype] == 3:
            continue
        seen[qtype] += 1
        raw = np.asarray(t.data)[:64]
        values = quants.dequantize(raw, qtype).astype(np.float32)
        again = quantize_k(lib, values, qtype)
        bb = 144 if qtype == T.Q4_K else 210
        same = (again.reshape(-1, bb) == raw.reshape(-1, bb)).all(1).mean()
        assert same >= (0.99 if qtype == T.Q4_K else 0.75), (t.name, same)
        assert _rel_rmse(again, qtype, values) < 0.01, t.name  # the blocks that differ, by about one step
    assert seen == {T.Q4_K: 3, T.Q6_K: 3}


def test_hf_folder_in_q4_k_runs_and_speculates_exactly(tmp_path: Path):
    """A tiny Qwen2 folder loaded with --dtype q4_k: Q4_K linears, the output layer in Q6_K, the 320-wide
    down projection (not whole 256-value blocks) in Q5_0 as llama.cpp would; closer to float32 than q4_0; the draft
    method with itself as the draft gives ar's tokens."""
    folder = save_tiny(tmp_path, "Qwen2ForCausalLM", torch.bfloat16, hidden_size=256, intermediate_size=320,
                       num_attention_heads=4, num_key_value_heads=2)
    model = build_transformer(HFSource(folder), "q4_k", cache_dir=tmp_path / "cache", progress=False)
    kinds = {name: "+".join(T(p.qtype).name for p in m.parts) for name, m in model.named_modules()
             if isinstance(m, GGMLLinear)}
    assert kinds["lm_head"] == "Q6_K" and kinds["blocks.0.qkv"] == "Q4_K" and kinds["blocks.0.gate_up"] == "Q4_K"
    assert kinds["blocks.1.down"] == "Q5_0"
    ids = [3, 17, 42, 5, 96, 0, 11, 64, 8, 8, 30]
    ref = build_transformer(HFSource(folder), "float32", cache_dir=None, progress=False)
    got = model(torch.tensor(ids), model.new_cache(len(ids))).logits
    want = ref(torch.tensor(ids), ref.new_cache(len(ids))).logits
    q4_0 = build_transformer(HFSource(folder), "q4_0", cache_dir=None, progress=False)
    base = q4_0(torch.tensor(ids), q4_0.new_cache(len(ids))).logits
    assert float((got - want).abs().mean()) < 0.8 * float((base - want).abs().mean())  # closer than Q4_0's 4.5 bits
    cached = build_transformer(HFSource(folder), "q4_k", cache_dir=tmp_path / "cache", progress=False)
    assert torch.equal(cached(torch.tensor(ids), cached.new_cache(len(ids))).logits, got)  # the cache holds the bytes
    loaded = LoadedModel(name="tiny", path=folder, model=model, tokenizer=tiny_tokenizer(97), dtype="q4_k")
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    ar = Engine(loaded).generate(ids, gen).token_ids
    assert Engine(loaded, loaded, MethodConfig("draft")).generate(ids, gen).token_ids == ar


@pytest.mark.parametrize("fmt", ["q4_1", "q4_k"])
def test_converted_model_runs_from_the_cache_file_like_a_gguf(tmp_path: Path, fmt: str):
    """A model quantized on load is read back from its conversion cache entry memory-mapped, on the first
    load (right after the conversion) as on later ones: its blocks are views of the file, repacked into
    tiles on first use like a GGUF file's (the fast kernels). The
    logits are those of the same blocks held in memory (the unpacked kernels, which sum in another order:
    equal to float rounding), and the same bits on every load."""
    from speculant.models.formats.ggml_tiles import _file_mapping

    folder = save_tiny(tmp_path, "Qwen2ForCausalLM", torch.bfloat16, hidden_size=256, intermediate_size=320,
                       num_attention_heads=4, num_key_value_heads=2)
    ids = [3, 17, 42, 5, 96, 0, 11, 64, 8, 8, 30]
    in_memory = build_transformer(HFSource(folder), fmt, cache_dir=None, progress=False)
    want = in_memory(torch.tensor(ids), in_memory.new_cache(len(ids))).logits
    assert all(t is None for m in in_memory.modules() if isinstance(m, GGMLLinear) for t in m.tiles())
    first = None
    for load in ("converted", "cached"):
        model = build_transformer(HFSource(folder), fmt, cache_dir=tmp_path / "cache", progress=False)
        got = model(torch.tensor(ids), model.new_cache(len(ids))).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        first = got if first is None else first
        assert torch.equal(got, first), load
        linears = [m for m in model.modules() if isinstance(m, GGMLLinear)]
        assert all(_file_mapping(p.data) is not None for m in linears for p in m.parts), load
        # every layer's parts make whole 16-row tiles but the 97-row output layer's, read as stored
        layers = [m for b in model.blocks for m in (b.qkv, b.o, b.gate_up, b.down)]
        assert all(t is not None for m in layers for t in m.tiles()), load

