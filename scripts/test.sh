#!/usr/bin/env bash
# Set up (idempotent), fetch the default models (cached after the first run), run every test.
# Two pytest-xdist workers, each test file whole in one of them (--dist loadfile), so that a file's module
# fixtures (servers, loaded models) are built once. `bash scripts/test.sh -n 0` runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/speculant pull
exec .venv/bin/python -m pytest -q -ra -n 2 --dist loadfile "$@"
