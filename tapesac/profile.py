"""Measured costs: per-op times during a profiling forward, and a tape turned into a BlockGraph.

Times are taken inline while recording: each op that writes nothing runs ``repeats`` times
(random ops with their generator state restored before every run) and the median is kept; the
device is synchronised around each run (CUDA) so the time is the op's, not the queue's. The last
run is the real one, so the forward computes exactly what it would without profiling.

An op that may communicate (a collective, or any op on a DTensor, which can redistribute inside
its own dispatch) runs exactly once, on every rank alike (:func:`~tapesac.ops.may_communicate`
decides from the op and the argument types): repeating it would send its data again, hold the
repeats' buffers in the measured memory trace, and time the wait for the slowest rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable

import torch

from .bounds import SizeBounds
from .ops import may_communicate, op_info
from .planner.graph import BlockGraph
from .tape import EXTERNAL, UNSEEN, Tape


class OpTimer:
    """Times ops inline; ``sync`` makes device work finish before the clock is read."""

    def __init__(self, repeats: int, device_type: str = "cpu") -> None:
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        self.repeats = repeats
        self.sync: Callable[[], None] = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)

    def call(self, func: Any, args: tuple, kwargs: dict, can_repeat: bool,
             rng: tuple[Any, torch.Tensor] | None) -> tuple[Any, float]:
        """Run ``func`` (the last run is the real one); return its result and median time in s.

        ``can_repeat`` is false for ops that write their arguments; ops that may communicate are
        never repeated either."""
        sync = self.sync
        times = []
        if can_repeat and self.repeats > 1 and not may_communicate(op_info(func), args, kwargs):
            for _ in range(self.repeats - 1):
                if rng is not None:
                    rng[0].set_state(rng[1])
                sync()
                t0 = time.perf_counter()
                func(*args, **kwargs)
                sync()
                times.append(time.perf_counter() - t0)
            if rng is not None:
                rng[0].set_state(rng[1])
        sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        sync()
        times.append(time.perf_counter() - t0)
        return out, statistics.median(times)


def merge_profiles(tapes: Iterable[Tape]) -> tuple[list[float], list[float]]:
    """(per-op median time, per-storage largest bytes) over profiled tapes of one block.

    The tapes share a signature, so ops and storages line up; sizes can still differ where they
    depend on the data (tokens per expert), and the plan must fit the largest.
    """
    tapes = list(tapes)
    n = len(tapes[0].ops)
    n_st = len(tapes[0].storage_nbytes)
    if any(len(t.ops) != n or len(t.storage_nbytes) != n_st for t in tapes):
        raise ValueError("profiled tapes of one block differ in length")
    times = [statistics.median(t.ops[i].time_s or 0.0 for t in tapes) for i in range(n)]
    sizes = [float(max(t.storage_nbytes.get(s, 0) for t in tapes)) for s in range(n_st)]
    return times, sizes


def block_graph(tape: Tape, op_time_s: list[float] | None = None,
                unpack_order: list[int] | None = None, storage_bytes: list[float] | None = None,
                bounds: SizeBounds | None = None) -> BlockGraph:
    """The planner's view of a recorded tape (see :class:`BlockGraph`).

    Always available: externals, snapshots, views of externals, outputs of keep-only ops. Not
    keepable: values whose storage a later op writes in place (the recorder would have to drop
    them). The bytes of keep-only outputs backward needs are fixed, whatever the plan.
    ``bounds``: the largest bytes of storages whose size depends on the data
    (:func:`tapesac.bounds.size_bounds`), or why there are none.
    """
    ops, values = tape.ops, tape.values
    times = op_time_s if op_time_s is not None else [op.time_s or 0.0 for op in ops]
    last_write: dict[int, int] = {}
    for i, op in enumerate(ops):
        for _before, after in op.writes:
            last_write[values[after].sid] = i
    value_op, keepable, names, positions = [], [], [], []
    for v in values:
        always = not tape.rebuildable(v.vid)
        value_op.append(-1 if always else v.op)
        keepable.append(not always and last_write.get(v.sid, -1) <= v.op)
        names.append(f"%{v.op}.{v.slot} {tape.op_name(v.op)}" if v.op >= 0 else f"%ext{v.vid}")
        positions.append((v.op, v.slot))
    if storage_bytes is None:
        n_storages = max(tape.storage_nbytes) + 1 if tape.storage_nbytes else 0
        storage_bytes = [float(tape.storage_nbytes.get(s, 0)) for s in range(n_storages)]
    read = [v.vid for v in values if v.reads and tape.produced(v.vid)]
    g = BlockGraph(
        op_time_s=list(times), op_deps=[list(op.deps) for op in ops], value_op=value_op,
        value_storage=[v.sid for v in values], storage_bytes=storage_bytes, read=read,
        read_counts=[values[v].reads for v in read], unpack_order=list(unpack_order) if unpack_order else None,
        keepable=keepable, names=names,
        op_names=[tape.op_name(i) for i in range(len(ops))], positions=positions,
        signature=tape.signature(),
    )
    # Keep-only outputs that replay-only needs are held whatever the plan.
    needed = set(read) | {d for o in g.closure(()) for d in ops[o].deps}
    held = {values[v].sid for v in needed
            if values[v].kind != EXTERNAL and value_op[v] == -1 and not values[v].free}
    g.fixed_bytes = sum(storage_bytes[s] for s in held)
    if bounds is not None and bounds.unbounded:
        g.data_dependent = bounds.unbounded
    if bounds is not None and bounds.bytes:
        g.storage_bound_bytes = [max(b, float(bounds.bytes.get(s, 0))) for s, b in enumerate(storage_bytes)]
        g.fixed_bound_bytes = sum(g.storage_bound_bytes[s] for s in held)
    unseen = {values[v].sid for v in needed if tape.produced(v)
              and ops[values[v].op].keep_only == UNSEEN}
    g.unseen_bytes = sum(storage_bytes[s] for s in unseen)
    return g


def calibrate_overheads(device: torch.device, ops: int = 48, repeats: int = 9) -> tuple[float, float]:
    """TapeSAC's own cost per op on this machine: (recording, replaying), in seconds.

    A chain of ``ops`` tiny ops (each saving its input) is run forward and backward, plain and
    wrapped, alternately; the differences of the medians, per op, are the costs the planner adds
    to replayed ops and to recorded blocks (kernel time is negligible at this size).

    Draws from no generator (planning must not change what a model's random ops draw) and builds
    the wrapped block from :class:`~tapesac.block.BlockState` directly, not through the public API.
    """
    from .block import BlockState

    class Chain(torch.nn.Module):
        def forward(self, x):
            for _ in range(ops):
                x = torch.sin(x)
            return x

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(block: torch.nn.Module) -> tuple[float, float]:
        x = torch.linspace(-1.0, 1.0, 8, device=device).requires_grad_()
        sync()
        t0 = time.perf_counter()
        y = block(x).sum()
        sync()
        t1 = time.perf_counter()
        y.backward()
        sync()
        return t1 - t0, time.perf_counter() - t1

    plain, wrapped = Chain(), Chain()
    state = BlockState(-1, wrapped)  # not one of the model's blocks
    state.install()
    try:
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "wrapped": []}
        for i in range(repeats + 2):
            for name, block in (("plain", plain), ("wrapped", wrapped)):
                t = timed(block)
                if i >= 2:
                    runs[name].append(t)
    finally:
        state.uninstall()
    med = {k: [statistics.median(t[j] for t in v) for j in (0, 1)] for k, v in runs.items()}
    record = max(0.0, med["wrapped"][0] - med["plain"][0]) / ops
    replay = max(0.0, med["wrapped"][1] - med["plain"][1]) / ops
    return record, replay
