"""Tiny random models of the architectures beyond llama/qwen2 (Qwen3, Gemma 3, SmolLM3, a Llama 3.2-style llama),
written by transformers' own save_pretrained, and llama.cpp's converter to turn them into GGUF files.

Norm weights are randomized (transformers initializes them to 1, or 0 for Gemma's zero-centred ones),
so a missing q/k norm or a missing `1 +` shows in the logits. The Gemma 3 model has the family's 5:1
pattern of sliding-window and global layers (llama.cpp assumes it) with a window of 8, so the test
prompts (40 tokens) are several windows long.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

SDIST = "llama-cpp-python==0.3.36"
VOCAB = 128
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

# name -> (model_type, config fields)
ARCHS: dict[str, tuple[str, dict]] = {
    # head_dim 24 != hidden_size / heads (16): the explicit head_dim is what the projections use
    "qwen3": ("qwen3", dict(head_dim=24, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 1e6})),
    "qwen3-tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    # the 5:1 pattern (transformers' default sliding_window_pattern 6), window 8, linear scaling on global layers
    "gemma3": ("gemma3_text", dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=8,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6}})),
    # what llama.cpp's GGUF cannot say (it scales queries by head_dim): another query scale, logit soft-capping
    "gemma3-scaled": ("gemma3_text", dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=8,
                                          final_logit_softcapping=3.0)),
    # SmolLM3: llama with no rotary in every fourth layer (transformers' default no_rope_layer_interval, llama.cpp's step)
    "smollm3": ("smollm3", dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 2e6})),
    # Llama 3.2 1B/3B's shape: llama3 rotary scaling, tied embeddings
    "llama3.2": ("llama", dict(head_dim=16, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


def save_arch(folder: Path, name: str) -> Path:
    """The tiny model `name` of ARCHS as an HF folder (float32), once per folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    model_type, fields = ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **_BASE, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    zero_centred = model_type == "gemma3_text"
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if zero_centred else 1.0))
    model.save_pretrained(folder)
    return folder


def reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def prompt(n: int = 40, seed: int = 1) -> list[int]:
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


# ------------------------------------------------------------------ llama.cpp's converter
def converter(cache: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist (downloaded once into `cache`),
    or a skip saying why it cannot be had."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (pip install sentencepiece)")
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    dl = cache / "dl"
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        SDIST, "-d", str(dl)], check=True, capture_output=True, timeout=600)
        (tgz,) = dl.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(tgz) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                       and any(p in m.name for p in ("/convert_hf_to_gguf.py", "/conversion/", "/gguf-py/"))]
            tar.extractall(cache, members=members, filter="data")
    except (subprocess.SubprocessError, OSError, ValueError, tarfile.TarError) as e:
        pytest.skip(f"the {SDIST} sdist (llama.cpp's converter) could not be fetched: {e}")
    return converter(cache)


def spm_tokenizer(folder: Path) -> None:
    """A tiny SentencePiece model as tokenizer.model (the converter needs a tokenizer it knows)."""
    import sentencepiece as spm

    text = [f"the quick brown fox jumps over the lazy dog {i} times" for i in range(200)]
    text += [f"def f(x): return x + {i}" for i in range(200)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=100, model_type="bpe",
                                   bos_id=2, eos_id=1, unk_id=3, pad_id=0, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())


def to_gguf(folders: list[Path], script: Path) -> list[Path]:
    """`folders` converted by llama.cpp's converter to F32 GGUFs beside them (once), in one converter process."""
    from llama_cpp_ref import convert_all

    outs = [folder.with_suffix(".gguf") for folder in folders]
    todo = [(folder, out, ["--outtype", "f32"]) for folder, out in zip(folders, outs) if not out.is_file()]
    for folder, _, _ in todo:
        if not (folder / "tokenizer.model").is_file():
            spm_tokenizer(folder)
    if todo:
        convert_all(todo, script)
    return outs
