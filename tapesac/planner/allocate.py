"""Share one step-peak limit among blocks: pick one frontier point per block (a HiGHS MILP).

Each block b chooses a point p of its kind's frontier (kept bytes K, replay time R). For every
window w of the step-peak model:

    peak_w + sum_{recordings r alive in w} K[b(r), p_b(r)] + D[w, p_{r_w}] <= limit

where a block recorded twice and alive twice counts twice, r_w is the block replaying in w and
D[w, p] how much point p changes that block's own peak in that window (kept values included;
from ``replay_deltas``). The objective is
the total replay time. Identical blocks share one frontier; their choices may still differ
(deeper blocks live shorter).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import highspy
import numpy as np

from ..errors import PlanError
from ..report import fmt_bytes
from ..stepmodel import StepMemory
from .milp import Point, Rows

log = logging.getLogger("tapesac")


@dataclasses.dataclass
class Allocation:
    points: dict[int, Point]
    """Chosen point per block."""
    predicted_peak_bytes: float
    recompute_s: float
    status: str
    """"optimal", "time limit (best found)" or "replay-only fallback (...)"."""


Deltas = dict[int, list[float]]
"""Per replay window (its index in ``StepMemory.windows``): D[w, p] for each point p of the
replaying block's frontier."""


def formula_deltas(memory: StepMemory, frontiers: dict[int, list[Point]]) -> Deltas:
    """D[w, p] without a time-resolved trace: kept bytes plus the change in rebuilt read bytes,
    assuming everything replay holds is alive at the window's peak."""
    per_block = {b: [p.memory + p.transient - pts[0].transient for p in pts] for b, pts in frontiers.items()}
    return {i: per_block[w.replay_block] for i, w in enumerate(memory.windows) if w.replay_block in per_block}


def _loads(memory: StepMemory, frontiers: dict[int, list[Point]], deltas: Deltas
           ) -> dict[int, list[tuple[int, int, list[float] | None]]]:
    """Per block: the windows its choice shows up in, as (window, live recordings of the block
    other than the replaying one, the window's deltas if the block replays there)."""
    where: dict[int, list[tuple[int, int, list[float] | None]]] = {b: [] for b in frontiers}
    for wi, w in enumerate(memory.windows):
        counts: dict[int, int] = {}
        for b in w.alive:
            if b in frontiers:
                counts[b] = counts.get(b, 0) + 1
        rb = w.replay_block if w.replay_block in frontiers else None
        for b in set(counts) | ({rb} if rb is not None else set()):
            where[b].append((wi, counts.get(b, 0), deltas[wi] if b == rb else None))
    return where


def _coefficients(memory: StepMemory, frontiers: dict[int, list[Point]], deltas: Deltas):
    cols: list[tuple[int, int]] = [(b, i) for b, pts in sorted(frontiers.items()) for i in range(len(pts))]
    col_of = {c: j for j, c in enumerate(cols)}
    rows: list[tuple[float, dict[int, float]]] = [(w.peak_bytes, {}) for w in memory.windows]
    for b, places in _loads(memory, frontiers, deltas).items():
        for wi, count, d in places:
            coef = rows[wi][1]
            for i, p in enumerate(frontiers[b]):
                coef[col_of[(b, i)]] = count * p.memory + (d[i] if d is not None else 0.0)
    return cols, rows


def predicted_peak(memory: StepMemory, choice: dict[int, int], frontiers: dict[int, list[Point]],
                   deltas: Deltas) -> float:
    """Predicted step peak when block b takes point ``choice[b]`` of its frontier."""
    kept = {b: frontiers[b][i].memory for b, i in choice.items()}
    replay = {wi: d[choice[memory.windows[wi].replay_block]] for wi, d in deltas.items()
              if memory.windows[wi].replay_block in choice}
    return memory.predict(kept, replay)


def smallest_peak(memory: StepMemory, frontiers: dict[int, list[Point]], deltas: Deltas) -> float:
    """The step peak when every block keeps nothing beyond what it must."""
    return predicted_peak(memory, {b: 0 for b in frontiers}, frontiers, deltas)


def largest_useful_peak(memory: StepMemory, frontiers: dict[int, list[Point]], deltas: Deltas) -> float:
    """The step peak when every block keeps what makes its replay fastest."""
    return predicted_peak(memory, {b: len(pts) - 1 for b, pts in frontiers.items()}, frontiers, deltas)


