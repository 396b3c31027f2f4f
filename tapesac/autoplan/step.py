"""Step boundaries and what one step has seen: the optimizer hook, the phases, the step key and
its plan (:class:`StepPlan`, the plan cache's entry).

A *step* is one optimizer step: it ends when an optimizer that owns parameters of the wrapped
blocks finishes ``step()`` (a global optimizer post-hook, removed with the handle), or when the
user calls ``handle.step()`` (after which optimizer hooks are ignored).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from ..planner import Plan
from ..planner.graph import BlockGraph
from ..policy import Policy
from ..stepmodel import StepMemory


class Phase(str, enum.Enum):
    WARMUP = "warmup"
    PROFILE = "profile"
    """This step is being profiled."""
    PLANNED = "planned"
    """Steps run under the plan of their key (or replay-only until it is made)."""


class TracePurpose(enum.Enum):
    """Why the current step's memory is traced."""

    PENDING = "pending"
    """From a boundary until the step's first block forward decides (the trace must start
    before the step allocates anything)."""
    PROFILE = "profile"
    """Every op timed and the memory traced: the step is planned at its end."""
    VERIFY = "verify"
    """The first step under a plan not measured yet: its peak is checked against the limit."""
    RETAINED = "retained"
    """A replay-only step of a key whose model has not seen a retained graph yet (phase 4)."""


@dataclasses.dataclass
class StepPlan:
    """The plan of one step key, and what it was made from (None for a loaded policy)."""

    key: str
    recordings: list[tuple[int, str]]
    """(block, input signature) of every recording of the profiled step, in order: a step runs
    under this plan only while its recordings follow this list."""
    policy: Policy
    programs: dict[int, int] = dataclasses.field(default_factory=dict)
    """Per block, ``Tape.program_hash`` of its profiled program (pass-through blocks check it every
    forward instead of recording); empty for a loaded policy (its first forwards record)."""
    plan: Plan | None = None
    graphs: dict[int, BlockGraph] | None = None
    memory: StepMemory | None = None
    limit_bytes: float = 0.0
    """The limit this plan was solved for (tighter than the user's after an overshoot)."""
    replans: int = 0
    raises: int = 0
    """Compiled mode: re-plans for a limit raised by measured slack (at most ``max_replans``)."""
    within: tuple[Plan, float] | None = None
    """Compiled mode: the last plan measured within the user's limit, and the limit it was solved for."""
    over: float | None = None
    """Compiled mode: the lowest limit a raised plan was solved for and then measured over the
    user's limit at; later raises stay below it (a bisection between ``within`` and it)."""
    verified: bool = False
    retained: bool = False
    """The memory model includes a traced step that backwarded a recording twice (retain_graph)."""

    def run_replay_only(self) -> None:
        """From the next step on, keep nothing (the smallest step peak there is) until measured:
        the fallback when no plan fits, itself checked against the limit before it is trusted."""
        self.policy = Policy.replay_only({b: p.signature for b, p in self.policy.blocks.items()})
        self.plan, self.verified = None, False


def step_mode(purpose: TracePurpose | None, phase: Phase, planned: bool, first_measured: bool) -> str:
    """How a step ran, in words (``AutoPlanner.last_step_mode``): ``planned``: under the plan of
    its key throughout; ``first_measured``: and that plan was not verified yet."""
    return ("profiled" if purpose is TracePurpose.PROFILE else "warm-up" if phase is Phase.WARMUP
            else "verified" if purpose is TracePurpose.VERIFY and first_measured
            else "replay-only (no plan for a retained graph yet)" if purpose is TracePurpose.RETAINED
            else "planned" if planned else "replay-only (no plan for these shapes yet)")


@dataclasses.dataclass
class _Recording:
    block: int
    input_key: str


@dataclasses.dataclass
class _StepState:
    """What the current step has seen so far (reset at every boundary)."""

    recordings: list[_Recording] = dataclasses.field(default_factory=list)
    tapes: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    """(block, tape) of every recording of a profiling step."""
    active: StepPlan | None = None
    """The plan chosen at the step's first recording."""
    off_plan: bool = False
    """The step left the active plan's recordings (other shapes, more micro-batches): from then on
    it runs replay-only, and what its earlier recordings kept was released."""
    replayers: list[weakref.ref] = dataclasses.field(default_factory=list)
    """This step's recordings under the plan (released when the step leaves it)."""
    mismatch: bool = False
    """A recording's tape did not match the active plan's signature."""
    backwards_twice: bool = False
    """A recording was unpacked by two graph tasks (a retained graph's second backward)."""
    forwards: int = 0
    """Block forwards of the step on this rank."""


def input_key(args: tuple, kwargs: dict) -> str:
    """What a block's forward was called with, without values: shapes, dtypes, grad flags.

    Device indices and values are left out, so ranks that run the same shapes agree."""
    parts: list[str] = []

    def enc(a: Any) -> None:
        if isinstance(a, torch.Tensor):
            parts.append(f"{tuple(a.shape)}{str(a.dtype)[6:]}{'g' if a.requires_grad else ''}")
        elif isinstance(a, (list, tuple)):
            parts.append("[")
            for x in a:
                enc(x)
            parts.append("]")
        elif a is None or isinstance(a, bool):
            parts.append(repr(a))
        else:
            parts.append(type(a).__name__)

    for a in args:
        enc(a)
    for k in sorted(kwargs):
        parts.append(k + "=")
        enc(kwargs[k])
    return ",".join(parts)


def step_key(recordings: Iterable[_Recording]) -> str:
    """The identity of a step's program: which blocks ran how often, on which input shapes."""
    h = hashlib.sha256()
    for b, ik in sorted((r.block, r.input_key) for r in recordings):
        h.update(f"{b}:{ik}\n".encode())
    return h.hexdigest()[:16]


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
            for group in t.param_groups:
                for p in group["params"]:
                    yield _local(p)
                    if p.grad is not None:
                        yield _local(p.grad)
            for state in t.state.values():
                yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(t, torch.Tensor):
            yield _local(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank holds of a DTensor (FSDP2 parameters), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t



class Optimizers:
    """The optimizers whose ``step()`` ends a step: those that step parameters of the wrapped
    blocks (decided at each optimizer's first step, and remembered weakly)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """Optimizer -> whether it steps parameters of the wrapped blocks."""
        self._stepping: list[weakref.ref] = []
        """The optimizers that do, in the order they first stepped."""

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        owns = self._owns.get(optimizer)
        if owns is None:
            mine = {id(p) for s in self._handle.blocks for p in s.module.parameters()}
            owns = any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
            self._owns[optimizer] = owns
            if owns:
                self._stepping.append(weakref.ref(optimizer))
        return owns

    def alive(self) -> list[torch.optim.Optimizer]:
        """The stepping optimizers still alive (their state counts toward the peak on CPU)."""
        return [o for o in (r() for r in self._stepping) if o is not None]


def optimizer_hook(owner: Any) -> RemovableHandle:
    """A process-wide optimizer post-hook that calls ``owner.after_optimizer_step``. It holds
    ``owner`` weakly, and goes with it (or with the handle's ``remove()``)."""
    ref = weakref.ref(owner)

    def after_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        p = ref()
        if p is not None:
            p.after_optimizer_step(optimizer)

    hook = register_optimizer_step_post_hook(after_optimizer_step)
    weakref.finalize(owner, hook.remove)
    return hook
