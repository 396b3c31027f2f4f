"""Reference planner: every keep set, evaluated exactly. For tests on small graphs only."""

from __future__ import annotations

import itertools

from .graph import BlockGraph
from .milp import Point, evaluate, pareto


def brute_force_frontier(g: BlockGraph, max_candidates: int = 16) -> list[Point]:
    """The exact Pareto frontier by enumerating all subsets of keepable values."""
    cand = [v for v in range(g.num_values) if g.is_keepable(v)]
    if len(cand) > max_candidates:
        raise ValueError(f"{len(cand)} candidate values: too many to enumerate")
    points = []
    for r in range(len(cand) + 1):
        for kept in itertools.combinations(cand, r):
            points.append(evaluate(g, kept))
    return pareto(points)
