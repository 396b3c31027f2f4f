#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the torchtitan llama3 debug model on two CPU ranks
# (FSDP2 over gloo) with TapeSAC planned mode. Extra arguments go to torchtitan, e.g.
#   bash scripts/run.sh --tapesac.limit_gib 0.09 --training.steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "$(bash scripts/python.sh)" -m torch.distributed.run --standalone --nproc_per_node=2 \
  -m torchtitan.train --job.config_file train_configs/llama3_debug_cpu.toml "$@"