def greedy(memory: StepMemory, frontiers: dict[int, list[Point]], limit_bytes: float, deltas: Deltas,
           start: dict[int, int] | None = None) -> dict[int, int]:
    """Upgrade blocks one frontier step at a time, best time saved per kept byte first, while
    every window fits. Returns the chosen point index per block (a feasible start for the MILP).
    ``start`` (feasible for this limit, e.g. the answer for a smaller one) is upgraded further."""
    import heapq

    windows = memory.windows
    choice = dict(start) if start else {b: 0 for b in frontiers}
    load = [w.peak_bytes for w in windows]
    places = _loads(memory, frontiers, deltas)

    def cost(b: int, i: int, count: int, d: list[float] | None) -> float:
        return count * frontiers[b][i].memory + (d[i] if d is not None else 0.0)

    for b, i in choice.items():
        for wi, count, d in places[b]:
            load[wi] += cost(b, i, count, d)

    def fits(b: int, i: int, j: int) -> bool:
        return all(load[wi] - cost(b, i, c, d) + cost(b, j, c, d) <= limit_bytes for wi, c, d in places[b])

    def best_next(b: int):
        i = choice[b]
        pts = frontiers[b]
        best = None
        for j in range(i + 1, len(pts)):
            saved = pts[i].time - pts[j].time
            if saved <= 0 or not fits(b, i, j):
                continue
            rate = saved / max(pts[j].memory - pts[i].memory, 1.0)
            if best is None or rate > best[0]:
                best = (rate, j)
        return best

    heap = []
    for b in frontiers:
        nxt = best_next(b)
        if nxt is not None:
            heapq.heappush(heap, (-nxt[0], b, choice[b], nxt[1]))
    while heap:
        _r, b, i, j = heapq.heappop(heap)
        if choice[b] != i:
            continue
        if not fits(b, i, j):  # other upgrades used the room: look again
            nxt = best_next(b)
            if nxt is not None:
                heapq.heappush(heap, (-nxt[0], b, i, nxt[1]))
            continue
        for wi, c, d in places[b]:
            load[wi] += cost(b, j, c, d) - cost(b, i, c, d)
        choice[b] = j
        nxt = best_next(b)
        if nxt is not None:
            heapq.heappush(heap, (-nxt[0], b, j, nxt[1]))
    return choice


def allocate(memory: StepMemory, frontiers: dict[int, list[Point]], limit_bytes: float,
             time_limit_s: float, deltas: Deltas | None = None, margin: float = 0.0) -> Allocation:
    """The fastest choice of frontier points whose predicted step peak fits ``limit_bytes``.

    A greedy pass (best time saved per kept byte first) gives a feasible plan at once; the MILP
    then improves on it within ``time_limit_s`` (0: greedy only). ``margin`` (a fraction of the
    limit) is left unused where the limit allows it, never below the smallest achievable peak.
    Raises PlanError when even keeping nothing exceeds the limit, naming that smallest peak.
    """
    for b, pts in frontiers.items():
        if not pts or any(q.memory < p.memory for p, q in zip(pts, pts[1:])):
            raise PlanError(f"block {b}: frontier must be non-empty and sorted by memory")
    deltas = deltas if deltas is not None else formula_deltas(memory, frontiers)
    floor = smallest_peak(memory, frontiers, deltas)
    if floor > limit_bytes:
        error = PlanError(
            f"memory limit {fmt_bytes(limit_bytes)} ({limit_bytes:.0f} bytes) is infeasible: even "
            f"recomputing everything, the predicted step peak is {fmt_bytes(floor)} ({floor:.0f} "
            "bytes), the smallest achievable. Raise the limit (budget) to at least that, or reduce "
            "batch size or sequence length"
        )
        error.floor_bytes = floor
        raise error
    limit_bytes = max(limit_bytes * (1 - margin), floor)
    choice = greedy(memory, frontiers, limit_bytes, deltas)
    label = "greedy"
    if time_limit_s > 0:
        better = _polish(memory, frontiers, limit_bytes, choice, time_limit_s, deltas)
        if better is not None:
            choice, label = better
    peak = predicted_peak(memory, choice, frontiers, deltas)
    if peak > limit_bytes * (1 + 1e-6):  # cannot happen beyond solver tolerance; never risk it
        log.warning("TapeSAC planner: solution exceeds the limit by %.0f bytes; falling back to "
                    "replay-only", peak - limit_bytes)
        choice = {b: 0 for b in frontiers}
        peak, label = floor, "replay-only fallback (solution over the limit)"
    points = {b: frontiers[b][i] for b, i in choice.items()}
    return Allocation(points, peak, sum(p.time for p in points.values()), label)


