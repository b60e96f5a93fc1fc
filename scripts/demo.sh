#!/usr/bin/env bash
# Fresh machine -> set up, fetch the default models, and generate with speculative decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/speculant pull
.venv/bin/speculant generate --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
    --max-tokens 128 --stats 'def quicksort(arr):
    """Sort a list of numbers and return it."""
'
