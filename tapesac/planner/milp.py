"""The keep/recompute MILP of one block, solved with HiGHS, and its memory/time Pareto frontier.

Variables (all binary): ``r[o]`` op o is replayed, ``k[v]`` value v is kept, ``x[s]`` storage s
holds a kept value, ``y[s]`` storage s is allocated by a replayed op (the replay transient).

* every read value is kept or replayed:              k[v] + r[op(v)] >= 1
* a replayed op finds each input kept or replayed:   k[u] + r[op(u)] >= r[o]   (u an input of o)
* a storage holding a kept value is paid once:       x[s] >= k[v]
* a rebuilt read value's storage is transient:      y[s] >= r[op(v)] - k[v]
* kept bytes  K = sum bytes[s] x[s] <= kappa;  replay time  R = sum time[o] r[o]

Minimising R makes ``r`` exactly the producer closure the executor runs, so the objective is the
time of the union of producer chains, each op counted once (not a sum over unkept values).
Only ops in the replay-only closure and the values they make take part: keeping anything else
cannot help. Solutions are re-evaluated exactly with :class:`BlockGraph`'s cost model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from typing import Sequence

import highspy
import numpy as np

from .graph import BlockGraph

log = logging.getLogger("tapesac")


@dataclasses.dataclass(frozen=True)
class Point:
    """One keep set of one block, with its exactly evaluated costs."""

    kept: tuple[int, ...]
    """Kept values (indices into the graph's values)."""
    memory: float
    """Kept bytes (each storage once)."""
    time: float
    """Replay time of the block's backward."""
    transient: float = 0.0
    """Bytes of rebuilt read values alive during the block's backward (BlockGraph.transient_bytes)."""


_banner_silenced = False


def _highs():
    """A quiet HiGHS instance. Its first construction prints a banner on the C-level stdout,
    which would corrupt ``--json`` output; it is sent to /dev/null instead."""
    global _banner_silenced
    if _banner_silenced:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
        _banner_silenced = True
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 1e-12)
    h.setOptionValue("mip_feasibility_tolerance", 1e-9)
    h.setOptionValue("primal_feasibility_tolerance", 1e-9)
    return h


class Rows:
    """The constraint rows of a binary program, gathered row by row (CSR)."""

    def __init__(self) -> None:
        self.starts, self.index, self.value, self.lo, self.hi = [0], [], [], [], []

    def add(self, cols: list[int], coefs: list[float], lo: float = -highspy.kHighsInf,
            hi: float = highspy.kHighsInf) -> int:
        """Add ``lo <= sum coefs * x[cols] <= hi``; returns the row's index."""
        self.index += cols
        self.value += coefs
        self.starts.append(len(self.index))
        self.lo.append(lo)
        self.hi.append(hi)
        return len(self.lo) - 1

    def binary_program(self, cost: np.ndarray, lower: np.ndarray | None = None,
                       upper: np.ndarray | None = None) -> highspy.Highs:
        """A quiet HiGHS instance holding ``min cost @ x`` over binary x subject to these rows."""
        n = len(cost)
        lp = highspy.HighsLp()
        lp.num_col_ = n
        lp.num_row_ = len(self.lo)
        lp.col_cost_ = np.asarray(cost, dtype=float)
        lp.col_lower_ = np.zeros(n) if lower is None else lower
        lp.col_upper_ = np.ones(n) if upper is None else upper
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n
        lp.row_lower_ = np.array(self.lo)
        lp.row_upper_ = np.array(self.hi)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(self.value)
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = len(self.lo)
        h = _highs()
        h.passModel(lp)
        return h