def _polish(memory: StepMemory, frontiers: dict[int, list[Point]], limit_bytes: float,
            start: dict[int, int], time_limit_s: float, deltas: Deltas) -> tuple[dict[int, int], str] | None:
    """The allocation MILP, started from the greedy choice, within ``time_limit_s``.

    Returns a strictly better choice and its status, or None (keep the greedy one)."""
    cols, rows = _coefficients(memory, frontiers, deltas)
    scale = max(limit_bytes, 1.0)
    t_scale = max([p.time for pts in frontiers.values() for p in pts] + [1e-30])
    cost = np.array([frontiers[b][i].time / t_scale for b, i in cols])
    program = Rows()
    for b in sorted(frontiers):  # exactly one point per block
        idx = [j for j, (bb, _i) in enumerate(cols) if bb == b]
        program.add(idx, [1.0] * len(idx), 1.0, 1.0)
    for peak, coef in rows:
        nz = sorted(coef)
        program.add(nz, [coef[j] / scale for j in nz], hi=(limit_bytes - peak) / scale)
    h = program.binary_program(cost)
    h.setOptionValue("mip_rel_gap", 1e-4)
    h.setOptionValue("time_limit", float(time_limit_s))
    x0 = np.array([1.0 if start[b] == i else 0.0 for b, i in cols])
    sol = highspy.HighsSolution()
    sol.col_value = x0
    h.setSolution(sol)
    h.run()
    status = h.getModelStatus()
    if h.getInfo().primal_solution_status != 2:  # no feasible solution at all
        log.info("TapeSAC planner: solver found no plan (%s); keeping the greedy one",
                 h.modelStatusToString(status))
        return None
    x = np.asarray(h.getSolution().col_value)
    if float(cost @ x) >= float(cost @ x0) - 1e-12:
        if status != highspy.HighsModelStatus.kOptimal:
            log.info("TapeSAC planner: solver hit its %.1f s limit without improving the greedy plan",
                     time_limit_s)
        return None
    choice = {}
    for b in sorted(frontiers):
        best = max((j for j, (bb, _i) in enumerate(cols) if bb == b), key=lambda j: x[j])
        choice[b] = cols[best][1]
    label = "optimal" if status == highspy.HighsModelStatus.kOptimal else "solver time limit (best found)"
    return choice, label


def global_frontier(memory: StepMemory, frontiers: dict[int, list[Point]], points: int,
                    time_limit_s: float = 0.0, deltas: Deltas | None = None) -> list[Allocation]:
    """Step-level frontier: allocations for ``points`` limits spanning replay-only to
    keep-what-pays, each solved by :func:`allocate` within ``time_limit_s``, or greedily (0)."""
    deltas = deltas if deltas is not None else formula_deltas(memory, frontiers)
    lo = smallest_peak(memory, frontiers, deltas)
    hi = max(largest_useful_peak(memory, frontiers, deltas), lo)
    limits = [lo + (hi - lo) * i / max(points - 1, 1) for i in range(points)] if hi > lo else [lo]
    result: list[Allocation] = []
    warm: dict[int, int] | None = None
    for limit in limits:
        if time_limit_s > 0:
            a = allocate(memory, frontiers, limit, time_limit_s, deltas)
        else:  # greedy, each limit continuing from the last one's plan
            warm = greedy(memory, frontiers, limit, deltas, warm)
            chosen = {b: frontiers[b][i] for b, i in warm.items()}
            a = Allocation(chosen, predicted_peak(memory, warm, frontiers, deltas),
                           sum(p.time for p in chosen.values()), "greedy")
        if not result or a.recompute_s < result[-1].recompute_s - 1e-15:
            if result and math.isclose(a.predicted_peak_bytes, result[-1].predicted_peak_bytes):
                result[-1] = a
            else:
                result.append(a)
    return result
