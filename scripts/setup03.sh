#!/usr/bin/env bash
# Install TapeSAC with its torchtitan 0.3 integration (torchtitan03_ext) and test tools.
# Idempotent and quick when everything is present.
#
# Where: the Python in $PYTHON03 if set (your own environment; Python >= 3.11, torchtitan 0.3's
# floor), else a virtualenv in ./.venv03, made on first use (about 2.5 GB). As in setup.sh, torch
# is installed first and explicitly (the CPU build on a CPU machine; GPU users: install your CUDA
# torch 2.13 into $PYTHON03's environment first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/python03.sh)
if ! "$PY" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v != (2, 13))' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[torchtitan03,test,plot]"