class BlockModel:
    """The MILP of one block, built once and re-solved for many memory bounds."""

    def __init__(self, g: BlockGraph) -> None:
        self.g = g
        ops = sorted(g.closure(()))
        self.ops = ops
        op_col = {o: i for i, o in enumerate(ops)}
        produced = [v for v in range(g.num_values) if g.value_op[v] in op_col]
        cand = [v for v in produced if g.is_keepable(v)]
        k_col = {v: len(ops) + i for i, v in enumerate(cand)}
        storages = sorted({g.value_storage[v] for v in cand})
        x_col = {s: len(ops) + len(cand) + i for i, s in enumerate(storages)}
        read_rebuilt = [v for v in g.read if g.value_op[v] in op_col]
        t_storages = sorted({g.value_storage[v] for v in read_rebuilt})
        y_col = {s: len(ops) + len(cand) + len(storages) + i for i, s in enumerate(t_storages)}
        n = len(ops) + len(cand) + len(storages) + len(t_storages)
        self.cand, self.k_col, self.n = cand, k_col, n

        # Scale costs to O(1): HiGHS's tolerances are absolute.
        self.t_scale = max([g.op_time_s[o] + g.op_overhead_s for o in ops] + [1e-30])
        self.m_scale = max([g.storage_bytes[s] for s in storages + t_storages] + [1e-30])
        self.time_cost = np.zeros(n)
        for o, c in op_col.items():
            self.time_cost[c] = (g.op_time_s[o] + g.op_overhead_s) / self.t_scale
        self.mem_cost = np.zeros(n)
        for s, c in x_col.items():
            self.mem_cost[c] = g.storage_bytes[s] / self.m_scale
        self.trans_cost = np.zeros(n)
        for s, c in y_col.items():
            self.trans_cost[c] = g.storage_bytes[s] / self.m_scale

        rows: list[tuple[list[int], list[float], float]] = []  # (cols, coefs, lower bound)
        lower = np.zeros(n)
        upper = np.ones(n)
        for v in g.read:
            o = g.value_op[v]
            if o < 0:
                continue
            if v in k_col:
                rows.append(([k_col[v], op_col[o]], [1.0, 1.0], 1.0))
            else:
                lower[op_col[o]] = 1.0  # not keepable: must be replayed
        for o in ops:
            for u in set(g.op_deps[o]):
                ou = g.value_op[u]
                if ou < 0:
                    continue
                cols, coefs = [op_col[ou], op_col[o]], [1.0, -1.0]
                if u in k_col:
                    cols.insert(0, k_col[u])
                    coefs.insert(0, 1.0)
                rows.append((cols, coefs, 0.0))
        for v in cand:
            rows.append(([x_col[g.value_storage[v]], k_col[v]], [1.0, -1.0], 0.0))
        for v in read_rebuilt:
            cols, coefs = [y_col[g.value_storage[v]], op_col[g.value_op[v]]], [1.0, -1.0]
            if v in k_col:
                cols.append(k_col[v])
                coefs.append(1.0)
            rows.append((cols, coefs, 0.0))

        program = Rows()
        for cols, coefs, lo in rows:
            program.add(cols, coefs, lo)
        # The two budget rows: kept memory (row M) and replay time (row T); bounds set per solve.
        nz_m = np.nonzero(self.mem_cost)[0]
        self.row_mem = program.add(nz_m.tolist(), self.mem_cost[nz_m].tolist())
        nz_t = np.nonzero(self.time_cost)[0]
        self.row_time = program.add(nz_t.tolist(), self.time_cost[nz_t].tolist())
        self.h = program.binary_program(self.time_cost, lower, upper)
        self._inf = highspy.kHighsInf
        self.stopped_early = 0
        """Solves that hit the time limit and returned their best feasible answer."""

    def set_time_limit(self, seconds: float) -> None:
        self.h.setOptionValue("time_limit", float(seconds))

    def _run(self, cost: np.ndarray) -> np.ndarray | None:
        h = self.h
        h.changeColsCost(self.n, np.arange(self.n, dtype=np.int32), cost)
        h.run()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kOptimal:
            return np.asarray(h.getSolution().col_value)
        if status != highspy.HighsModelStatus.kInfeasible:
            if h.getInfo().primal_solution_status == 2:  # time limit with a feasible answer: use it
                self.stopped_early += 1
                return np.asarray(h.getSolution().col_value)
            log.warning("TapeSAC planner: block MILP stopped without a solution (%s); skipping a "
                        "frontier point", h.modelStatusToString(status))
        return None

    def solve(self, max_memory: float = math.inf, transient_weight: float = 0.0,
              exact_ties: bool = True) -> Point | None:
        """Min replay time with kept bytes <= ``max_memory``; ties go to the least memory.

        ``exact_ties`` breaks ties with a second solve (the point is exactly Pareto-optimal);
        otherwise one solve with a tiny memory term in the objective (twice as fast, ties
        broken up to that weight). Returns None when infeasible (a negative bound).
        """
        h = self.h
        inf = self._inf
        kappa = inf if math.isinf(max_memory) else max_memory / self.m_scale
        h.changeRowBounds(self.row_mem, -inf, kappa)
        h.changeRowBounds(self.row_time, -inf, inf)
        tie = self.mem_cost + transient_weight * self.trans_cost
        if not exact_ties:
            sol = self._run(self.time_cost + 1e-7 * tie)
            if sol is None:
                return None
        else:
            sol = self._run(self.time_cost)
            if sol is None:
                return None
            best = float(self.time_cost @ sol)
            h.changeRowBounds(self.row_time, -inf, best * (1 + 1e-9) + 1e-12)
            sol2 = self._run(tie)
            if sol2 is not None:
                sol = sol2
        kept = tuple(v for v in self.cand if sol[self.k_col[v]] > 0.5)
        return evaluate(self.g, kept)


