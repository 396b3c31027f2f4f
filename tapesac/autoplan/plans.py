"""Profile -> plan -> adopt: a profiled step becomes a :class:`StepPlan`, rank 0 solves it and
broadcasts, every rank adopts the same plan, and the first measured step under it is checked
(re-planned tighter when over the limit; compiled mode may raise it, ``compiled_steps``)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import distributed as tdist
from ..artifacts import save_plan
from ..bounds import SizeBounds, check_recordings, moved, size_bounds
from ..errors import PlanError, PolicyError
from ..planner import Plan, make_plan
from ..planner.compiled_cost import compiled_costs
from ..planner.graph import BlockGraph
from ..policy import Policy
from ..profile import block_graph, calibrate_overheads, merge_profiles
from ..report import block_ranges, fmt_bytes
from ..stepmodel import StepMemory
from .config import PlanConfig
from .ranks import fail, say
from .compiled_steps import CompiledSteps
from .step import StepPlan, _StepState

log = logging.getLogger("tapesac")


def keeps_nothing(policy: Policy) -> bool:
    """``policy`` keeps no value of any block and runs none as plain autograd: replay-only,
    the smallest step peak there is."""
    return not any(b.keep or b.passthrough for b in policy.blocks.values())


class PlanBook:
    """The plans of one run by step key (at most ``max_plans``), and the keys given up."""

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.plans: dict[str, StepPlan] = {}
        """Plans by step key, at most ``config.max_plans``."""
        self.unplannable: dict[str, str] = {}
        """Step keys that run replay-only for good, with the reason (warned once)."""
        self._profile_failures: dict[str, int] = {}
        """Step key -> profiles of it discarded so far."""

    def choose(self, last_key: str | None, block: int, ik: str) -> StepPlan | None:
        """The plan for a step whose first recording is ``block`` on inputs ``ik``: the last
        step's (of key ``last_key``) if it starts so (steps repeat), else the newest that does."""
        last = self.plans.get(last_key) if last_key is not None else None
        candidates = ([last] if last is not None else []) + list(reversed(self.plans.values()))
        for entry in candidates:
            if entry.recordings and entry.recordings[0] == (block, ik):
                return entry
        return None

    def profile_failed(self, key: str, why: str) -> None:
        """A profile of ``key`` was discarded; give the key up after ``max_profile_failures``."""
        n = self._profile_failures.get(key, 0) + 1
        self._profile_failures[key] = n
        if n >= self.config.max_profile_failures:
            self.give_up(key, f"profiling failed {n} times ({why})")
        else:
            say(self.config.process_group, logging.WARNING, "TapeSAC: profile discarded (%s); trying again", why)

    def give_up(self, key: str, why: str) -> None:
        """Steps of ``key`` run replay-only for good (warned once)."""
        if key not in self.unplannable:
            self.unplannable[key] = why
            say(self.config.process_group, logging.WARNING,
                "TapeSAC: steps with these input shapes run replay-only: %s", why)


def profile_error(step: _StepState) -> str | None:
    """Why this rank's profiled step cannot be planned, or None."""
    if not step.tapes:
        return "no block was recorded"
    sigs: dict[int, str] = {}
    keys: dict[int, str] = {}
    for r in step.recordings:
        if keys.setdefault(r.block, r.input_key) != r.input_key:
            return f"block {r.block} ran on different input shapes within one step"
    for b, tape in step.tapes:
        if sigs.setdefault(b, tape.signature()) != sigs[b]:
            return f"block {b} recorded different programs within one step"
    return None


