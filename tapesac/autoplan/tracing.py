"""The memory trace of one step, and why it is taken (:class:`~tapesac.autoplan.step.TracePurpose`).

A trace starts at a step boundary, before the step allocates anything, and is cut into windows
by the recordings' events (``tapesac.stepmodel``); in compiled mode on CPU a verify step is
measured by the allocator meter instead (``compiled_steps``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from ..meter import meter_for
from ..stepmodel import StepMemory, StepTrace
from .compiled_steps import CompiledSteps
from .config import PlanConfig
from .step import Optimizers, TracePurpose, _tensors_of


class Tracing:
    """The current step's trace: started at a boundary, its purpose settled at the step's first
    block forward, finished (or stopped) at the step's end."""

    def __init__(self, handle: Any, config: PlanConfig, device: torch.device, compiled: CompiledSteps,
                 optimizers: Optimizers) -> None:
        self.handle = handle
        self.config = config
        self.device = device
        self.compiled = compiled
        self.optimizers = optimizers
        self.trace: StepTrace | None = None
        """The current step's memory trace (windows), while it is traced."""
        self.purpose: TracePurpose | None = None
        """Why the current step is traced (also while the allocator meter measures it); None: not."""
        self.orders: dict[int, list[int]] = {}
        """Per block, the unpack order of the last traced step."""

    def start(self, purpose: TracePurpose, inputs: Iterable[torch.Tensor] = (), allocator: bool = False) -> None:
        """Trace the step from here: a :class:`StepTrace` (windows, for profiling), or with
        ``allocator`` only its peak, from the CPU allocator's events (a compiled verify step)."""
        track: list[torch.Tensor] = []
        if self.device.type != "cuda":
            track = list(_tensors_of([s.module for s in self.handle.blocks])) + list(_tensors_of(list(inputs)))
            track += list(_tensors_of(self.config.track))
            track += list(_tensors_of(self.optimizers.alive()))
        self.purpose = purpose
        if allocator:
            self.compiled.start_allocator(track)
            return
        self.trace = StepTrace(meter_for(self.device, track))
        self.trace.start()

    def finish(self) -> StepMemory | None:
        """The step's memory model, if it was traced with windows; the trace ends."""
        trace, self.trace = self.trace, None
        self.purpose = None
        if trace is None:
            return None
        self.orders = trace.unpack_orders()
        for s in self.handle.blocks:
            s.time_ops(None)
        return trace.finish()

    def stop(self) -> None:
        """End any trace and meter without a model (the step is not measured after all)."""
        if self.trace is not None:
            self.trace.abort()
        self.compiled.abort()
        self.trace = None
        self.purpose = None
        for s in self.handle.blocks:
            s.time_ops(None)


def unpack_hook(rid: int, block: int, trace: StepTrace | None,
                twice: weakref.WeakMethod) -> Callable[[int], None]:
    """What recording ``rid`` of ``block`` calls at each unpack: notices a second graph task (a
    retained graph's second backward, or double backward: ``twice``, held weakly) and feeds
    ``trace``."""
    first_task: list[int] = []

    def on_unpack(vid: int) -> None:
        task = torch._C._current_graph_task_id()
        if not first_task:
            first_task.append(task)
        elif task != first_task[0]:
            noted = twice()
            if noted is not None:
                noted()
        if trace is not None:
            trace.unpack(rid, block, vid)
    return on_unpack
