#!/bin/bash
# speculant's `gguf` default and llama.cpp side by side on one GGUF file, in one run (docs/measurements.md).
# Needs a llama.cpp build with the CPU's native flags; from the llama-cpp-python sdist, fetched by pip:
#   .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
#   tar xf llama_cpp_python-*.tar.gz
#   cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DGGML_NATIVE=ON -DGGML_OPENMP=ON
#   cmake --build build -j --target llama-bench llama-perplexity llama-quantize
# Usage: LLAMA_CPP_BIN=build/bin bash scripts/vs_llama_cpp.sh [PRESET]
set -euo pipefail
B=${LLAMA_CPP_BIN:-$(PYTHON=${PYTHON:-.venv/bin/python} bash "$(dirname "$0")/build_llama_cpp.sh" | tail -n 1)/bin}
NAME=${1:-qwen2.5-coder-1.5b-instruct}
PY=${PYTHON:-.venv/bin/python}
M=$($PY -c "from speculant.hub import resolve_model; print(resolve_model('$NAME'))")
T=${THREADS:-$(nproc)}
lscpu | grep "Model name"; echo "threads: $T"
echo "== llama-bench (before)"; "$B/llama-bench" -m "$M" -t "$T" -p 256 -n 64 -r 5 2>&1 | grep -E "pp|tg"
echo "== llama-bench batch curve"; "$B/llama-bench" -m "$M" -t "$T" -p 1,4,8 -n 0 -r 5 2>&1 | grep -E "pp"
echo "== speculant bench speed"
$PY -m speculant.cli bench speed --models "$NAME" --dtypes gguf float32 --ks 1 2 4 8 16 --threads "$T" --no-progress
echo "== llama-bench (after)"; "$B/llama-bench" -m "$M" -t "$T" -p 256 -n 64 -r 5 2>&1 | grep -E "pp|tg"
TXT=$(mktemp); $PY -c "from speculant.bench.speed import fidelity_text; print(fidelity_text()[:3000])" > "$TXT"
echo "== load time and max RSS: llama.cpp (one 128-token chunk)"
/usr/bin/time -f "max RSS %M kB, wall %e s" "$B/llama-perplexity" -m "$M" -f "$TXT" -c 128 --chunks 1 -t "$T" 2>&1 | grep -E "load time|max RSS"
echo "== load time and max RSS: speculant (load, then a 128-token forward)"
/usr/bin/time -f "max RSS %M kB, wall %e s" $PY -c "
import time; t = time.perf_counter()
import torch
from speculant.models import load_model
m = load_model('$NAME', None, progress=False); print('load', round(time.perf_counter() - t, 2), 's')
m.model(torch.arange(100, 228), m.model.new_cache(200))
print('load + first forward (the output layer repacks on its first use)', round(time.perf_counter() - t, 2), 's')" 2>&1 | grep -E "^load|max RSS"
rm -f "$TXT"
