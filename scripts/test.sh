#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "$(bash scripts/python.sh)" -m pytest -n 2 -q "$@"
