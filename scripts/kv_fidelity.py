"""How far the KV cache's type moves a model from float32: top-1 agreement and mean KL against float32
weights with a float32 cache, in llama-perplexity's protocol (tests/test_gguf_fidelity.py's).

    .venv/bin/python scripts/kv_fidelity.py [--model qwen2.5-coder-1.5b-instruct] [--chunks 4]

Prints five rows: float32 weights with a float16 and with a q8_0 cache (each cache's rounding alone), then the
model's default format (`gguf` for a .gguf file) with a float32, a float16 and a q8_0 cache. Chunks of 512 tokens of
held-out text, the second half of each scored (255 positions a chunk); the reference scores each chunk in
one pass, the others in 16-token passes (the decode and verification route).
"""

from __future__ import annotations

import argparse
import gc

import torch

from speculant.bench.speed import compare_logits, fidelity_logits, fidelity_text
from speculant.models import load_model
from speculant.models.cache import KV_DTYPES, kv_dtype
from speculant.threads import configure_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--chunks", type=int, default=4)
    a = ap.parse_args()
    configure_threads()
    ref = load_model(a.model, "float32", progress=False)
    ids = ref.tokenizer.encode(fidelity_text())
    bos = ref.tokenizer.prompt_bos  # each chunk starts with it, as in llama-perplexity
    want = fidelity_logits(ref.model, ids, chunks=a.chunks, pass_len=512, bos=bos)

    def report(label: str, logits: torch.Tensor) -> None:
        got = compare_logits(a.model, label, want, logits)
        print(f"{label}: {got.positions} positions, mean KL {got.mean_kl:.6f}, top-1 {100 * got.top1_agreement:.2f}%",
              flush=True)

    for name in ("f16", "q8_0"):
        ref.model.kv_dtype = kv_dtype(name)
        got = fidelity_logits(ref.model, ids, chunks=a.chunks, pass_len=512, bos=bos)
        report(f"float32 weights, {name} cache", got)
    del ref
    gc.collect()
    ours = load_model(a.model, None, progress=False)
    for name in KV_DTYPES:
        ours.model.kv_dtype = kv_dtype(name)
        report(f"{ours.dtype} weights, {name} cache", fidelity_logits(ours.model, ids, chunks=a.chunks, bos=bos))


if __name__ == "__main__":
    main()
