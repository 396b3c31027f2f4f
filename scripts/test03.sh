#!/usr/bin/env bash
# Set up (idempotent) and run the torchtitan 0.3 test suite (tests03/) on CPU, two workers, in
# its own environment (see setup03.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup03.sh
exec "$(bash scripts/python03.sh)" -m pytest -n 2 -q tests03 "$@"
