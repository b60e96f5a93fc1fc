#!/bin/bash
# Decoding while other processes keep the cores busy (docs/measurements.md "Cores shared with other processes"):
# `speculant generate --method ar` with the default threads (they follow the CPUs other processes leave
# free: runtime.ThreadShare), then fixed at one per core and at 1, with 0, 1 and 2 busy processes beside
# it (a Python busy loop each); with LLAMA_CPP_BIN, llama.cpp's `llama-bench -n 64` too.
# Usage: [LLAMA_CPP_BIN=build/bin] bash scripts/shared_cores.sh [PRESET]
set -euo pipefail
NAME=${1:-qwen2.5-coder-1.5b-instruct}
PY=${PYTHON:-.venv/bin/python}
CORES=$($PY -c "from speculant.threads import default_threads; print(default_threads())")
lscpu | grep "Model name"; echo "model: $NAME, threads: default (adaptive), $CORES (fixed), 1 (fixed)"
M=""  # the GGUF file, for llama-bench
[ -n "${LLAMA_CPP_BIN:-}" ] && M=$($PY -c "from speculant.hub import resolve_model; print(resolve_model('$NAME'))")
BUSY=()
trap 'kill "${BUSY[@]}" 2>/dev/null || true' EXIT
tps() {  # decode tok/s of one 96-token generation; "$@": env settings
  env "$@" $PY -m speculant.cli generate -m "$NAME" --method ar --max-tokens 96 --stats --no-progress \
    "def quicksort(xs):" 2>&1 | tail -1 | $PY -c "import json, sys; print(json.loads(sys.stdin.read())['decode_tokens_per_second'])"
}
for busy in 0 1 2; do
  while [ "${#BUSY[@]}" -lt "$busy" ]; do python3 -c "while True: pass" & BUSY+=($!); done
  sleep 1
  line="busy processes: $busy | speculant tok/s: default $(tps SPECULANT_THREADS=), $CORES threads $(tps SPECULANT_THREADS=$CORES), 1 thread $(tps SPECULANT_THREADS=1)"
  if [ -n "$M" ]; then
    for t in "$CORES" 1; do
      line+=" | llama-bench -t $t: $("$LLAMA_CPP_BIN/llama-bench" -m "$M" -t "$t" -p 0 -n 64 -r 2 -o csv 2>/dev/null | tail -1 | awk -F, '{gsub(/"/, "", $(NF-1)); print $(NF-1)}')"
    done
  fi
  echo "$line"
done
