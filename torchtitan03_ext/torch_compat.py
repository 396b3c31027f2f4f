"""What torchtitan 0.3.0 calls that torch 2.13 does not have (it was written against a nightly).

Found by running torchtitan 0.3.0 on torch 2.13.0 (CPU, two gloo ranks):

1. ``torch.distributed.set_timeout(timeout, group)``, called once after the first step
   (``torchtitan.distributed.utils.set_pg_timeouts``): torch 2.13 has the same operation as the
   private ``torch.distributed.distributed_c10d._set_pg_timeout``. :func:`install` adds the
   public name, pointing at it, when torch lacks it.
2. FSDP2 that turns ``spmd_types`` annotations into DTensor parameters: with torchtitan's default
   ``parallelism.spmd_backend = "spmd_types"`` and more than one data-parallel rank, torch 2.13's
   ``fully_shard`` raises "When dp_mesh_dims is provided, all parameters must be DTensors on the
   full SPMD mesh" (torch 2.14.0's reads the annotations). Not patchable here: TapeSAC's configs
   use ``spmd_backend = "partial_dtensor"`` (DTensor only for model-parallel axes, as torchtitan
   0.2.x did), and a TapeSAC job with another backend is refused before training
   (``trainer.check_neighbours``).

torch 2.14.0 has both (checked in its wheel); TapeSAC is tested on 2.13 only. Still missing in
2.14.0: FlexAttention's backward on CPU (see ``cpu_shim``).
"""

from __future__ import annotations

import torch.distributed as dist


def install() -> None:
    """Add what torchtitan 0.3.0 needs and this torch lacks. Safe to call more than once."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
