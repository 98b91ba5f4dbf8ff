#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs openm3 with the given extras, CPU build of torch.
# Usage: bash scripts/setup.sh [extras]   e.g. bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Pin torch first: an unpinned torch would pull a multi-GB CUDA build. Where pip's index serves the CPU build under
# this version (these machines' local index does), the pin takes it; plain PyPI's Linux wheel is the CUDA build:
# OPENM3_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU one from PyTorch's index instead.
.venv/bin/python -m pip install -q --disable-pip-version-check \
  ${OPENM3_TORCH_INDEX:+--index-url "$OPENM3_TORCH_INDEX"} torch==2.13.0
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
