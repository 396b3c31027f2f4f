"""Planner speed: 64 blocks of two distinct kinds with 400 values each.

Times (wall clock, this machine): the two block frontiers, the whole step frontier (block
frontiers plus a sweep of limits, at least 20 points), and one plan for one limit (block
frontiers plus allocation: what planned mode does after profiling).

    python tools/bench_planner.py [--blocks 64] [--values 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tapesac.stepmodel import StepMemory, Window  # noqa: E402
from tapesac.autoplan import PlanConfig  # noqa: E402
from tapesac.planner import make_plan  # noqa: E402
from tapesac.planner.allocate import formula_deltas, global_frontier  # noqa: E402
from tapesac.planner.graph import BlockGraph  # noqa: E402
from tapesac.planner.milp import frontier  # noqa: E402


def synthetic_block(seed: int, n_values: int) -> BlockGraph:
    """A transformer-like tape: mostly a chain with skips, 30% views, matmul-sized and
    elementwise-sized ops, 40% of values read by backward, 4 inputs and parameters."""
    rng = random.Random(seed)
    times, deps, value_op, storage, nbytes = [], [], [], [], []
    for _ in range(4):
        value_op.append(-1)
        storage.append(len(nbytes))
        nbytes.append(float(2**20))
    while len(value_op) < n_values:
        recent = list(range(max(0, len(value_op) - 6), len(value_op)))
        d = {rng.choice(recent)}
        if rng.random() < 0.2:
            d.add(rng.randrange(len(value_op)))
        deps.append(sorted(d))
        view = rng.random() < 0.3
        times.append(rng.uniform(1e-5, 2e-5) if view else
                     rng.choice([rng.uniform(1e-4, 5e-4), rng.uniform(2e-3, 8e-3)]))
        value_op.append(len(times) - 1)
        if view:
            storage.append(storage[min(d)])
        else:
            storage.append(len(nbytes))
            nbytes.append(float(rng.choice([1, 2, 4, 8]) * 2**20))
    read = [v for v in range(4, n_values) if rng.random() < 0.4]
    return BlockGraph(times, deps, value_op, storage, nbytes, read, signature=f"kind{seed}")


def synthetic_memory(blocks: int, transient: float) -> StepMemory:
    base = 10 * 2**30
    windows = [Window("before blocks", base, [])]
    for b in range(blocks):
        windows.append(Window(f"forward of block {b}", base + 2e8, list(range(b + 1))))
        windows.append(Window(f"after forward of block {b}", base + 1e8, list(range(b + 1))))
    for b in reversed(range(blocks)):
        windows.append(Window(f"backward of block {b}", base + 3e8 + transient, list(range(b)), b))
    return StepMemory(windows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--values", type=int, default=400)
    ap.add_argument("--points-per-block", type=int, default=16, help="for the whole frontier")
    ap.add_argument("--frontier-points", type=int, default=24)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    kinds = [synthetic_block(1, a.values), synthetic_block(2, a.values)]
    graphs = {b: kinds[b % 2] for b in range(a.blocks)}

    t0 = time.perf_counter()
    fronts = [frontier(g, max_points=a.points_per_block) for g in kinds]
    t_blocks = time.perf_counter() - t0
    frontiers = {b: fronts[b % 2] for b in range(a.blocks)}
    memory = synthetic_memory(a.blocks, fronts[0][0].transient)
    t1 = time.perf_counter()
    sweep = global_frontier(memory, frontiers, points=a.frontier_points, deltas=formula_deltas(memory, frontiers))
    t_sweep = time.perf_counter() - t1

    lo, hi = sweep[0].predicted_peak_bytes, sweep[-1].predicted_peak_bytes
    # One plan, as planned mode makes it: block frontiers (default points) + allocation.
    t2 = time.perf_counter()
    plan = make_plan(graphs, memory, (lo + hi) / 2, points_per_block=PlanConfig.points_per_block,
                     frontier_points=0, solver_time_limit_s=PlanConfig.solver_time_limit_s, margin=0.0)
    t_plan_total = time.perf_counter() - t2

    result = {
        "blocks": a.blocks, "values_per_block": a.values, "kinds": 2,
        "read_values_per_block": [len(g.read) for g in kinds],
        "block_frontier_points": [len(f) for f in fronts],
        "block_frontiers_s": t_blocks,
        "step_frontier_points": len(sweep),
        "whole_frontier_s": t_blocks + t_sweep,
        "one_plan_s": t_plan_total,
        "one_plan_status": plan.allocation.status,
    }
    for k, v in result.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
