#!/usr/bin/env bash
# Print the Python the torchtitan 0.3 scripts use: $PYTHON03 if set, else ./.venv03's (created
# here if missing). torchtitan 0.2.x and 0.3.x cannot share an environment: each has its own.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON03:-}" ]; then
  echo "$PYTHON03"
  exit 0
fi
if [ ! -x .venv03/bin/python ]; then
  python3 -m venv .venv03 >&2
fi
echo "$PWD/.venv03/bin/python"
