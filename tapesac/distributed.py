"""Planning across ranks: every rank profiles, rank 0 plans, every rank applies the same policy.

All exchanges are object collectives on the default (or given) process group, so they work on
gloo and NCCL alike; the payloads are small (signatures, per-op times, memory windows).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

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


def check_signatures(signatures: dict[int, str], group=None,
                     describe: Callable[[int], Sequence[str]] | None = None) -> None:
    """Every rank must have recorded the same tapes; otherwise they would replay differently.

    Raises the same :class:`PolicyError` on every rank when any rank differs from rank 0, never
    a hang: every rank decides from the same gathered signatures, so all of them take the same
    branch and make the same collective calls. The message names each differing rank and block.
    With ``describe`` (block index -> :meth:`~tapesac.tape.Tape.signature_lines`), the ranks
    exchange those lines for the differing blocks, only once they differ, and the message also
    shows the first op where each differing rank parts from rank 0.
    """
    if not active(group):
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, signatures, group=group)
    reference = gathered[0]
    differing = {r: sorted(b for b in set(reference) | set(s) if reference.get(b) != s.get(b))
                 for r, s in enumerate(gathered) if s != reference}
    if not differing:
        return
    blocks = sorted({b for bs in differing.values() for b in bs})
    details: list[str] = []
    if describe is not None:
        # Rank 0 sends its op lines for the first differing blocks; each of the first listed
        # differing ranks finds where it parts from them and sends back one line per block, so
        # what travels stays small however many ranks there are.
        me = rank(group)
        shown = blocks[:_DESCRIBED_BLOCKS]
        listed = list(differing)[:_LISTED_RANKS]
        reference_lines = broadcast(_describe(describe, shown, signatures) if me == 0 else None, group)
        mine = _describe(describe, shown, signatures) if me in listed else {}
        found = [_first_difference(b, me, reference_lines.get(b), mine.get(b))
                 for b in differing.get(me, []) if me in listed and b in shown]
        details = [d for ds in all_gather(found, group) for d in ds]
    per_rank = [f"rank {r}: blocks {_cut(bs)}" for r, bs in list(differing.items())[:_LISTED_RANKS]]
    if len(differing) > _LISTED_RANKS:
        per_rank.append(f"... and {len(differing) - _LISTED_RANKS} more ranks")
    raise PolicyError(
        f"TapeSAC: ranks {_cut(list(differing))} recorded different block tapes than rank 0 (blocks "
        f"{_cut(blocks)}). Every rank must run the same shapes and model; check sequence length, "
        "batch size and model config per rank.\n  " + "\n  ".join(per_rank + details)
    )


_DESCRIBED_BLOCKS = 4
"""How many differing blocks the ranks exchange op lines for (the first ones, by index)."""
_LISTED_RANKS = 8
"""How many differing ranks the message lists (and describes)."""
_LINE_CHARS = 240
"""Longest op line quoted in the message."""


def _cut(items: list, limit: int = 8) -> str:
    """``items`` as a list, at most ``limit`` of them, and how many more there were."""
    return str(items) if len(items) <= limit else f"{items[:limit]} and {len(items) - limit} more"


def _describe(describe: Callable[[int], Sequence[str]], blocks: list, signatures: dict[int, str]) -> dict:
    # Never raise between two collectives: a rank that raised here would leave the others waiting.
    out: dict[Any, list[str] | None] = {}
    for b in blocks:
        if b not in signatures:
            out[b] = None
            continue
        try:
            out[b] = [str(line) for line in describe(b)]
        except Exception as e:  # noqa: BLE001 - reported in the message instead
            out[b] = [f"<could not describe block {b}: {type(e).__name__}: {e}>"]
    return out


def _first_difference(block: Any, rank: int, ref: list[str] | None, mine: list[str] | None) -> str:
    where = f"rank {rank}, block {block}"
    if ref is None or mine is None:
        return f"{where}: recorded on {'rank 0' if mine is None else f'rank {rank}'} only"
    for i, (a, b) in enumerate(zip(ref, mine)):
        if a != b:
            return (f"{where}: first differs at op {i}: rank 0 ran {a[:_LINE_CHARS]}, "
                    f"rank {rank} ran {b[:_LINE_CHARS]}")
    if len(ref) != len(mine):
        return f"{where}: rank 0 recorded {len(ref)} ops, rank {rank} {len(mine)} (equal up to op {min(len(ref), len(mine))})"
    return f"{where}: the same ops, different inputs"


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
