#!/usr/bin/env bash
# Set up (idempotent), fetch the default models (cached after the first run), run every test.
# Every test process runs one torch thread (tests/conftest.py; $SPECULANT_THREADS overrides it): the tiny
# models' passes are too small to split, and a second thread made the distribution tests several times slower.
# One process by default; `bash scripts/test.sh -n 2 --dist loadfile` runs two pytest-xdist workers (one
# thread each), each test file whole in one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/speculant pull
exec .venv/bin/python -m pytest -q -ra "$@"
