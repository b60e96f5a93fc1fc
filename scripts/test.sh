#!/usr/bin/env bash
# Set up (idempotent), fetch the default models (cached after the first run), run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/speculant pull
exec .venv/bin/python -m pytest -q -ra "$@"
