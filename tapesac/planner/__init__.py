"""From measured block graphs and a step-peak model to a policy, under one memory limit.

Identical blocks (same tape signature) are planned once: their frontier (the keep sets) is
computed once and shared. Each block's costs of those keep sets are its own, though: where sizes
depend on the data (tokens per expert in an MoE block) identical blocks hold different bytes for
the same keep set. The allocation then gives each block a point of its kind's frontier so that
every window of the step fits the limit, minimising the total replay time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import numpy as np

from ..errors import PlanError
from ..stepmodel import StepMemory
from ..policy import BlockPolicy, Policy
from ..report import summarise_keep
from .allocate import Allocation, Deltas, allocate, formula_deltas, global_frontier, largest_useful_peak, smallest_peak
from .graph import BlockGraph
from .milp import Point, frontier
from .simulate import simulate_replay

log = logging.getLogger("tapesac")


@dataclasses.dataclass
class Plan:
    """A policy and everything it was derived from (all plain data)."""

    policy: Policy
    allocation: Allocation
    frontier: list[dict[str, float]]
    """Step-level Pareto frontier: ``{"predicted_peak_bytes", "recompute_s"}``, memory ascending."""
    block_frontiers: dict[str, list[Point]]
    """Per tape signature, the block frontier the allocation chose from."""
    smallest_peak_bytes: float
    largest_useful_peak_bytes: float
    solve_s: float

    def frontier_json(self, title: str = "TapeSAC step frontier",
                      graphs: Mapping[int, BlockGraph] | None = None) -> dict[str, Any]:
        """The frontier in the form ``tools/frontier.py --saved`` reads and ``plot_frontier`` draws.

        Memory is in bytes and time in seconds (``memory_unit``, ``time_unit``). ``frontier`` holds
        the step-level points, smallest memory first; ``ends`` names its first and last point.
        ``chosen`` is the plan in force, and ``chosen["keeps"]`` what it keeps: one entry per
        block kind and frontier point, with the blocks that chose it. With ``graphs`` (the block
        graphs the plan was made from, as given to ``make_plan``) kept values are named and
        summarised (``tapesac.report.summarise_keep``); without, they are value indices.
        """
        groups: dict[tuple[str, int], list[int]] = {}
        for b, p in sorted(self.allocation.points.items()):
            kind = self.policy.blocks[b].signature or f"block{b}"  # as make_plan groups them
            i = next(i for i, q in enumerate(self.block_frontiers[kind]) if q.kept == p.kept)
            groups.setdefault((kind, i), []).append(b)
        keeps = []
        for (kind, i), blocks in groups.items():
            p = self.block_frontiers[kind][i]
            g = graphs.get(blocks[0]) if graphs else None
            entry: dict[str, Any] = {
                "kind": kind, "blocks": blocks, "point": i, "points": len(self.block_frontiers[kind]),
                "kept_bytes": max(self.allocation.points[b].memory for b in blocks), "recompute_time": p.time,
                "kept": [g.value_name(v) for v in p.kept] if g is not None else list(p.kept),
            }
            if g is not None:
                entry["summary"] = summarise_keep(g.names, p.kept, g.read)
            keeps.append(entry)
        return {
            "title": title,
            "memory_label": "predicted step peak",
            "memory_unit": "bytes",
            "time_label": "predicted recompute time per step",
            "time_unit": "s",
            "limit_bytes": self.policy.limit_bytes,
            # The sweep is greedy; the chosen plan is solved for its own limit, so it may lie below.
            "frontier_label": "frontier (greedy sweep of limits)",
            "ends": ["replay-only (full-AC memory)", "keep everything useful (no-AC-like memory)"],
            "chosen": {"memory": self.allocation.predicted_peak_bytes, "recompute_time": self.allocation.recompute_s,
                       "status": self.allocation.status, "keeps": keeps},
            "frontier": [{"memory": p["predicted_peak_bytes"], "recompute_time": p["recompute_s"]}
                         for p in self.frontier],
        }


def make_plan(graphs: dict[int, BlockGraph], memory: StepMemory, limit_bytes: float, *,
              points_per_block: int, frontier_points: int, solver_time_limit_s: float, margin: float,
              meta: dict[str, Any] | None = None, passthrough: bool = True) -> Plan:
    """Plan ``graphs`` (block index -> graph with measured times) under ``limit_bytes``.

    ``points_per_block``, ``frontier_points``, ``solver_time_limit_s`` and ``margin`` are
    :class:`tapesac.autoplan.PlanConfig`'s fields of those names (``margin`` is its
    ``safety_margin``), where their defaults live.

    ``passthrough``: a block that keeps everything backward reads may run as plain autograd. Off
    when the step backwards a graph twice (``retain_graph``): autograd then holds every saved
    tensor until the graph is freed, while TapeSAC drops kept values after their last use."""
    t0 = time.perf_counter()
    profiled = graphs
    graphs = {b: g.at_bounds() for b, g in graphs.items()}
    memory = data_dependent_headroom(memory, profiled)
    kinds: dict[str, list[int]] = {}
    for b, g in graphs.items():
        kinds.setdefault(g.signature or f"block{b}", []).append(b)
    block_frontiers: dict[str, list[Point]] = {}
    for sig, blocks in kinds.items():
        block_frontiers[sig] = frontier(graphs[blocks[0]], max_points=points_per_block,
                                        time_limit_s=max(solver_time_limit_s, 1.0))
    frontiers = own_costs(graphs, kinds, block_frontiers)
    deltas = replay_deltas(graphs, frontiers, memory, profiled)
    try:
        alloc = allocate(memory, frontiers, limit_bytes, solver_time_limit_s, deltas, margin)
    except PlanError as e:
        if any(g.storage_bound_bytes is not None for g in profiled.values()):
            error = PlanError(f"{e}. That peak is for the largest sizes the data can give (MoE routing, "
                              "data_dependent_sizes=\"bound\"): steps that route more than the profiled one "
                              "are planned to fit too. data_dependent_sizes=\"profiled\" plans for the "
                              "profiled step's sizes instead (a lower floor; heavier routing may exceed the "
                              "limit)")
            error.floor_bytes = e.floor_bytes
            raise error from None
        raise
    sweep = global_frontier(memory, frontiers, points=frontier_points, deltas=deltas) if frontier_points else []
    policy_blocks = {}
    for b, p in alloc.points.items():
        g = graphs[b]
        positions = g.positions or [(v, 0) for v in range(g.num_values)]
        # Keeping everything backward reads is plain autograd: no need to record the block.
        plain = passthrough and not g.closure(p.kept)
        policy_blocks[b] = BlockPolicy(g.signature, [tuple(positions[v]) for v in p.kept],
                                       int(p.memory), p.time, plain)
    policy = Policy(policy_blocks, limit_bytes=int(limit_bytes),
                    predicted_peak_bytes=int(alloc.predicted_peak_bytes),
                    predicted_recompute_s=alloc.recompute_s,
                    meta={"status": alloc.status, "kinds": len(kinds), **(meta or {})})
    plan = Plan(
        policy=policy, allocation=alloc,
        frontier=[{"predicted_peak_bytes": a.predicted_peak_bytes, "recompute_s": a.recompute_s} for a in sweep],
        block_frontiers=block_frontiers, smallest_peak_bytes=smallest_peak(memory, frontiers, deltas),
        largest_useful_peak_bytes=largest_useful_peak(memory, frontiers, deltas),
        solve_s=time.perf_counter() - t0,
    )
    return plan


def own_costs(graphs: dict[int, BlockGraph], kinds: dict[str, list[int]],
              block_frontiers: dict[str, list[Point]]) -> dict[int, list[Point]]:
    """Per block, its kind's frontier with the kept and transient bytes of its own graph.

    Identical blocks share keep sets and replay times, not sizes: an MoE block's per-expert
    activations have as many rows as its router sent tokens to that expert, so the same keep set
    holds different bytes in each layer. Costing every block with the first one's sizes
    under-predicts the layers that route more tokens to what is kept."""
    own: dict[int, list[Point]] = {}
    for sig, blocks in kinds.items():
        for b in blocks:
            g = graphs[b]
            own[b] = [dataclasses.replace(p, memory=g.kept_bytes(p.kept), transient=g.transient_bytes(p.kept))
                      for p in block_frontiers[sig]]
    return own


def data_dependent_headroom(memory: StepMemory, graphs: dict[int, BlockGraph]) -> StepMemory:
    """``memory`` with each window raised by what sizes that depend on the data can add to what
    a plan does not choose: the fixed (keep-only) storages of every live recording at their
    bounds, and for the block running in the window (forward or replay) twice its growth: its
    values at their bounds plus a gradient of each, no larger than its value. Kept and rebuilt
    values at their bounds are the plan's own (``BlockGraph.at_bounds``)."""
    growth = {b: g.growth_bytes() for b, g in graphs.items()}
    if not any(a or f for a, f in growth.values()):
        return memory
    windows = []
    for w in memory.windows:
        active = w.active_block()
        extra = sum(growth.get(b, (0.0, 0.0))[1] for b in w.alive)
        extra += 2 * growth.get(active, (0.0, 0.0))[0] if active is not None else 0.0
        windows.append(dataclasses.replace(
            w, peak_bytes=w.peak_bytes + extra,
            intervals=None if w.intervals is None else [x + extra for x in w.intervals]))
    return StepMemory(windows)