class PlanMaker:
    """Makes, adopts and checks the plans of one planner (rank 0 solves, every rank adopts)."""

    def __init__(self, handle: Any, config: PlanConfig, device: torch.device, plans: dict[str, StepPlan],
                 compiled: CompiledSteps, stop_trace: Callable[[], None]) -> None:
        self.handle = handle
        self.config = config
        self.group = config.process_group
        self.device = device
        self.plans = plans
        """The planner's plans by step key (a loaded policy measured over the limit leaves it)."""
        self.compiled = compiled
        self._stop_trace = stop_trace
        """Stops the step's trace before an error ends planned mode."""
        self.plan: Plan | None = None
        """The most recently solved plan (None until one is made; a loaded policy is not one)."""
        self.history: list[dict[str, Any]] = []
        """One record per measured (verify) step: key, limit, predicted and measured peak."""
        self._overheads: tuple[float, float] | None = None
        """TapeSAC's own (recording, replaying) cost per op, calibrated once (rank 0's)."""

    def _log(self, level: int, msg: str, *args: Any) -> None:
        say(self.group, level, msg, *args)

    def add_retained(self, entry: StepPlan, memory: StepMemory) -> None:
        """Add a traced replay-only step that retained a graph to ``entry``'s model; re-plan."""
        try:
            _t, _s, memory = tdist.reduce_profile({}, {}, memory, self.config.timing_reduction, self.group)
        except ValueError as e:  # ranks traced different windows: try again at the next such step
            self._log(logging.WARNING, "TapeSAC: retained-graph trace discarded (%s)", e)
            return
        entry.memory = StepMemory.union([entry.memory, memory])
        entry.retained = True
        if entry.plan is None:  # the key runs replay-only for good (no plan fit)
            return
        self._log(logging.INFO, "TapeSAC: traced a step that retained its graph; re-planning its step shape for it")
        self.solve(entry, entry.limit_bytes, first=False)

    def plan_profiled(self, key: str, step: _StepState, memory: StepMemory,
                      orders: dict[int, list[int]]) -> str | None:
        """Plan the profiled ``step`` (its tapes, its memory trace ``memory`` and the unpack
        ``orders`` of its replays) for its key; returns why the profile cannot be used, or None."""
        group = self.group
        by_block: dict[int, list[Any]] = {}
        for b, tape in step.tapes:
            by_block.setdefault(b, []).append(tape)
        signatures = {b: tapes[0].signature() for b, tapes in by_block.items()}
        try:
            tdist.check_signatures(signatures, group, describe=lambda b: by_block[b][0].signature_lines())
        except PolicyError as e:
            fail(self.config, e)
        merged = {b: merge_profiles(tapes) for b, tapes in by_block.items()}
        times = {b: m[0] for b, m in merged.items()}
        sizes = {b: m[1] for b, m in merged.items()}
        try:
            times, sizes, memory = tdist.reduce_profile(times, sizes, memory, self.config.timing_reduction, group)
        except ValueError as e:  # every rank gathered the same traces, so every rank lands here
            return str(e)
        bounds = self._size_bounds(by_block, signatures)
        graphs = {b: block_graph(tapes[0], times[b], orders.get(b), sizes[b], bounds.get(b))
                  for b, tapes in by_block.items()}
        if self._overheads is None:
            # TapeSAC's own costs belong in the plan: each replayed op's bookkeeping, and recording
            # a block at all (saved when a block keeps everything and runs as plain autograd).
            self._overheads = tdist.broadcast(calibrate_overheads(self.device), group)
        record_s, replay_s = self._overheads
        for b, g in graphs.items():
            g.op_overhead_s = replay_s
            g.record_overhead_s = record_s * len(by_block[b][0].ops)
            if self.compiled.active:  # plans run compiled: fused recompute, no replay
                compiled_costs(g)
        self._log(logging.INFO, "TapeSAC: planning %d block(s) of %d kind(s) for a step-peak limit of %s",
                  len(graphs), len({g.signature for g in graphs.values()}), fmt_bytes(self.config.memory_limit_bytes))
        recordings = [(r.block, r.input_key) for r in step.recordings]
        entry = StepPlan(key, recordings, Policy.replay_only(signatures),
                         programs={b: tapes[0].program_hash() for b, tapes in by_block.items()},
                         graphs=graphs, memory=memory,
                         limit_bytes=float(self.config.memory_limit_bytes), retained=memory.backwards_twice())
        self.solve(entry, entry.limit_bytes, first=True)
        self.plans[key] = entry
        return None

    def _size_bounds(self, by_block: dict[int, list[Any]], signatures: dict[int, str]) -> dict[int, SizeBounds]:
        """Per block, the bounds of its sizes that depend on the data (``tapesac.bounds``), the
        same on every rank: the largest over ranks, unbounded where any rank is."""
        if self.config.data_dependent_sizes != "bound":
            return {}
        by_kind: dict[str, list[int]] = {}
        for b, sig in signatures.items():
            by_kind.setdefault(sig, []).append(b)
        mine: dict[int, tuple[dict[int, int], str | None]] = {}
        for blocks in by_kind.values():
            tapes = [t for b in blocks for t in by_block[b]]
            first = tapes[0]  # the kind's bounds in its storage ids, each block's in its own
            kind = size_bounds(first)
            for t in tapes[1:]:
                kind = kind.merge(moved(size_bounds(t), t, first))
            kind = check_recordings(tapes, kind)
            for b in blocks:
                mine[b] = (moved(kind, first, by_block[b][0]).bytes, kind.unbounded)
        merged: dict[int, SizeBounds] = {}
        for theirs in tdist.all_gather(mine, self.group):
            for b, (nbytes, why) in theirs.items():
                merged[b] = merged.get(b, SizeBounds()).merge(SizeBounds(dict(nbytes), why))
        reasons = {signatures[b]: (b, sb.unbounded) for b, sb in merged.items() if sb.unbounded}
        for _sig, (b, why) in reasons.items():
            self._log(logging.WARNING, "TapeSAC: block %d (and those like it) has sizes that depend on the data "
                      "that no bound follows: %s. Only safety_margin covers a step whose sizes there are "
                      "larger", b, why)
        bounded = sum(1 for sb in merged.values() if sb.bytes)  # unbounded ones too: their other bounds stand
        if bounded:
            self._log(logging.INFO, "TapeSAC: %d block(s) have sizes that depend on the data; planned at their "
                      "largest (data_dependent_sizes=\"bound\")", bounded)
        return merged

    def _over_at_floor(self, measured: float, limit: float, step: int) -> None:
        """A step that kept nothing measured ``measured``, over ``limit``: no plan can keep the
        limit. An error (``on_infeasible="error"``), or a warning and replay-only from here on."""
        msg = (f"TapeSAC: memory limit {fmt_bytes(limit)} ({limit:.0f} bytes) is infeasible: step {step} kept "
               f"nothing (replay-only, the smallest peak there is) and measured {fmt_bytes(measured)} "
               f"({measured:.0f} bytes), over the limit, so no plan can keep it. Raise the limit to at least "
               "that, or reduce batch size or sequence length")
        if self.config.on_infeasible == "error":
            fail(self.config, PlanError(msg))
        self._log(logging.WARNING, "%s; going on replay-only, over the limit (on_infeasible='replay_only')", msg)

    def solve(self, entry: StepPlan, limit: float, first: bool) -> None:
        """Rank 0 plans ``entry`` for ``limit`` and broadcasts; every rank applies the same."""
        cfg = self.config
        payload: Any = None
        if tdist.rank(self.group) == 0:
            try:
                plan = make_plan(entry.graphs, entry.memory, limit,
                                 points_per_block=cfg.points_per_block, frontier_points=cfg.frontier_points,
                                 solver_time_limit_s=cfg.solver_time_limit_s, margin=cfg.safety_margin,
                                 passthrough=not entry.retained,
                                 meta={"limit_requested_bytes": cfg.memory_limit_bytes, "step_key": entry.key,
                                       "retained": entry.retained,
                                       "recordings": [list(r) for r in entry.recordings],
                                       **cfg.policy_meta})
                payload = ("plan", plan)
            except PlanError as e:
                payload = ("infeasible" if e.floor_bytes is not None else "error", str(e))
            except Exception as e:  # noqa: BLE001 - never leave the other ranks in the broadcast
                payload = ("error", f"TapeSAC: the planner failed ({type(e).__name__}: {e}); please "
                                    "report it with the saved block graphs (PlanConfig.graph_dir)")
        kind, value = tdist.broadcast(payload, self.group)
        if kind == "infeasible" and first and self.compiled.active and cfg.compiled_raise_into_slack:
            # Compiled code peaks below the eager memory model (fused kernels make fewer
            # transients): replay-only compiled may keep a limit the model calls infeasible.
            self._log(logging.WARNING, "TapeSAC: %s. Compiled code peaks below this prediction: trying "
                      "replay-only compiled, measured before it is trusted (compiled_raise_into_slack)", value)
            entry.run_replay_only()
            entry.limit_bytes = limit
            return
        if kind != "plan":
            if first:
                self._stop_trace()
                fail(self.config, PlanError(value))
            self._log(logging.WARNING, "TapeSAC: no plan fits the tightened limit %s (%s); this step shape runs "
                        "replay-only, the smallest peak there is", fmt_bytes(limit), value)
            entry.run_replay_only()
            return
        self.adopt(entry, value, limit)
        entry.verified = not cfg.verify

    def adopt(self, entry: StepPlan, plan: Plan, limit: float) -> None:
        """Run ``entry``'s steps under ``plan``, solved for ``limit``; rank 0 describes and saves it."""
        cfg = self.config
        self.plan = entry.plan = plan
        entry.policy = plan.policy
        entry.limit_bytes = limit
        if tdist.rank(self.group) == 0:
            self._describe(plan, entry.graphs, limit)
            try:
                written = save_plan(plan, entry.graphs, policy_path=cfg.policy_path,
                                    frontier_path=cfg.frontier_path, graph_dir=cfg.graph_dir)
            except OSError as e:  # a file we cannot write never stops training
                log.warning("TapeSAC: could not write the plan's files: %s", e)
            else:
                if written:
                    log.info("TapeSAC plan: wrote %s", ", ".join(written))

    def _describe(self, plan: Plan, graphs: dict[int, BlockGraph] | None, limit: float) -> None:
        """The plan for people (rank 0): the frontier's ends, the choice, what each kind keeps."""
        a = plan.allocation
        ends = (plan.frontier[0], plan.frontier[-1]) if plan.frontier else (None, None)
        log.info(
            "TapeSAC plan: limit %s; step frontier from %s (replay-only, full-AC memory%s) to %s (keep "
            "everything useful%s); chosen: predicted peak %s, recompute %.1f ms/step (%s, solved in %.2f s)",
            fmt_bytes(limit), fmt_bytes(plan.smallest_peak_bytes),
            f", recompute {ends[0]['recompute_s'] * 1e3:.1f} ms" if ends[0] else "",
            fmt_bytes(plan.largest_useful_peak_bytes),
            f", recompute {ends[1]['recompute_s'] * 1e3:.1f} ms" if ends[1] else "",
            fmt_bytes(a.predicted_peak_bytes), a.recompute_s * 1e3, a.status, plan.solve_s)
        for group in plan.frontier_json(graphs=graphs)["chosen"]["keeps"]:
            blocks = group["blocks"]
            kind = type(self.handle.blocks[blocks[0]].module).__name__
            plain = all(plan.policy.blocks[b].passthrough for b in blocks)
            unseen = graphs[blocks[0]].unseen_bytes if graphs and blocks[0] in graphs else 0
            log.info("TapeSAC plan: %s blocks %s: %s kept per block, %.1f ms recompute; %s%s%s", kind,
                     block_ranges(blocks), fmt_bytes(group["kept_bytes"]), group["recompute_time"] * 1e3,
                     group.get("summary", f"keeps {len(group['kept'])} values"),
                     f"; kept: written outside the dispatcher {fmt_bytes(unseen)}" if unseen else "",
                     " (runs as plain autograd)" if plain else "")

    def verify(self, entry: StepPlan, measured: float, meter: str, step: int) -> None:
        """``measured``: this rank's peak of the first step under ``entry``'s plan measured (the
        ``step``-th), by ``meter``: the step trace's (a storage counter on CPU, which runs compiled
        blocks eagerly; allocator statistics on CUDA), or the CPU allocator's events (compiled
        code). Within the limit: verified (compiled mode may raise into the slack); over it:
        re-planned tighter, at most ``max_replans`` times, then replay-only, itself measured; a
        step that keeps nothing and is still over ends planned mode (``on_infeasible``)."""
        if tdist.active(self.group):
            measured = max(tdist.all_gather(measured, self.group))
        predicted = entry.policy.predicted_peak_bytes
        limit = self.config.memory_limit_bytes
        self.history.append({"step": step, "step_key": entry.key, "limit_bytes": limit,
                             "planned_limit_bytes": entry.limit_bytes, "predicted_peak_bytes": predicted,
                             "measured_peak_bytes": measured, "compiled": self.compiled.active, "meter": meter})
        self._log(logging.INFO, "TapeSAC: first step under the plan: measured peak %s (predicted %s, limit %s)",
                  fmt_bytes(measured), fmt_bytes(predicted) if predicted is not None else "n/a", fmt_bytes(limit))
        entry.verified = True
        if measured <= limit * (1 - self.compiled.margin(entry)):
            self.compiled.measured_within(entry, measured, limit, self)
            return
        if self.compiled.measured_over(entry, measured, predicted, limit, self):
            return
        if entry.graphs is None:  # a loaded policy overshoots: profile and plan afresh
            self._log(logging.WARNING, "TapeSAC: the loaded policy exceeds the limit; profiling again")
            del self.plans[entry.key]
            return
        if keeps_nothing(entry.policy):
            if measured > limit:
                self._over_at_floor(measured, limit, step)
            return
        entry.replans += 1
        if entry.replans > self.config.max_replans:
            self._log(logging.WARNING, "TapeSAC: still over the limit after %d re-plans; this step shape runs "
                      "replay-only (measured next)", self.config.max_replans)
            entry.run_replay_only()
            return
        overshoot = measured - (predicted if predicted is not None else measured)
        tighter = entry.limit_bytes - max(overshoot, measured - limit) - 0.01 * limit
        if tighter <= 0:  # more over than the whole limit: only keeping nothing can still fit
            self._log(logging.WARNING, "TapeSAC: measured peak over the limit by %s, more than any plan can "
                      "save; this step shape runs replay-only (measured next)", fmt_bytes(measured - limit))
            entry.run_replay_only()
            return
        self._log(logging.WARNING, "TapeSAC: measured peak over the limit by %s; re-planning for %s",
                  fmt_bytes(measured - limit), fmt_bytes(tighter))
        self.solve(entry, tighter, first=False)

