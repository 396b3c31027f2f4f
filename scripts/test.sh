#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, two workers: the engine and torchtitan
# 0.2.x suite (tests/, in ./.venv), then the torchtitan 0.3 suite (tests03/, in ./.venv03, see
# test03.sh). With arguments, they go to pytest and only the first suite runs (e.g.
# `bash scripts/test.sh tests/test_fuzz.py`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -gt 0 ]; then
  exec "$(bash scripts/python.sh)" -m pytest -n 2 -q "$@"
fi
"$(bash scripts/python.sh)" -m pytest -n 2 -q
bash scripts/test03.sh