def evaluate(g: BlockGraph, kept: Sequence[int]) -> Point:
    """A keep set's exact costs, dropping kept values that change nothing."""
    kept = set(kept)
    ops = g.closure(kept)
    # A kept value is useful only if backward reads it or a replayed op reads it.
    needed = set(g.read) | {d for o in ops for d in g.op_deps[o]}
    kept = tuple(sorted(v for v in kept if v in needed))
    return Point(kept, g.kept_bytes(kept), g.recompute_time(kept), g.transient_bytes(kept))


def pareto(points: Sequence[Point]) -> list[Point]:
    """One point per Pareto-optimal (memory, time) pair, memory ascending."""
    best: list[Point] = []
    for p in sorted(points, key=lambda p: (p.memory, p.time, len(p.kept))):
        if best and best[-1].memory == p.memory:
            continue
        if best and p.time >= best[-1].time:
            continue
        best.append(p)
    return best


def _workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def frontier(g: BlockGraph, max_points: int | None = None, time_limit_s: float | None = None,
             transient_weight: float = 0.0, workers: int | None = None) -> list[Point]:
    """The block's memory/time Pareto frontier, memory ascending.

    ``max_points=None`` walks every Pareto point (epsilon-constraint on memory, each step strictly
    below the last point's memory). Otherwise about ``max_points`` points at evenly spaced memory
    bounds, each Pareto-optimal, from replay-only to keep-what-pays.
    """
    model = BlockModel(g)
    if time_limit_s is not None:
        model.set_time_limit(time_limit_s)
    exact = max_points is None or len(model.cand) <= 64
    top = model.solve(math.inf, transient_weight, exact)
    if top is None:  # the solver gave up: this block stays replay-only (always valid)
        log.warning("TapeSAC planner: no keep set found for a block; it will replay everything")
        return [evaluate(g, ())]
    points = [top, evaluate(g, ())]
    integral = all(float(b).is_integer() for b in g.storage_bytes)
    if max_points is None:
        step = 1.0 if integral else max(1e-9 * sum(g.storage_bytes), 1e-12)
        kappa = top.memory - step
        while kappa >= 0:
            p = model.solve(kappa, transient_weight)
            if p is None:
                break
            if p.memory > kappa:  # a solver tolerance let it through: ask for a bit less
                step *= 2
                kappa = min(kappa, points[-1].memory) - step
                continue
            points.append(p)
            kappa = p.memory - step
    else:
        kappas = [top.memory * (max_points - 2 - i) / max(max_points - 1, 1) for i in range(max_points - 1)]
        workers = min(workers or _workers(), len(kappas))
        if workers <= 1:
            found = [model.solve(k, transient_weight, exact) for k in kappas]
        else:  # HiGHS releases the GIL: one model per thread, bounds dealt round-robin
            from concurrent.futures import ThreadPoolExecutor

            models = [model] + [BlockModel(g) for _ in range(workers - 1)]
            for m in models[1:]:
                if time_limit_s is not None:
                    m.set_time_limit(time_limit_s)

            def run(i: int) -> list[Point | None]:
                return [models[i].solve(k, transient_weight, exact) for k in kappas[i::workers]]

            with ThreadPoolExecutor(workers) as ex:
                found = [p for chunk in ex.map(run, range(workers)) for p in chunk]
        points += [p for p in found if p is not None]
    return pareto(points)
