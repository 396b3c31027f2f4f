#!/usr/bin/env bash
# Set up (idempotent) and run the torchtitan 0.3 job: the llama3 debug model on two CPU ranks
# (FSDP2 over gloo) with TapeSAC planned mode, rank 0's log only. Extra arguments go to
# torchtitan: its own options first, then TapeSAC's after the choice that owns them, e.g.
#   bash scripts/run03.sh --training.steps 20 activation-checkpoint:tapesac --activation-checkpoint.budget 0.8
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup03.sh
exec "$(bash scripts/python03.sh)" -m torch.distributed.run --standalone --nproc_per_node=2 \
  --local-ranks-filter 0 -m torchtitan.train --module torchtitan03_ext --config llama3_debug_cpu "$@"
