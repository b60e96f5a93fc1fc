#!/usr/bin/env bash
# Create .venv and install speculant with the CPU build of torch (pinned first, so that the
# package's torch>=2.13 requirement is already met and no multi-GB CUDA build is pulled).
# GPU users: install the torch build you want first, then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# an older pip than 23 may not install a pyproject package in editable mode: upgrade only then
.venv/bin/python -c 'import pip, sys; sys.exit(int(pip.__version__.split(".")[0]) < 23)' \
  || .venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${SPECULANT_TORCH:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[${SPECULANT_EXTRAS:-test,bench}]"