def replay_deltas(graphs: dict[int, BlockGraph], frontiers: dict[int, list[Point]], memory: StepMemory,
                  profiled: dict[int, BlockGraph] | None = None) -> Deltas:
    """How each frontier point changes the replaying block's own peak, per replay window.

    Per unpack interval k the measured replay-only peak M[k] splits into what replay held (the
    simulated replay-only bytes) and the rest; the point's simulated bytes replace the former:
    D = max_k max(M[k] - peak_ro[k] + peak_p[k], M[k] - after_ro[k] + after_p[k]) - window peak.
    Exact for replay-only, conservative otherwise. Where the window's unpacks are not the graph's
    order (a partial or second pass), kept bytes plus the formula's transient change are used.
    ``profiled``: the graphs at their profiled sizes where ``graphs`` are at their bounds (what
    replay held in the measured trace is the profiled sizes' share).
    """
    deltas = formula_deltas(memory, frontiers)
    sims: dict[tuple, list[tuple[np.ndarray, np.ndarray]]] = {}
    for wi, w in enumerate(memory.windows):
        b = w.replay_block
        if b not in graphs:
            continue
        g = graphs[b]
        order = g.unpack_order
        if not order or w.intervals is None or w.unpacks != list(order) or len(w.intervals) != len(order):
            continue
        # Blocks of one kind with the same sizes (every block of a dense model) replay alike.
        key = (g.signature or f"block{b}", tuple(g.storage_bytes), tuple(order))
        if key not in sims:
            sims[key] = [simulate_replay(g, p.kept, order) for p in frontiers[b]]
        m = np.asarray(w.intervals)
        ro_peak, ro_after = sims[key][0]
        if profiled is not None and profiled[b] is not g:
            ro_peak, ro_after = simulate_replay(profiled[b], frontiers[b][0].kept, order)
        deltas[wi] = [float(max((m - ro_peak + pk).max(), (m - ro_after + af).max()) - w.peak_bytes)
                      for pk, af in sims[key]]
    return deltas


__all__ = ["BlockGraph", "Plan", "PlanError", "make_plan", "frontier", "allocate"]
