#!/usr/bin/env bash
# Print the Python the scripts use: $PYTHON if set, else ./.venv's (created here if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv >&2
fi
echo "$PWD/.venv/bin/python"
