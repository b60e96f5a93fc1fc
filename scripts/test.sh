#!/usr/bin/env bash
# Set up (idempotent), fetch the default models (cached after the first run), run every test.
# One process by default: two pytest-xdist workers on two cores each start a torch thread per core, which
# oversubscribes the cores, and were not shown faster for the engine-heavy distribution tests.
# `bash scripts/test.sh -n 2 --dist loadfile` runs two workers, each test file whole in one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/speculant pull
exec .venv/bin/python -m pytest -q -ra "$@"
