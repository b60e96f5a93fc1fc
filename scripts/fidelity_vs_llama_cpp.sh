#!/bin/bash
# Fidelity against float32, speculant's `gguf` default and llama.cpp side by side on one GGUF file and one
# held-out text, each engine against its own float32 run of the file, in llama-perplexity's protocol: the
# text in chunks of 512 tokens, each from an empty cache and starting with BOS where the model takes one, the
# second half of each scored (speculant/bench/speed.py: FIDELITY_CTX, fidelity_chunks). The `long` text
# (bench.speed.fidelity_text(long=True), ~20 chunks, ~5,000 positions) halves the standard error of a top-1
# agreement against the 4 chunks of `short`.
# llama.cpp's float32 run is an F32 copy made by llama-quantize, with its default f16 KV cache; speculant's
# reference is scored both with a float32 cache and, as llama.cpp's, with an f16 one.
# Needs a llama.cpp build with llama-quantize and llama-perplexity (scripts/vs_llama_cpp.sh says how).
# Usage: LLAMA_CPP_BIN=build/bin bash scripts/fidelity_vs_llama_cpp.sh [PRESET] [long|short]
# (WORK=DIR keeps the F32 copy, ~7 GB for the 1.5B, and llama.cpp's base logits between runs.)
set -euo pipefail
B=${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the folder holding llama-quantize and llama-perplexity}
NAME=${1:-qwen2.5-coder-1.5b-instruct}
LEN=${2:-long}
PY=${PYTHON:-.venv/bin/python}
T=${THREADS:-$(nproc)}
M=$($PY -c "from speculant.hub import resolve_model; print(resolve_model('$NAME'))")
W=${WORK:-$(mktemp -d)}
lscpu | grep "Model name"; echo "threads: $T, text: $LEN, work: $W"
$PY -c "from speculant.bench.speed import fidelity_text; print(fidelity_text(long='$LEN' == 'long'), end='')" > "$W/text.txt"
[ -s "$W/f32.gguf" ] || "$B/llama-quantize" --allow-requantize "$M" "$W/f32.gguf" F32 > "$W/quantize.log" 2>&1
echo "== llama.cpp: F32 base logits, then the file against them"
"$B/llama-perplexity" -m "$W/f32.gguf" -f "$W/text.txt" -c 512 -t "$T" --kl-divergence-base "$W/base-$LEN.bin" \
    > "$W/base.log" 2>&1
"$B/llama-perplexity" -m "$M" -f "$W/text.txt" -c 512 -t "$T" --kl-divergence-base "$W/base-$LEN.bin" \
    --kl-divergence 2>&1 | grep -E "^(Mean +KLD|Same top p|Mean    PPL)|chunks" | head -6
echo "== speculant: float32 (each chunk one pass, the prompt route), then gguf (16-token passes, the decode route)"
SPECULANT_THREADS=$T $PY - "$NAME" "$W/text.txt" <<'PY'
import sys
import torch
from speculant.bench.speed import FIDELITY_CTX, compare_logits, fidelity_chunks, text_logits
from speculant.models import load_model
from speculant.models.cache import kv_dtype as kv_dtype_of

name, path = sys.argv[1], sys.argv[2]
ref = load_model(name, "float32", progress=False).model  # its caches' type set per pass below
refs = {kv: kv_dtype_of(kv) for kv in ("f32", "f16")}
q = load_model(name, None, progress=False)
ids = q.tokenizer.encode(open(path).read())
chunks = len(ids) // FIDELITY_CTX
half = slice(FIDELITY_CTX // 2, FIDELITY_CTX - 1)
sums = {kv: [0.0, 0.0, 0] for kv in refs}  # KL sum, agreeing positions, positions
for c, part in enumerate(fidelity_chunks(ids, chunks, bos=q.tokenizer.prompt_bos)):  # BOS first, as llama.cpp's
    got = text_logits(q.model, part)[half]
    for kv, dtype in refs.items():
        ref.kv_dtype = dtype
        f = compare_logits(name, "gguf", text_logits(ref, part, FIDELITY_CTX)[half], got)
        s = sums[kv]
        s[0] += f.mean_kl * f.positions; s[1] += f.top1_agreement * f.positions; s[2] += f.positions
    print(f"chunk {c + 1}/{chunks}", file=sys.stderr, flush=True)
print(f"gguf ({q.model.kv_dtype} cache) against float32, {chunks} chunks of {FIDELITY_CTX}:")
for kv, (kl, agree, n) in sums.items():
    p = agree / n
    print(f"  reference with a {kv} cache: {n} positions, mean KL {kl / n:.6f}, top-1 {100 * p:.2f}% "
          f"(+-{100 * (p * (1 - p) / n) ** 0.5:.2f} standard error)")
PY
