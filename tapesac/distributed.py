"""Planning across ranks: every rank profiles, rank 0 plans, every rank applies the same policy.

All exchanges are object collectives on the default (or given) process group, so they work on
gloo and NCCL alike; the payloads are small (signatures, per-op times, memory windows).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch.distributed as dist

from .errors import PolicyError
from .stepmodel import StepMemory

REDUCTIONS: dict[str, Callable[[list[float]], float]] = {
    "max": max,
    "mean": lambda xs: sum(xs) / len(xs),
    "median": statistics.median,
}


def active(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group=None) -> int:
    return dist.get_rank(group) if active(group) else 0


def check_signatures(signatures: dict[int, str], group=None) -> None:
    """Every rank must have recorded the same tapes; otherwise they would replay differently."""
    if not active(group):
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, signatures, group=group)
    reference = gathered[0]
    differ = [r for r, s in enumerate(gathered) if s != reference]
    if differ:
        blocks = sorted({b for r in differ for b in set(reference) | set(gathered[r])
                         if reference.get(b) != gathered[r].get(b)})
        raise PolicyError(
            f"TapeSAC: ranks {differ} recorded different block tapes than rank 0 (blocks {blocks[:8]}"
            f"{'...' if len(blocks) > 8 else ''}). Every rank must run the same shapes and model; "
            "check sequence length, batch size and model config per rank"
        )


def reduce_profile(op_times: dict[int, list[float]], storage_bytes: dict[int, list[float]],
                   memory: StepMemory, how: str = "max", group=None
                   ) -> tuple[dict[int, list[float]], dict[int, list[float]], StepMemory]:
    """Per-op times reduced across ranks with ``how``; storage sizes and memory windows by
    maximum (sizes differ across ranks where they depend on the data, as in MoE routing)."""
    if how not in REDUCTIONS:
        raise ValueError(f"unknown timing reduction {how!r}; choose from {sorted(REDUCTIONS)}")
    if not active(group):
        return op_times, storage_bytes, memory
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (op_times, storage_bytes, memory.to_json()), group=group)
    reduce = REDUCTIONS[how]
    times = {b: [reduce([g[0][b][i] for g in gathered]) for i in range(len(ts))] for b, ts in op_times.items()}
    sizes = {b: [max(g[1][b][i] for g in gathered) for i in range(len(ss))] for b, ss in storage_bytes.items()}
    merged = StepMemory.merge_max([StepMemory.from_json(g[2]) for g in gathered])
    return times, sizes, merged


def broadcast(obj: Any, group=None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active(group):
        return obj
    box = [obj if rank(group) == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gather(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not active(group):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
