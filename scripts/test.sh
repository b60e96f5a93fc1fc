#!/usr/bin/env bash
# Set up (idempotent), fetch the default models (cached after the first run), run every test.
# Every test process runs one torch thread (tests/conftest.py; $SPECULANT_THREADS overrides it): the tiny
# models' passes are too small to split, and a second thread made the distribution tests several times slower.
# Two pytest-xdist workers (one thread each), each test file whole in one of them: one process keeps a single
# core busy. Files go out in collection order, the ones marked heavy first (tests/conftest.py), so that neither
# worker is left alone with a long file at the end. `bash scripts/test.sh -n 0` runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# llama.cpp's reference tools (tests/llama_cpp_ref.py): on a machine that has not built them yet, the build takes
# minutes; started now it overlaps the installs and model pulls below, and the tests that need it wait for it on
# its lock. Its output is the tests' to report (they call the script again: a failed build repeats its log).
PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh >/dev/null 2>&1 &
# z-lab's reference DFlash model (tests/test_dflash.py checks ours against it); its pins clash with ours and
# it is never a runtime dependency, so it comes without its dependencies.
.venv/bin/python -m pip install -q --no-deps "dflash==0.1.0"
.venv/bin/speculant pull
exec .venv/bin/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder "$@"
