"""Compiled mode's cost model: what recomputing a block's values costs under ``torch.compile``.

Compiled mode (``tapesac.compiled``) plans from eager tapes like eager mode, but its recompute
runs fused: only library matmuls and attention cost what they cost eagerly, and TapeSAC's own
replay and recording overheads are gone. :func:`compiled_costs` turns a measured block graph's
eager costs into those before the planner sees it.
"""

from __future__ import annotations

from .graph import BlockGraph

EXTERN_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward", "_flex_attention",
})
"""ATen ops inductor runs as kernels of their own (library matmuls and attention), whose recompute
costs under compile what it costs eagerly; every other ATen op (pointwise, reductions, views,
norms) is fused into the kernels around it (see :func:`compiled_costs`). Ops outside ATen (custom
ops, Triton launches) are kernels of their own too: inductor has no lowering for them and calls
them as they are."""


FUSED_COST = 0.1
"""Compiled mode's recompute cost of a fused op, as a fraction of its eager time. Chosen from two
measurements that pull apart, not calibrated per model: on a small LayerNorm/GELU block
recomputing the fused ops under compile cost nothing (-0.003 ms of 0.53 ms eager at width 32,
-0.43 ms of 1.29 ms at width 128, against saving them), while on the bench's quick qwen3 at
compile budget 0.7's peak, plans that may keep fused values (at 0.1) ran 3.3% faster than that
budget and plans keeping only extern outputs 2.1% slower (15 rounds, 2026-11-30)."""


def compiled_costs(graph: BlockGraph) -> None:
    """Make a block graph's costs those of compiled recompute (in place): extern ops
    (``EXTERN_OPS``, and every op outside ATen) keep their eager times, fused ops cost
    ``FUSED_COST`` of theirs, and TapeSAC's own per-op replay and per-block recording overheads
    go (a compiled block neither records nor replays)."""
    for o, name in enumerate(graph.op_names):
        if name.startswith("aten.") and name.split(".")[1] not in EXTERN_OPS:
            graph.op_time_s[o] *= FUSED_COST
    graph.op_overhead_s = 0.0
    graph.record_overhead_s = 0.0
