"""The driver of planned mode: a state machine over steps, the same on every rank.

Phases (:class:`~tapesac.autoplan.step.Phase`), the same on every rank:

1. ``warmup``: ``warmup_steps`` steps replay-only (the first optimizer step allocates its state);
2. then each step runs under the plan made for its *step key* (the blocks recorded, in order,
   and their input shapes), or replay-only when there is none. The plan is chosen at the step's
   first block forward and followed only while the step's forwards match the profiled step's;
   a step that departs runs the rest replay-only and releases what it kept. A step whose key has
   no plan makes the next step a *profiling* step (every op timed, memory traced); at its end
   rank 0 plans for that key and broadcasts the plan (``plans``). A small cache keeps a plan per
   key (a few sequence lengths).
3. The first step under a new plan is measured (*verify*): over the limit means re-plan tighter
   (at most ``max_replans`` times, then replay-only for that key with a warning). Compiled mode
   measures a compiled step and may raise a plan into measured slack (``compiled_steps``).
4. Once a step of the run has backwarded a recording twice (a graph retained for a second
   backward), every plan must also be made from a traced step that did so: the step key names
   the forwards only, and a trace of a step that freed its graph as it went shows less than one
   that retained it (``tapesac.stepmodel``). Until a key has such a trace its steps run
   replay-only, traced, and the first that retains is added to the key's model
   (``StepMemory.union``) and the key re-planned and verified.

Why a step's memory is traced is its :class:`~tapesac.autoplan.step.TracePurpose`, decided at
its first block forward (the trace itself starts at the boundary before it). A recording whose
tape does not match its plan drops what it would keep (replay-only memory) and marks the step
(pass-through blocks check the ops they ran instead); the plan is then dropped on every rank
and the key is profiled again, twice at most. What the ranks agree on is ``ranks``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from .. import distributed as tdist
from ..errors import PolicyError
from ..planner import Plan
from ..policy import Policy
from ..profile import OpTimer
from .compiled_steps import CompiledSteps
from .config import PlanConfig
from .plans import PlanBook, PlanMaker, profile_error
from .policy_files import load_policy
from .ranks import _Agreed, fail, say
from .step import (Optimizers, Phase, StepPlan, TracePurpose, _Recording, _StepState, input_key,
                   optimizer_hook, step_key, step_mode)
from .tracing import Tracing, unpack_hook


class AutoPlanner:
    """Drives planned mode for one :class:`~tapesac.api.TapeSACHandle` (see the module doc);
    the :class:`~tapesac.block.Controller` of every wrapped block.

    Larger than the other classes of the package (about 340 lines, a sixth of them field docs):
    the transitions of the state machine (a block forward, a step's end, a step's start) stay in
    one class so they read in the order they run; what each phase does is in its own file."""

    def __init__(self, handle, config: PlanConfig) -> None:
        self.handle = handle
        self.config = config
        self.group = config.process_group
        first = handle.blocks[0].module
        params = list(first.parameters())
        self.device = config.device or (params[0].device if params else torch.device("cpu"))
        self.phase = Phase.WARMUP
        self.steps = 0
        """Step boundaries seen (optimizer steps or ``handle.step()`` calls)."""
        self.book = PlanBook(config)
        """The plans by step key, and the keys given up."""
        self.loaded_policy = False
        """A saved policy was loaded (``PlanConfig.policy_path``)."""
        self.last_step_mode = "warm-up"
        """How the last step ran, in words: warm-up, profiled, planned, verified, replay-only."""
        self._optimizers = Optimizers(handle)
        """The optimizers whose ``step()`` ends a step."""
        self.compiled = CompiledSteps(handle, config, self.device)
        """Compiled mode's measuring and raising (eager answers when no block runs compiled)."""
        self._tracing = Tracing(handle, config, self.device, self.compiled, self._optimizers)
        """The current step's memory trace, and why it is taken."""
        self.maker = PlanMaker(handle, config, self.device, self.book.plans, self.compiled, self._tracing.stop)
        """Profile -> plan -> adopt, and the check of the first measured step under a plan."""
        self._step = _StepState()
        """What the current step has seen."""
        self._next_rid = 0
        """The id of the next recording (the step model follows recordings)."""
        self._started = False
        """A block forward ran (the policy file is read at the first)."""
        self._manual_steps = False
        """``handle.step()`` was called: optimizer steps no longer end steps."""
        self._last_key: str | None = None
        """Step key of the step that ended last (the best guess for the next one)."""
        self._last_same = True
        """Whether every rank ran that key."""
        self._starts: dict[str, tuple[int, str]] = {}
        """Step key -> its first recording (block, input signature): how such a step begins."""
        self._last_active: StepPlan | None = None
        """The policy the last step ran under from start to end (None: it did not)."""
        self._retains = False
        """Some step of this run backwarded a recording twice: plans must be made for it (phase 4)."""
        self._warned_no_boundary = False
        for s in handle.blocks:
            s.attach(self)
        self._hook = optimizer_hook(self)
        """The process-wide optimizer post-hook (holds the planner weakly; goes with it or close)."""

    @property
    def plans(self) -> dict[str, StepPlan]:
        """Plans by step key, at most ``config.max_plans``."""
        return self.book.plans

    @property
    def plan(self) -> Plan | None:
        """The most recently solved plan (None until one is made; a loaded policy is not one)."""
        return self.maker.plan

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per measured (verify) step: key, limit, predicted and measured peak."""
        return self.maker.history

    @property
    def measuring(self) -> bool:
        """This step's memory is traced (profiled, verified, or not yet decided)."""
        return self._tracing.trace is not None

    def current_policy(self) -> Policy | None:
        """The policy of the plan the current (or last) step runs under; None: replay-only."""
        entry = self._step.active or self._last_active
        return entry.policy if entry is not None and entry.key in self.plans else None

    def close(self) -> None:
        """Remove the optimizer hook and stop any trace (``handle.remove()``)."""
        self._hook.remove()
        self._tracing.stop()

    def _log(self, level: int, msg: str, *args: Any) -> None:
        say(self.group, level, msg, *args)

    # Step boundaries ----------------------------------------------------------------------------

    def step(self) -> None:
        """An explicit step boundary (``handle.step()``): from now on, optimizer hooks are ignored."""
        self._manual_steps = True
        self._boundary()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._manual_steps and self._optimizers.owns(optimizer):
            self._boundary()

    def _boundary(self) -> None:
        # Every rank that reaches a boundary takes part in its all-reduce, forwards or not (a rank
        # skipping it would leave the others waiting); a boundary at which no rank ran a block
        # forward (a second optimizer of the same step) ends nothing.
        if not self._step.forwards and not tdist.active(self.group):
            return
        if self._end_step():
            self._begin_step()

    # The Controller of every block --------------------------------------------------------------

    def before_forward(self, state, args: tuple = (), kwargs: dict | None = None) -> int:
        """Choose ``state``'s policy for this forward; returns the recording's id."""
        if not self._started:
            self._started = True
            loaded = load_policy(self.config, len(self.handle.blocks))
            if loaded is not None:
                self.plans[loaded.key] = loaded
                self.loaded_policy = True
            if self.config.warmup_steps == 0:  # profile this very step, from its first block on
                self._tracing.start(TracePurpose.PROFILE, [a for a in (*args, *(kwargs or {}).values())
                                                         if isinstance(a, torch.Tensor)])
                self._start_profile()
        step = self._step
        step.forwards += 1
        if step.forwards == 10_000 and not self._warned_no_boundary and self.steps == 0:
            self._warned_no_boundary = True
            self._log(logging.WARNING, "TapeSAC planned mode: 10000 block forwards and no step boundary yet. Steps "
                      "end at optimizer.step() of an optimizer over the blocks' parameters, or "
                      "at handle.step(); call handle.step() once per step if you step otherwise")
        ik = input_key(args, kwargs or {})
        i = len(step.recordings)
        if i == 0:
            step.active = self.book.choose(self._last_key, state.index, ik)
            if self._tracing.purpose is TracePurpose.PENDING:
                self._resolve_trace(step.active, (state.index, ik))
        active = step.active
        entry = None
        if active is not None and not step.off_plan and self.phase is Phase.PLANNED:
            if i < len(active.recordings) and active.recordings[i] == (state.index, ik):
                if not self._awaits_retained(active):
                    entry = active.policy.blocks.get(state.index)
            else:
                self._leave_plan(step)
        if entry is None:
            state.use_policy(None)
        else:
            state.use_policy(entry, active.policy.predicted_peak_bytes, active.programs.get(state.index))
        rid = self._next_rid
        self._next_rid += 1
        step.recordings.append(_Recording(state.index, ik))
        if self._tracing.trace is not None:
            self._tracing.trace.forward_start(rid, state.index)
        return rid

    def _leave_plan(self, step: _StepState) -> None:
        """The step is not the one the plan was made for: run the rest replay-only, and release
        what earlier recordings kept (replay rebuilds it), so the step costs at most what the plan
        was made for plus replay-only. Pass-through recordings (plain autograd) keep theirs."""
        step.off_plan = True
        for ref in step.replayers:
            r = ref()
            if r is not None:
                r.release_kept()
        step.replayers = []

    def after_forward(self, state, rid: int, replayer) -> Callable[[int], None] | None:
        """The forward of recording ``rid`` ended (``replayer``: None for a forward that recorded
        nothing). Returns the replayer's unpack hook, if the step model needs one."""
        trace = self._tracing.trace
        if trace is not None:
            trace.forward_end(rid, state.index)
        on_unpack = None
        if replayer is not None:  # None: a pass-through block (plain autograd)
            if trace is not None:
                weakref.finalize(replayer, trace.released, rid)
            if trace is not None or not self._retains:  # after the first retained graph: traced steps say
                on_unpack = unpack_hook(rid, state.index, trace, weakref.WeakMethod(self._backwarded_twice))
        if self.phase is Phase.PROFILE and replayer is not None:
            self._step.tapes.append((state.index, state.last_tape))
        elif replayer is not None and self._step.active is not None and not self._step.off_plan:
            self._step.replayers.append(weakref.ref(replayer))
        return on_unpack

    def _backwarded_twice(self) -> None:
        """A recording was unpacked by a second graph task (``unpack_hook``)."""
        self._step.backwards_twice = True

    def policy_mismatch(self, state, what: str) -> bool:
        """A recording's tape does not fit its plan: it runs replay-only (the block drops what it
        would keep) and the step is marked; the plan is dropped on every rank at the step's end.

        ``state`` and ``what`` are not used: the decision is the step's, taken from a flag every
        rank agrees on at its end (``_Agreed.mismatch``), and logged once, by rank 0, for every
        rank; which block and why are this rank's own. They are the :class:`~tapesac.block.Controller`
        signature, whose callers (a fixed policy) need them for their error."""
        self._step.mismatch = True
        return True

    def _awaits_retained(self, entry: StepPlan) -> bool:
        """The run retains graphs, and ``entry``'s model has not seen a step that did (phase 4)."""
        return self._retains and not entry.retained

    # The end of a step --------------------------------------------------------------------------

    def _agree(self, key: str, failed: bool) -> _Agreed:
        """The step's facts every rank decides from: this rank's (the step's own flags, and
        compiled mode's, ``CompiledSteps.local_facts``) reduced with the others' by one
        all-reduce."""
        step = self._step
        broke, profiler, uncompiled = self.compiled.local_facts(step.active)
        mine = _Agreed(ran=step.forwards > 0, same=True, mismatch=step.mismatch, failed=failed,
                       off_plan=step.off_plan, twice=step.backwards_twice, broke=broke,
                       uncompiled=uncompiled, profiler=profiler)
        return mine.reduce(key, len(self.handle.blocks), self.group, self.device)

    def _end_step(self) -> bool:
        """Close the step on every rank alike; False when no rank ran a forward (nothing ended)."""
        step = self._step
        key = step_key(step.recordings)
        purpose = self._tracing.purpose
        profile_failure = profile_error(step) if purpose is TracePurpose.PROFILE else None
        agreed = self._agree(key, profile_failure is not None)
        same, mismatch, failed, off_plan, twice = (agreed.same, agreed.mismatch, agreed.failed,
                                                   agreed.off_plan, agreed.twice)
        if not agreed.ran:
            return False
        allocator_peak = self.compiled.step_ended(step.active if same else None, agreed)
        memory = self._tracing.finish()
        self.steps += 1
        self._last_key, self._last_same = key, same
        if step.recordings:
            self._starts[key] = (step.recordings[0].block, step.recordings[0].input_key)
        self._last_active = step.active if step.active is not None and step.active.key in self.plans else None
        active = step.active
        planned = active is not None and active.key == key and not off_plan
        self.compiled.note_unprofiled(
            purpose is TracePurpose.PROFILE,
            not planned and self.phase is not Phase.WARMUP and key not in self.plans
            and key not in self.book.unplannable)
        self.last_step_mode = step_mode(purpose, self.phase, planned, planned and not active.verified)
        if twice and not self._retains:
            self._first_retained(planned)
        if mismatch and active is not None and active.key in self.plans:
            self._log(logging.WARNING, "TapeSAC: a block's tape differs from the one its plan was made for (the "
                      "program or a saved policy changed); dropping the plan and profiling again")
            del self.plans[active.key]
            self.book.profile_failed(active.key, "the program changed under its plan")  # no endless re-profiling
            active = None
        if not same and (purpose is TracePurpose.PROFILE or self.steps >= self.config.warmup_steps):
            fail(self.config, PolicyError(
                f"TapeSAC: ranks ran different steps in step {self.steps} (the blocks' input shapes "
                "differ across ranks), so they cannot share one plan. Every rank must run the same "
                "shapes (sequence length, local batch size), or use replay-only mode"))
        this_plan = same and not off_plan and active is not None and active.key == key
        if purpose is TracePurpose.PROFILE:
            if failed:
                self.book.profile_failed(key, profile_failure or "another rank's profile failed")
            elif memory is not None and key not in self.plans:
                why = self.maker.plan_profiled(key, step, memory, self._tracing.orders)
                if why is not None:
                    self.book.profile_failed(key, why)
            self.phase = Phase.PLANNED
        elif (purpose is TracePurpose.VERIFY and (memory is not None or allocator_peak is not None) and this_plan
              and not active.verified):
            self._verify(active, memory.baseline_peak() if memory is not None else allocator_peak,
                         "trace" if memory is not None else "allocator events")
        elif (purpose is TracePurpose.RETAINED and twice and memory is not None and this_plan and key in self.plans
              and not active.retained):
            self.maker.add_retained(active, memory)
        return True

    def _verify(self, entry: StepPlan, measured: float, meter: str = "trace") -> None:
        """Check the first measured step under ``entry``'s plan (``PlanMaker.verify``)."""
        self.maker.verify(entry, measured, meter, self.steps)

    def _first_retained(self, planned: bool) -> None:
        """The run backwarded a recording twice for the first time (phase 4)."""
        self._retains = True
        self._log(logging.WARNING if planned else logging.INFO,
                  "TapeSAC: step %d backwarded a retained graph (retain_graph=True)%s; from now on each step "
                  "shape runs replay-only until such a step of it is traced, and is then planned for it",
                  self.steps, ", which its plan was not made for: its peak was not planned" if planned else "")
        for key, entry in list(self.plans.items()):
            if entry.graphs is None and not entry.retained:  # a loaded policy: no model to add to
                del self.plans[key]

    # The start of a step ------------------------------------------------------------------------

    def _begin_step(self) -> None:
        self._step = _StepState()
        if self.phase is Phase.WARMUP and self.steps >= self.config.warmup_steps:
            self.phase = Phase.PLANNED
        if self.phase is Phase.WARMUP:
            return
        # A trace must start here, before the step allocates anything; whether the step is
        # profiled, verified or neither is decided at its first block forward (_resolve_trace).
        last_key = self._last_key
        unplanned = (last_key is not None and last_key not in self.plans and last_key not in self.book.unplannable
                     and self._last_same)
        if unplanned and len(self.plans) >= self.config.max_plans:
            self.book.give_up(last_key, f"already {len(self.plans)} plans (max_plans)")
            unplanned = False
        awaiting = any(self._awaits_retained(e) for e in self.plans.values())
        # Compiled mode on CPU: a step of shapes without a plan that could not be profiled (an
        # allocator trace, or none, was running) wants the next trace to be one that can profile.
        wanted = self.compiled.profile_wanted and len(self.plans) < self.config.max_plans
        unverified = [e for e in self.plans.values() if not e.verified]
        if unplanned or awaiting or wanted or (self.config.verify and unverified):
            allocator = self.compiled.pending_meter(not unplanned and not awaiting and not wanted, unverified)
            if allocator is None:
                return
            self._tracing.start(TracePurpose.PENDING, allocator=allocator)

    def _resolve_trace(self, active: StepPlan | None, start: tuple[int, str]) -> None:
        """At a traced step's first block forward: profile it if no plan starts this way, or if it
        starts like the last step, which had no plan (steps repeat: more micro-batches than a plan
        has start like it); verify it if it starts under a plan not measured yet; else stop."""
        last = self._last_key
        repeats_unplanned = (last is not None and last not in self.plans and last not in self.book.unplannable
                             and self._starts.get(last) == start)
        given_up = {self._starts.get(k) for k in self.book.unplannable}
        allocator = self.compiled.allocator is not None
        if (repeats_unplanned or active is None) and start not in given_up and len(self.plans) < self.config.max_plans:
            purpose = TracePurpose.PROFILE
        elif active is not None and self._awaits_retained(active):
            purpose = TracePurpose.RETAINED
        elif (active is not None and self.config.verify and not active.verified
              and not self.compiled.verifies_later(self._tracing.trace is not None)):
            purpose = TracePurpose.VERIFY
        else:
            purpose = None
        if purpose is TracePurpose.VERIFY and allocator and not self.compiled.compiled_already(active):
            purpose = None  # this step compiles the plan: not under the profiler (see pending_meter)
        if purpose is None or (allocator and purpose is not TracePurpose.VERIFY):
            # An allocator trace cannot profile (no windows): the next step, which starts the
            # same way after an unplanned one, is profiled under the storage counter.
            self._tracing.stop()
            return
        self._tracing.purpose = purpose
        if purpose is TracePurpose.PROFILE:
            self._start_profile()

    def _start_profile(self) -> None:
        self._log(logging.INFO, "TapeSAC: profiling step %d: every op timed %d times and memory traced "
                  "(this step runs slower); the plan follows at its end", self.steps + 1, self.config.repeats)
        self.phase = Phase.PROFILE
        timer = OpTimer(self.config.repeats, self.device.type)
        for s in self.handle.blocks:
            s.time_ops(timer)
