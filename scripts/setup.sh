#!/usr/bin/env bash
# Install TapeSAC with its torchtitan integration and test tools. Idempotent and quick when
# everything is present.
#
# Where: the Python in $PYTHON if set (your own environment), else a virtualenv in ./.venv,
# made on first use (about 2.5 GB). torch is installed first and explicitly: on a CPU machine
# `torch==2.13.0` is the CPU build, while an unpinned torch pulled in as a dependency could be
# a multi-GB CUDA build. GPU users: install your CUDA torch 2.13 into $PYTHON's environment first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/python.sh)
if ! "$PY" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v != (2, 13))' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[torchtitan02,test,plot]"
