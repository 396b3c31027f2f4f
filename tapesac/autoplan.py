"""Planned mode: profile the first steps, plan under a memory limit, apply the plan, check it.

Steps are counted at the forward of the first wrapped block. The life of a run:

1. ``warmup_steps`` steps in replay-only mode (allocator, lazy initialisation);
2. ``profile_steps`` steps in replay-only mode with every op timed and the memory traced;
3. plan (rank 0 when distributed, on times and traces reduced over ranks), apply everywhere;
4. the next step is measured: if its peak exceeds the limit, re-plan with the overshoot as a
   margin (at most ``max_replans`` times, then replay-only with a warning).

A saved policy whose signatures match the recorded tapes skips steps 1-3.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import distributed as tdist
from .errors import PlanError, PolicyError
from .memory import MemoryTrace, StepMemory, fmt_bytes
from .meter import meter_for
from .planner import Plan, make_plan
from .policy import Policy
from .profile import OpTimer, block_graph, calibrate_overheads, merge_profiles

log = logging.getLogger("tapesac")


@dataclasses.dataclass
class PlanConfig:
    """How planned mode profiles, plans and checks."""

    memory_limit_bytes: int
    """Limit on the step peak, in bytes."""
    safety_margin: float = 0.005
    """Fraction of the limit held back for what a profiled step cannot show: allocations outside
    the measured window, and sizes that change with the data (tokens per expert in MoE). Never
    reserved below the smallest achievable peak."""
    warmup_steps: int = 1
    """Replay-only steps before profiling."""
    profile_steps: int = 1
    """Replay-only steps with every op timed and memory traced; times are their median."""
    repeats: int = 3
    """Runs per op when timing (median)."""
    timing_reduction: str = "max"
    """How per-op times are combined across ranks: max, mean or median."""
    solver_time_limit_s: float = 0.15
    """Time limit of the allocation MILP that polishes the greedy plan (0: greedy only)."""
    points_per_block: int = 12
    """Points of each kind's frontier the allocation chooses from."""
    frontier_points: int = 24
    verify: bool = True
    """Measure the first planned step and re-plan tighter if it exceeds the limit."""
    max_replans: int = 3
    policy_path: str | None = None
    """Load the policy from here when it matches (skips profiling); save it here after planning."""
    frontier_path: str | None = None
    """Write the step frontier here as JSON (and as PNG next to it when matplotlib is present)."""
    graph_dir: str | None = None
    """Write each kind of block's measured graph here (``tools/frontier.py --graph`` reads them)."""
    device: torch.device | None = None
    """Device whose memory is measured (default: that of the first block's parameters)."""
    track: Any = None
    """CPU only: what besides the blocks counts toward the peak (modules, tensors, optimizers, or
    a callable returning tensors). On CUDA the allocator's own statistics count everything."""
    process_group: Any = None
    policy_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Facts stored in the saved policy and checked when loading it (world size, model): a
    policy made under other facts is ignored with a warning, and the run re-plans."""


def _tensors_of(things: Any) -> Iterable[torch.Tensor]:
    if things is None:
        return
    if callable(things) and not isinstance(things, (nn.Module, torch.optim.Optimizer)):
        things = things()
    if isinstance(things, (nn.Module, torch.Tensor, torch.optim.Optimizer)):
        things = [things]
    for t in things:
        if isinstance(t, nn.Module):
            for p in t.parameters():
                yield _local(p)
                if p.grad is not None:
                    yield _local(p.grad)
            yield from (_local(b) for b in t.buffers())
        elif isinstance(t, torch.optim.Optimizer):
            for state in t.state.values():
                yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(t, torch.Tensor):
            yield _local(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank holds of a DTensor (FSDP2 parameters), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class AutoPlanner:
    """Drives planned mode for one :class:`~tapesac.api.TapeSACHandle`."""

    def __init__(self, handle, config: PlanConfig) -> None:
        if config.memory_limit_bytes <= 0:
            raise PlanError(f"memory limit must be positive, got {config.memory_limit_bytes} bytes")
        if config.profile_steps < 1 or config.warmup_steps < 0:
            raise PlanError("profile_steps must be >= 1 and warmup_steps >= 0")
        self.handle = handle
        self.config = config
        self.step = 0
        self.phase = "warmup"
        self.plan: Plan | None = None
        self.history: list[dict[str, Any]] = []
        """One record per planned (verified) step: limit, predicted and measured peak."""
        self._trace: MemoryTrace | None = None
        self._profiled: list[tuple[dict[int, Any], StepMemory]] = []
        if not 0 <= config.safety_margin < 1:
            raise PlanError(f"safety_margin must be in [0, 1), got {config.safety_margin}")
        self._limit = float(config.memory_limit_bytes)
        self._replans = 0
        first = handle.blocks[0].module
        params = list(first.parameters())
        self.device = config.device or (params[0].device if params else torch.device("cpu"))
        for s in handle.blocks:
            s.controller = self
        if config.policy_path and Path(config.policy_path).exists():
            try:
                policy = Policy.load(config.policy_path)
                self._check_loaded(policy)
                handle.set_policy(policy)
                self.phase = "verify" if config.verify else "planned"
                self.loaded_policy = True
                log.info("TapeSAC: loaded policy %s (checked against the first recorded tapes)",
                         config.policy_path)
            except PolicyError as e:
                log.warning("TapeSAC: ignoring policy file %s (%s); profiling instead", config.policy_path, e)

    def _check_loaded(self, policy: Policy) -> None:
        requested = policy.meta.get("limit_requested_bytes", policy.limit_bytes)
        if requested != self.config.memory_limit_bytes:
            raise PolicyError(f"it was planned for a limit of {fmt_bytes(requested or 0)}, not "
                              f"{fmt_bytes(self.config.memory_limit_bytes)}")
        for key, value in self.config.policy_meta.items():
            if policy.meta.get(key) != value:
                raise PolicyError(f"it was planned for {key}={policy.meta.get(key)!r}, not {value!r}")

    # Hooks called by BlockState ------------------------------------------------------------------

    def before_forward(self, state, args: tuple = (), kwargs: dict | None = None) -> None:
        if state is self.handle.blocks[0]:
            self._step_boundary(args, kwargs or {})
        if self._trace is not None:
            self._trace.boundary("fwd_start", state.index)

    def after_forward(self, state, replayer) -> None:
        trace = self._trace
        if trace is not None:
            trace.boundary("fwd_end", state.index)
            if replayer is not None:  # None: a pass-through block (plain autograd)
                replayer.on_first_unpack = lambda r, b=state.index: trace.boundary("bwd_start", b, r)

    def policy_mismatch(self, state, signature: str) -> bool:
        """A loaded or planned policy does not fit the tape: drop it and profile again."""
        log.warning("TapeSAC: block %d's tape (signature %s) differs from the policy's; the policy is "
                    "dropped and the run re-profiles (shapes or model changed)", state.index, signature)
        self._reprofile()
        return True

    def _reprofile(self) -> None:
        self.handle.set_policy(None)
        self._abort_trace()
        self.phase = "warmup"
        self.step = 0
        self._profiled = []

    def close(self) -> None:
        self._abort_trace()

    # Step boundaries ----------------------------------------------------------------------------

    def _abort_trace(self) -> None:
        if self._trace is not None and self._trace.started:
            self._trace.meter.stop()
        self._trace = None
        for s in self.handle.blocks:
            s.timer = None

    def _step_boundary(self, args: tuple = (), kwargs: dict | None = None) -> None:
        if self._trace is not None:
            self._trace_orders = self._trace.unpack_orders
            memory = self._trace.finish()
            self._trace = None
            if self.phase == "profile":
                self._orders = dict(self._trace_orders)
                self._profiled.append(({s.index: s.last_tape for s in self.handle.blocks}, memory))
                for s in self.handle.blocks:
                    s.timer = None
                if len(self._profiled) >= self.config.profile_steps:
                    self._make_plan()
            elif self.phase == "verify":
                self._verify(memory)
        self.step += 1
        if self.phase == "warmup" and self.step > self.config.warmup_steps:
            self.phase = "profile"
        # The first block's inputs (the embeddings) were made this step before any block ran.
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if self.phase == "profile":
            timer = OpTimer(self.config.repeats, self.device.type)
            for s in self.handle.blocks:
                s.timer = timer
            self._start_trace(inputs)
        elif self.phase == "verify" and self.step > self.config.warmup_steps:
            # A loaded policy is applied from the first step, but measured only once warm
            # (the first steps allocate optimizer state and caches).
            self._start_trace(inputs)

    def _start_trace(self, inputs: list[torch.Tensor] = ()) -> None:
        track = []
        if self.device.type != "cuda":
            track = list(_tensors_of([s.module for s in self.handle.blocks]))
            track += list(_tensors_of(self.config.track))
            track += list(_tensors_of(list(inputs)))
        self._trace = MemoryTrace(meter_for(self.device, track))
        self._trace.start()

    # Planning -----------------------------------------------------------------------------------

    def _make_plan(self) -> None:
        group = self.config.process_group
        last_tapes = self._profiled[-1][0]
        signatures = {b: t.signature() for b, t in last_tapes.items()}
        tdist.check_signatures(signatures, group)
        for tapes, _m in self._profiled:
            if {b: t.signature() for b, t in tapes.items()} != signatures:
                raise PlanError("TapeSAC: block tapes changed between profiling steps (dynamic "
                                "shapes?); planned mode needs the same tapes every step")
        merged = {b: merge_profiles([tapes[b] for tapes, _m in self._profiled]) for b in last_tapes}
        times = {b: m[0] for b, m in merged.items()}
        sizes = {b: m[1] for b, m in merged.items()}
        memory = StepMemory.merge_max([m for _t, m in self._profiled])
        times, sizes, memory = tdist.reduce_profile(times, sizes, memory, self.config.timing_reduction, group)
        self._graphs = {b: block_graph(t, times[b], self._orders.get(b), sizes[b])
                        for b, t in last_tapes.items()}
        # TapeSAC's own costs belong in the plan: each replayed op's bookkeeping, and recording
        # a block at all (saved when a block keeps everything and runs as plain autograd).
        record_s, replay_s = tdist.broadcast(calibrate_overheads(self.device), group)
        for b, g in self._graphs.items():
            g.op_overhead_s = replay_s
            g.record_overhead_s = record_s * len(last_tapes[b].ops)
        self._memory = memory
        self._replan(self._limit)

    def _replan(self, limit: float) -> None:
        group = self.config.process_group
        payload: Any = None
        if tdist.rank(group) == 0:
            try:
                plan = make_plan(self._graphs, self._memory, limit,
                                 points_per_block=self.config.points_per_block,
                                 frontier_points=self.config.frontier_points,
                                 solver_time_limit_s=self.config.solver_time_limit_s,
                                 margin=self.config.safety_margin,
                                 meta={"limit_requested_bytes": self.config.memory_limit_bytes,
                                       **self.config.policy_meta})
                payload = ("plan", plan)
            except PlanError as e:
                payload = ("error", str(e))
        kind, value = tdist.broadcast(payload, group)
        if kind == "error":
            self._abort_trace()
            raise PlanError(value)
        self.plan = value
        self.handle.set_policy(value.policy)
        self.phase = "verify" if self.config.verify else "planned"
        a = value.allocation
        kept = sum(p.memory for p in a.points.values())
        log.info(
            "TapeSAC plan: limit %s, predicted peak %s (smallest possible %s), keeps %s, recompute "
            "%.1f ms/step, %d kind(s) of block, %s, solved in %.2f s",
            fmt_bytes(limit), fmt_bytes(a.predicted_peak_bytes), fmt_bytes(value.smallest_peak_bytes),
            fmt_bytes(kept), a.recompute_s * 1e3, len(value.block_frontiers), a.status, value.solve_s)
        if tdist.rank(group) == 0:
            self._save(value)

    def _save(self, plan: Plan) -> None:
        if self.config.policy_path:
            plan.policy.save(self.config.policy_path)
        if self.config.graph_dir:
            folder = Path(self.config.graph_dir)
            folder.mkdir(parents=True, exist_ok=True)
            written: set[str] = set()
            for b, g in sorted(self._graphs.items()):
                if g.signature not in written:
                    written.add(g.signature)
                    (folder / f"block{b}_{g.signature}.json").write_text(json.dumps(g.to_json()))
        if self.config.frontier_path:
            path = Path(self.config.frontier_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            data = plan.frontier_json()
            path.write_text(json.dumps(data, indent=1))
            _plot_in_thread(data, path.with_suffix(".png"))

    def _verify(self, memory: StepMemory) -> None:
        measured = memory.baseline_peak()
        group = self.config.process_group
        if tdist.active(group):
            measured = max(tdist.all_gather(measured, group))
        predicted = (self.plan.allocation.predicted_peak_bytes if self.plan else
                     self.handle.blocks[0].policy_predicted_peak)
        limit = self.config.memory_limit_bytes
        self.history.append({"limit_bytes": limit, "planned_limit_bytes": self._limit,
                             "predicted_peak_bytes": predicted, "measured_peak_bytes": measured})
        log.info("TapeSAC: measured step peak %s (predicted %s, limit %s)", fmt_bytes(measured),
                 fmt_bytes(predicted) if predicted is not None else "n/a", fmt_bytes(limit))
        self.phase = "planned"
        if measured <= limit:
            return
        if not hasattr(self, "_graphs"):  # a loaded policy overshoots: profile and plan afresh
            log.warning("TapeSAC: the loaded policy exceeds the limit; re-profiling")
            self._reprofile()
            return
        self._replans += 1
        if self._replans > self.config.max_replans:
            log.warning("TapeSAC: still over the limit after %d re-plans; using replay-only",
                        self.config.max_replans)
            self.handle.set_policy(None)
            return
        overshoot = measured - (predicted if predicted is not None else measured)
        self._limit = self._limit - max(overshoot, measured - limit) - 0.01 * limit
        log.warning("TapeSAC: measured peak over the limit by %s; re-planning for %s",
                    fmt_bytes(measured - limit), fmt_bytes(self._limit))
        self._replan(self._limit)


def _plot_in_thread(data: dict, path: Path) -> None:
    """Draw the frontier PNG on a short-lived thread.

    Importing matplotlib inside a training step would pin that step's call stack, and with it
    the model's activations, in tracebacks its import machinery keeps; on a thread of its own
    only that thread's frames are involved. A plot must never stop training.
    """
    import importlib.util
    import threading

    if importlib.util.find_spec("matplotlib") is None:
        return

    def draw() -> None:
        try:
            from .plot import plot_frontier

            plot_frontier(data, path)
        except Exception as e:
            log.warning("TapeSAC: could not draw the frontier plot: %s", e)

    t = threading.Thread(target=draw, name="tapesac-plot")
    t.start()
    t.join()
