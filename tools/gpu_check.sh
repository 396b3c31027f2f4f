#!/usr/bin/env bash
# GPU check for a CUDA machine with torchtitan installed: correctness tests on CUDA and a short
# llama3/qwen3 benchmark (bf16, FSDP2 on one GPU), all results in one JSON file, < 8 minutes.
#   bash tools/gpu_check.sh [RESULT_FILE]          (default: gpu_check.json)
# With $PYTHON03 set (torchtitan 0.3 and fla-core), Qwen3.5's blocks run on CUDA with fla's kernels too.
# Dependencies: bash scripts/setup.sh, or pre-installed wheels on machines without a registry.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_check.py --result "${1:-gpu_check.json}" ${PYTHON03:+--python03 "$PYTHON03"}
