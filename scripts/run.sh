#!/usr/bin/env bash
# Set up (idempotent) and run the main job: targeted replay against full activation
# checkpointing on torchtitan llama3 blocks, side by side (a quick CPU run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" tools/bench_replay.py --quick "$@"
