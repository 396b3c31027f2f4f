"""Compiled mode's measuring and raising, as the state of one planner.

In compiled mode the measured step is a compiled step, the second under the plan (the first
compiles it, on CPU unmeasured: compiling under the profiler crashed the process), measured by
allocator statistics on CUDA and by the CPU allocator's events on CPU (``AllocatorStepMeter``,
no dispatch mode, so the step runs compiled). Whether a step compiles nothing on any rank is
read from what every rank agreed at the last step's end, never from this rank's own code: a
compile that fell back on one rank only must not make one rank measure a step (a collective)
and another not.

With ``compiled_raise_into_slack`` (off by default: it may exceed the limit once per raise), a
step measured more than ``2 * RAISE_HEADROOM`` of the limit under it re-plans for the limit
raised by that slack less ``RAISE_HEADROOM`` (the plan's eager memory model counts transients
fused kernels never make): at most ``max_replans`` raises; a raised plan measured over the limit
goes back to the last plan measured within it, and the next raise, if any, is solved halfway
between the two planned limits (a bisection). The user's limit is never relaxed: every plan a
step keeps running under was measured within it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from ..compiled import CompiledRunner
from ..meter import AllocatorStepMeter
from ..planner import Plan
from ..report import fmt_bytes
from .config import PlanConfig
from .ranks import _Agreed, say
from .step import StepPlan


class PlanMaker(Protocol):
    """What raising into slack asks of the plan maker (:class:`~tapesac.autoplan.plans.PlanMaker`)."""

    def solve(self, entry: StepPlan, limit: float, first: bool) -> None: ...

    def adopt(self, entry: StepPlan, plan: Plan, limit: float) -> None: ...

RAISE_HEADROOM = 0.03
"""Compiled mode: a verified step measured more than twice this fraction of the limit under it
re-plans for the limit raised by the slack less this headroom (room for measured steps of one
plan to differ); less slack than that is too small a change to pay another compile for."""
RAISE_MARGIN = 0.005
"""Compiled mode: a raised plan is kept only if its measured step peaked at least this fraction
of the limit under it. Measured steps of one compiled plan differ by kernel temporaries (tens of
KiB on CPU: a raised plan measured 37 KiB under an 81 MiB limit peaked 11 KiB over it in the
bench's own measurement), and a raise is a choice to spend measured slack, not a need."""


class CompiledSteps:
    """What compiled mode adds to planned mode: which plans have compiled code on every rank,
    the allocator meter of a compiled verify step, and raising plans into measured slack. Its
    answers are the eager ones when no block runs compiled."""

    def __init__(self, handle: Any, config: PlanConfig, device: torch.device) -> None:
        self.handle = handle
        self.config = config
        self.device = device
        self.allocator: AllocatorStepMeter | None = None
        """On CPU: measures a verify step instead of the planner's trace (no dispatch mode, so
        the step runs compiled)."""
        self.profile_wanted = False
        """On CPU: a step without a plan ran unprofiled (see :meth:`pending_meter`)."""
        self._everywhere: set[tuple[int, Any]] = set()
        """(block, ``CompiledRunner.policy_key``) pairs for which every rank had compiled code at
        the end of the last step under a plan that ran the block so, agreed at the step's end (see
        :meth:`_note_compiled`). A plan whose pairs are all here compiles nothing on any rank."""
        self._breaks_seen = 0
        """This rank's policies broken by the end of the last step."""
        self.allocator_everywhere = True
        """On CPU: no rank ran another profiler at the last step's end, so every rank can measure
        a compiled step with the allocator meter (agreed at the step's end; a profiler on some
        ranks only must not make ranks measure differently, or at different steps)."""

    @property
    def active(self) -> bool:
        """Some block runs compiled under its plan (``tapesac.wrap(..., compile=True)``)."""
        return any(s.compiled is not None for s in self.handle.blocks)

    @property
    def on_cpu(self) -> bool:
        """Compiled mode on CPU, where the storage counter (a dispatch mode) would run compiled
        blocks eagerly: a compiled step is measured by the allocator meter instead."""
        return self.device.type != "cuda" and self.active

    # The step's end, agreed on every rank --------------------------------------------------------

    def local_facts(self, active: "StepPlan | None") -> tuple[bool, bool, frozenset[int]]:
        """This rank's share of the step's agreed facts: whether a policy broke here since the last
        step's end, whether another profiler keeps the allocator meter out here, and the blocks
        of ``active``'s plan that lack compiled code for it here."""
        runner = self.handle.blocks[0].compiled if self.handle.blocks else None
        broken = len(runner.broken) if runner is not None else 0
        broke, self._breaks_seen = broken > self._breaks_seen, broken
        uncompiled = frozenset()
        if runner is not None and active is not None:
            uncompiled = frozenset(b for b, p in active.policy.blocks.items() if not runner.has_compiled(b, p))
        # The allocator meter is a profiler itself: while it runs (this step's own measure, which
        # ends after this), another cannot start.
        profiler = self.allocator is None and not AllocatorStepMeter.available()
        return broke, profiler, uncompiled

    def step_ended(self, active: "StepPlan | None", agreed: _Agreed) -> float | None:
        """At every step's end, from agreed facts: keep what every rank has compiled (``active``:
        the plan every rank ran, None: none); returns the allocator meter's peak, if it ran."""
        self.allocator_everywhere = not agreed.profiler
        if self.active:
            self._note_compiled(active, agreed)
        if self.allocator is not None:
            self.allocator.stop()
        peak = self.allocator.peak() if self.allocator is not None else None
        self.allocator = None
        return peak

    def _note_compiled(self, active: "StepPlan | None", agreed: _Agreed) -> None:
        """Compiled mode: keep ``_everywhere`` as every rank's compiled code stands at the
        end of a step run under ``active`` (None: under no plan every rank shares), from agreed
        flags only, so it is the same set on every rank. Compiled code is made and broken only
        by block forwards under the step's plan: a pair of its blocks is added when every rank
        has code for it, and dropped when some rank does not. A policy that broke on some rank
        (full AC from now on, compiled at its next forward there) leaves every block that runs
        it in doubt: each pair of one of the plan's policies is dropped, whatever block, and the
        plan's own blocks are added back where every rank has their code."""
        if agreed.broke:
            keys = None if active is None else {CompiledRunner.policy_key(p) for p in active.policy.blocks.values()}
            self._everywhere = {(b, k) for b, k in self._everywhere if keys is not None and k not in keys}
        if active is None:
            return
        for b, p in active.policy.blocks.items():
            pair = (b, CompiledRunner.policy_key(p))
            if b in agreed.uncompiled:
                self._everywhere.discard(pair)
            else:
                self._everywhere.add(pair)

    def compiled_already(self, entry: "StepPlan") -> bool:
        """Every block of ``entry``'s plan has compiled code for it on every rank (compiled mode):
        a step under it compiles nothing anywhere. Read from what the ranks agreed at the last
        step's end, never from this rank's own code (see the module doc)."""
        return self.active and all((b, CompiledRunner.policy_key(p)) in self._everywhere
                                   for b, p in entry.policy.blocks.items())

    # Measuring -----------------------------------------------------------------------------------

    def note_unprofiled(self, profiled: bool, unplanned: bool) -> None:
        """A step ended: profiled, or ``unplanned`` (its key had no plan and was not given up)."""
        if profiled:
            self.profile_wanted = False
        elif unplanned and self.on_cpu:
            self.profile_wanted = True

    def pending_meter(self, only_verify: bool, unverified: list["StepPlan"]) -> bool | None:
        """How a step whose trace starts at its boundary is measured, when all it can become is
        ``only_verify`` (a verify of one of the ``unverified`` plans): True: the allocator meter,
        under which it runs compiled (the storage counter would make it run eagerly); False: the
        planner's trace; None: not at all (the first step under a new plan compiles it,
        unmeasured: compiling under the profiler crashed the process, torch 2.13, CPU; a step
        after it is measured)."""
        if not (only_verify and self.on_cpu):
            return False
        if not any(self.compiled_already(e) for e in unverified):
            return None
        return self.allocator_everywhere

    def verifies_later(self, tracing: bool) -> bool:
        """Whether a step traced by the storage counter (``tracing``) must not verify: it would
        measure the plan run eagerly, not compiled; a later step under the plan is measured with
        the allocator instead."""
        return tracing and self.on_cpu and self.allocator_everywhere

    def start_allocator(self, track: list[torch.Tensor]) -> None:
        self.allocator = AllocatorStepMeter(track)
        self.allocator.start()

    def abort(self) -> None:
        if self.allocator is not None:
            self.allocator.stop()
        self.allocator = None

    # Raising into measured slack -----------------------------------------------------------------

    def margin(self, entry: "StepPlan") -> float:
        """The fraction of the limit a measured step of ``entry`` must stay under: ``RAISE_MARGIN``
        for a plan raised into slack, else none."""
        raised = entry.within is not None and entry.plan is not entry.within[0]
        return RAISE_MARGIN if raised else 0

    def measured_within(self, entry: "StepPlan", measured: float, limit: float, maker: "PlanMaker") -> None:
        """A step under ``entry``'s plan measured ``measured``, within ``limit``."""
        if self.active and entry.plan is not None and self.config.compiled_raise_into_slack:
            self._use_slack(entry, measured, limit, maker)

    def measured_over(self, entry: "StepPlan", measured: float, predicted: float | None, limit: float,
                      maker: "PlanMaker") -> bool:
        """A step under ``entry``'s plan measured ``measured``, over ``limit``: if the plan was
        raised into slack, go back to the last plan measured within and bisect (True); else
        False (the planner re-plans tighter)."""
        if entry.within is None:
            return False
        plan, planned = entry.within
        # Below the plan's own predicted peak, no solve picks that plan again.
        over = min(entry.limit_bytes, predicted if predicted is not None else entry.limit_bytes)
        entry.over = over if entry.over is None else min(entry.over, over)
        say(self.config.process_group, logging.WARNING, "TapeSAC: the plan raised into measured slack peaks at %s, "
            "over the limit less a %.1f%% margin; back to the last plan measured within it (planned for %s)",
            fmt_bytes(measured), RAISE_MARGIN * 100, fmt_bytes(planned))
        maker.adopt(entry, plan, planned)
        self._raise(entry, (planned + entry.over) / 2, limit, maker)
        return True

    def _use_slack(self, entry: "StepPlan", measured: float, limit: float, maker: "PlanMaker") -> None:
        """Compiled mode, a step measured within the limit: remember its plan, and if it left more
        than ``2 * RAISE_HEADROOM`` of the limit unused, re-plan for the planned limit raised by the
        slack less the headroom, or halfway to the lowest planned limit measured over (verified
        again once compiled)."""
        entry.within = (entry.plan, entry.limit_bytes)
        slack = limit - measured
        if slack <= 2 * RAISE_HEADROOM * limit:
            return
        raised = entry.limit_bytes + slack - RAISE_HEADROOM * limit
        if entry.over is not None:
            raised = min(raised, (entry.limit_bytes + entry.over) / 2)
        self._raise(entry, raised, limit, maker)

    def _raise(self, entry: "StepPlan", raised: float, limit: float, maker: "PlanMaker") -> None:
        """Re-plan ``entry`` (now under its ``within`` plan) for the planned limit ``raised``, if
        that is worth a compile: at most ``max_replans`` raises, each at least ``RAISE_HEADROOM``
        of the limit above the plan measured within, and a plan that differs from it."""
        planned = entry.within[1]
        if entry.graphs is None or entry.raises >= self.config.max_replans or raised - planned < RAISE_HEADROOM * limit:
            entry.verified = True
            return
        entry.raises += 1
        before = {b: (sorted(p.keep), p.passthrough) for b, p in entry.policy.blocks.items()}
        say(self.config.process_group, logging.INFO, "TapeSAC: the compiled step left room under the limit; "
            "re-planning for %s (measured within at %s%s)", fmt_bytes(raised), fmt_bytes(planned),
            f", over at {fmt_bytes(entry.over)}" if entry.over is not None else "")
        maker.solve(entry, raised, first=False)
        if entry.plan is None:  # cannot happen for a higher limit; keep the measured plan then
            maker.adopt(entry, *entry.within)
            entry.verified = True
        elif {b: (sorted(p.keep), p.passthrough) for b, p in entry.policy.blocks.items()} == before:
            maker.adopt(entry, *entry.within)  # the same plan: nothing new to measure
            entry.verified = True
            entry.raises = self.config.max_replans
