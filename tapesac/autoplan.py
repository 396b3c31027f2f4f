"""Planned mode: profile real steps, plan under a memory limit, apply the plan, check it.

A *step* is one optimizer step: it ends when an optimizer that owns parameters of the wrapped
blocks finishes ``step()`` (a global optimizer post-hook, removed with the handle), or when the
user calls ``handle.step()`` (after which optimizer hooks are ignored). Everything between two
step boundaries belongs to the step: any number of micro-batches, forwards first or interleaved,
blocks applied twice, a retained graph's second backward (see ``tapesac.stepmodel``).

Phases (:class:`Phase`), the same on every rank:

1. ``warmup``: ``warmup_steps`` steps replay-only (the first optimizer step allocates its state);
2. then each step runs under the plan made for its *step key* (the blocks recorded, in order,
   and their input shapes), or replay-only when there is none. The plan is chosen at the step's
   first block forward and followed only while the step's forwards match the profiled step's;
   a step that departs runs the rest replay-only and releases what it kept. A step whose key has
   no plan makes the next step a *profiling* step (every op timed, memory traced); at its end
   rank 0 plans for that key and broadcasts the plan. A small cache keeps a plan per key (a few
   sequence lengths).
3. The first step under a new plan is measured (*verify*): over the limit means re-plan tighter
   (at most ``max_replans`` times, then replay-only for that key with a warning). In compiled
   mode the measured step is a compiled step, the second under the plan (the first compiles it,
   on CPU unmeasured: compiling under the profiler crashed the process) (allocator statistics on CUDA, the CPU
   allocator's events on CPU: ``AllocatorStepMeter``). With ``compiled_raise_into_slack`` (off by
   default: it may exceed the limit once per raise), a step measured more than
   ``2 * RAISE_HEADROOM`` of the limit under it re-plans for the limit raised by that slack less ``RAISE_HEADROOM`` (the plan's
   eager memory model counts transients fused kernels never make): at most ``max_replans``
   raises; a raised plan measured over the limit goes back to the last plan measured within it,
   and the next raise, if any, is solved halfway between the two planned limits (a bisection).
   The user's limit is never relaxed: every plan a step keeps running under was measured within
   it.
4. Once a step of the run has backwarded a recording twice (a graph retained for a second
   backward), every plan must also be made from a traced step that did so: the step key names
   the forwards only, and a trace of a step that freed its graph as it went shows less than one
   that retained it (``tapesac.stepmodel``). Until a key has such a trace its steps run
   replay-only, traced, and the first that retains is added to the key's model
   (``StepMemory.union``) and the key re-planned and verified.

Rules that keep ranks in agreement: every decision that leads to a collective is taken from
data every rank has (step counts, broadcast plans) or agreed at the step's end by one small
all-reduce (the step key's hash and flags; in compiled mode also which blocks lack compiled code
for the step's plan on some rank, since a compile can fall back on one rank only, and whether a
profiler of the user's runs on some rank, which keeps the allocator meter out there); a saved
policy is read by rank 0 and broadcast.
A recording whose tape does not match its plan drops what it would keep (replay-only memory)
and marks the step (pass-through blocks check the ops they ran instead); the plan is then
dropped on every rank and the key is profiled again, twice at most.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import distributed as tdist
from .artifacts import save_plan
from .errors import ConfigError, PlanError, PolicyError, TapeSACError
from .compiled import CompiledRunner
from .meter import AllocatorStepMeter, meter_for
from .planner import Plan, make_plan
from .planner.compiled_cost import compiled_costs
from .planner.graph import BlockGraph
from .policy import Policy
from .profile import OpTimer, block_graph, calibrate_overheads, merge_profiles
from .report import block_ranges, fmt_bytes
from .stepmodel import StepMemory, StepTrace

log = logging.getLogger("tapesac")

RAISE_HEADROOM = 0.03
"""Compiled mode: a verified step measured more than twice this fraction of the limit under it
re-plans for the limit raised by the slack less this headroom (room for measured steps of one
plan to differ); less slack than that is too small a change to pay another compile for."""
RAISE_MARGIN = 0.005
"""Compiled mode: a raised plan is kept only if its measured step peaked at least this fraction
of the limit under it. Measured steps of one compiled plan differ by kernel temporaries (tens of
KiB on CPU: a raised plan measured 37 KiB under an 81 MiB limit peaked 11 KiB over it in the
bench's own measurement), and a raise is a choice to spend measured slack, not a need."""


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
    """Replay-only optimizer steps before the first profile (the first one allocates optimizer
    state once)."""
    profile_steps: int = 1
    """Accepted for compatibility and must be 1 or more; one step is profiled per step shape
    (its ops timed ``repeats`` times each)."""
    repeats: int = 3
    """Runs per op when timing (median)."""
    timing_reduction: str = "max"
    """How per-op times are combined across ranks: max, mean or median."""
    solver_time_limit_s: float = 0.15
    """Time limit of the allocation MILP that polishes the greedy plan (0: greedy only)."""
    points_per_block: int = 12
    """Points of each kind's frontier the allocation chooses from."""
    frontier_points: int = 24
    """Points of the step frontier written for people (0: none)."""
    verify: bool = True
    """Measure the first step under each plan and re-plan tighter if it exceeds the limit."""
    compiled_raise_into_slack: bool = False
    """Compiled mode: a measured step well under the limit re-plans for the limit raised by that
    slack (compiled code peaks below the eager memory model), bisecting between the highest
    planned limit measured within and the lowest measured over, at most ``max_replans`` raises.
    Off by default: each raised plan's steps may exceed the limit once (its first, compiling
    step is not measured on CPU; its measured step may overshoot) before the run goes back to
    the last plan measured within it."""
    max_replans: int = 3
    """Re-plans per step key after measured overshoots, before falling back to replay-only."""
    max_plans: int = 8
    """Step keys (input shapes) planned at most; steps of further keys run replay-only."""
    max_profile_failures: int = 2
    """Failed profiles of one step key before it runs replay-only for good (with a warning)."""
    policy_path: str | None = None
    """Load the policy from here when it matches (skips profiling); save it here after planning."""
    frontier_path: str | None = None
    """Write the step frontier here as JSON (and as PNG next to it when matplotlib is present)."""
    graph_dir: str | None = None
    """Write each kind of block's measured graph here (``tools/frontier.py --graph`` reads them)."""
    device: torch.device | None = None
    """Device whose memory is measured (default: that of the first block's parameters)."""
    track: Any = None
    """CPU only: what besides the blocks and the stepping optimizers counts toward the peak
    (modules, tensors, optimizers, or a callable returning them). On CUDA the allocator's own
    statistics count everything."""
    process_group: Any = None
    fatal: Callable[[TapeSACError], Any] | None = None
    """Called with an error that ends planned mode (an infeasible limit, ranks that disagree)
    before it is raised; torchtitan prints it once and ends the job there."""
    policy_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Facts stored in the saved policy and checked when loading it (world size, model): a
    policy made under other facts is ignored with a warning, and the run re-plans."""

    def __post_init__(self) -> None:
        limit = self.memory_limit_bytes
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
            raise ConfigError(f"memory_limit_bytes must be a positive number of bytes, got {limit!r}")
        self.memory_limit_bytes = int(limit)
        check_settings(self)


def check_settings(settings: Any, names: dict[str, str] | None = None) -> None:
    """Validate the fields planned mode shares with its front ends (the torchtitan ``[tapesac]``
    section calls this too, with its own field names in ``names``); raise ConfigError."""
    names = names or {}

    def get(field: str) -> Any:
        return getattr(settings, names.get(field, field).rsplit(".", 1)[-1])

    def fail(field: str, rule: str) -> None:
        raise ConfigError(f"{names.get(field, field)} must be {rule}, got {get(field)!r}")

    def integer(field: str, low: int) -> None:
        v = get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < low:
            fail(field, f"an integer >= {low}")

    margin = get("safety_margin")
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        fail("safety_margin", "in [0, 1)")
    integer("warmup_steps", 0)
    integer("profile_steps", 1)
    integer("repeats", 1)
    for field, low in (("max_replans", 0), ("max_plans", 1), ("max_profile_failures", 1),
                       ("points_per_block", 2), ("frontier_points", 0)):
        if names.get(field, field).rsplit(".", 1)[-1] in getattr(settings, "__dataclass_fields__", {}):
            integer(field, low)
    solver = get("solver_time_limit_s")
    if not isinstance(solver, (int, float)) or not solver >= 0:
        fail("solver_time_limit_s", ">= 0")
    if get("timing_reduction") not in tdist.REDUCTIONS:
        fail("timing_reduction", "one of " + ", ".join(sorted(tdist.REDUCTIONS)))


class Phase(str, enum.Enum):
    WARMUP = "warmup"
    PROFILE = "profile"
    """This step is being profiled."""
    PLANNED = "planned"
    """Steps run under the plan of their key (or replay-only until it is made)."""


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


@dataclasses.dataclass(frozen=True)
class _Agreed:
    """What every rank knows about the step that ended, from one all-reduce (``_agree``)."""

    ran: bool
    """Some rank ran a block forward."""
    same: bool
    """Every rank ran the same step key."""
    mismatch: bool
    """Some rank's tape did not match its plan."""
    failed: bool
    """Some rank's profile failed."""
    off_plan: bool
    """Some rank left its plan."""
    twice: bool
    """Some rank backwarded a recording twice."""
    broke: bool
    """Compiled mode: some rank's compiled policy fell back to full AC (``CompiledRunner.broken``)."""
    uncompiled: frozenset[int]
    """Compiled mode: blocks of the step's plan that lack compiled code for it on some rank."""
    profiler: bool
    """Another profiler than TapeSAC's allocator meter runs on some rank (the user's), so that
    meter cannot measure a step there."""


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


class AutoPlanner:
    """Drives planned mode for one :class:`~tapesac.api.TapeSACHandle` (see the module doc)."""

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
        self.plans: dict[str, StepPlan] = {}
        """Plans by step key, at most ``config.max_plans``."""
        self.plan: Plan | None = None
        """The most recently solved plan (None until one is made; a loaded policy is not one)."""
        self.history: list[dict[str, Any]] = []
        """One record per measured (verify) step: key, limit, predicted and measured peak."""
        self.loaded_policy = False
        self._unplannable: dict[str, str] = {}
        """Step keys that run replay-only for good, with the reason (warned once)."""
        self._profile_failures: dict[str, int] = {}
        self._step = _StepState()
        self._trace: StepTrace | None = None
        self._allocator: AllocatorStepMeter | None = None
        """Compiled mode on CPU: measures a verify step instead of ``_trace`` (no dispatch mode, so
        the step runs compiled)."""
        self._trace_purpose: str | None = None
        """"profile" or "verify" while a step is traced; "pending" from a boundary until the
        step's first block forward decides."""
        self._next_rid = 0
        self._started = False
        self._manual_steps = False
        self._optimizers: list[weakref.ref] = []
        self._optimizer_owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """Optimizer -> whether it steps parameters of the wrapped blocks."""
        self._overheads: tuple[float, float] | None = None
        self._orders: dict[int, list[int]] = {}
        """Per block, the unpack order of the last traced step."""
        self._last_key: str | None = None
        """Step key of the step that ended last (the best guess for the next one)."""
        self._last_same = True
        """Whether every rank ran that key."""
        self._starts: dict[str, tuple[int, str]] = {}
        """Step key -> its first recording (block, input signature): how such a step begins."""
        self._last_active: StepPlan | None = None
        """The policy the last step ran under from start to end (None: it did not)."""
        self.last_step_mode = "warm-up"
        """How the last step ran, in words: warm-up, profiled, planned, verified, replay-only."""
        self._retains = False
        """Some step of this run backwarded a recording twice: plans must be made for it (phase 4)."""
        self._warned_no_boundary = False
        self._profile_wanted = False
        """Compiled mode on CPU: a step without a plan ran unprofiled (see _begin_step)."""
        self._compiled_everywhere: set[tuple[int, Any]] = set()
        """Compiled mode: (block, ``CompiledRunner.policy_key``) pairs for which every rank had
        compiled code at the end of the last step under a plan that ran the block so, agreed in
        ``_agree`` (see ``_note_compiled``). A plan whose pairs are all here compiles nothing on
        any rank."""
        self._breaks_seen = 0
        """Compiled mode: this rank's policies broken by the end of the last step."""
        self._allocator_everywhere = True
        """Compiled mode on CPU: no rank ran another profiler at the last step's end, so every rank
        can measure a compiled step with the allocator meter (agreed in ``_agree``; a profiler on
        some ranks only must not make ranks measure differently, or at different steps)."""
        for s in handle.blocks:
            s.controller = self
        # The hook is process-wide: it holds the planner weakly, and goes with it or remove().
        planner = weakref.ref(self)

        def after_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            p = planner()
            if p is not None:
                p._after_optimizer_step(optimizer)

        self._hook = register_optimizer_step_post_hook(after_optimizer_step)
        weakref.finalize(self, self._hook.remove)

    # Step boundaries ----------------------------------------------------------------------------

    def step(self) -> None:
        """An explicit step boundary (``handle.step()``): from now on, optimizer hooks are ignored."""
        self._manual_steps = True
        self._boundary()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._manual_steps:
            return
        owns = self._optimizer_owns.get(optimizer)
        if owns is None:
            mine = {id(p) for s in self.handle.blocks for p in s.module.parameters()}
            owns = any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
            self._optimizer_owns[optimizer] = owns
            if owns:
                self._optimizers.append(weakref.ref(optimizer))
        if owns:
            self._boundary()

    def _boundary(self) -> None:
        # Every rank that reaches a boundary takes part in its all-reduce, forwards or not (a rank
        # skipping it would leave the others waiting); a boundary at which no rank ran a block
        # forward (a second optimizer of the same step) ends nothing.
        if not self._step.forwards and not tdist.active(self.group):
            return
        if self._end_step():
            self._begin_step()

    def current_policy(self) -> Policy | None:
        """The policy of the plan the current (or last) step runs under; None: replay-only."""
        entry = self._step.active or self._last_active
        return entry.policy if entry is not None and entry.key in self.plans else None

    def close(self) -> None:
        """Remove the optimizer hook and stop any trace (``handle.remove()``)."""
        self._hook.remove()
        self._stop_trace()

    # Hooks called by BlockState -----------------------------------------------------------------

    def before_forward(self, state, args: tuple = (), kwargs: dict | None = None) -> None:
        if not self._started:
            self._started = True
            self._load_policy()
            if self.config.warmup_steps == 0:  # profile this very step, from its first block on
                self._start_trace("profile", [a for a in (*args, *(kwargs or {}).values())
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
            step.active = self._choose(state.index, ik)
            if self._trace_purpose == "pending":
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
        state.recording_id = rid
        step.recordings.append(_Recording(state.index, ik))
        if self._trace is not None:
            self._trace.forward_start(rid, state.index)

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

    def after_forward(self, state, replayer) -> None:
        rid = state.recording_id
        trace = self._trace
        if trace is not None:
            trace.forward_end(rid, state.index)
        if replayer is not None:  # None: a pass-through block (plain autograd)
            if trace is not None:
                weakref.finalize(replayer, trace.released, rid)
            if trace is not None or not self._retains:  # after the first retained graph: traced steps say
                replayer.on_unpack = self._unpack_hook(rid, state.index, trace)
        if self.phase is Phase.PROFILE and replayer is not None:
            self._step.tapes.append((state.index, state.last_tape))
        elif replayer is not None and self._step.active is not None and not self._step.off_plan:
            self._step.replayers.append(weakref.ref(replayer))

    def _unpack_hook(self, rid: int, block: int, trace: StepTrace | None) -> Callable[[int], None]:
        """Called at each unpack of one recording: notices a second graph task (a retained graph's
        second backward, or double backward) and feeds the trace. Holds the planner weakly."""
        planner = weakref.ref(self)
        first_task: list[int] = []

        def on_unpack(vid: int) -> None:
            task = torch._C._current_graph_task_id()
            if not first_task:
                first_task.append(task)
            elif task != first_task[0]:
                p = planner()
                if p is not None:
                    p._step.backwards_twice = True
            if trace is not None:
                trace.unpack(rid, block, vid)
        return on_unpack

    def _awaits_retained(self, entry: StepPlan) -> bool:
        """The run retains graphs, and ``entry``'s model has not seen a step that did (phase 4)."""
        return self._retains and not entry.retained

    @property
    def measuring(self) -> bool:
        """This step's memory is traced (profiled, verified, or not yet decided)."""
        return self._trace is not None

    def policy_mismatch(self, state, what: str) -> bool:
        """A recording's tape does not fit its plan: it runs replay-only (the block drops what it
        would keep) and the step is marked; the plan is dropped on every rank at the step's end."""
        self._step.mismatch = True
        return True

    def _log(self, level: int, msg: str, *args: Any) -> None:
        """Rank 0 speaks for every rank: decisions are the same everywhere (see the module doc)."""
        if tdist.rank(self.group) == 0:
            log.log(level, msg, *args)

    def _fail(self, error: TapeSACError):
        """End planned mode with ``error`` (the same on every rank)."""
        if self.config.fatal is not None:
            self.config.fatal(error)
        raise error

    # Choosing a plan ----------------------------------------------------------------------------

    def _choose(self, block: int, ik: str) -> StepPlan | None:
        """The plan for a step whose first recording is ``block`` on inputs ``ik``: the last
        step's if it starts so (steps repeat), else the newest that does."""
        last = self.plans.get(self._last_key) if self._last_key is not None else None
        candidates = ([last] if last is not None else []) + list(reversed(self.plans.values()))
        for entry in candidates:
            if entry.recordings and entry.recordings[0] == (block, ik):
                return entry
        return None

    # The end of a step --------------------------------------------------------------------------

    def _agree(self, key: str, failed: bool) -> _Agreed:
        """The step's facts every rank decides from, this rank's reduced with the others' by one
        all-reduce (a maximum over int flags; the key's hash both ways, to tell it is the same).
        Besides the step's own flags, compiled mode's: whether a policy broke on this rank, per
        block whether it lacks compiled code for the step's plan here (``_note_compiled``), and
        whether another profiler keeps the allocator meter out here."""
        step = self._step
        runner = self.handle.blocks[0].compiled if self.handle.blocks else None
        broken = len(runner.broken) if runner is not None else 0
        broke, self._breaks_seen = broken > self._breaks_seen, broken
        uncompiled = [0] * len(self.handle.blocks)  # one flag per block: every rank has them all
        if runner is not None and step.active is not None:
            for b, p in step.active.policy.blocks.items():
                uncompiled[b] = int(not runner.has_compiled(b, p))
        # The allocator meter is a profiler itself: while it runs (this step's own measure, which
        # ends after this), another cannot start.
        profiler = self._allocator is None and not AllocatorStepMeter.available()
        flags = [step.forwards > 0, step.mismatch, failed, step.off_plan, step.backwards_twice, broke, profiler,
                 *uncompiled]
        if tdist.active(self.group):
            import torch.distributed as dist

            h = int(key, 16) >> 2
            dev = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
            t = torch.tensor([h, -h, *[int(f) for f in flags]], dtype=torch.int64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            v = t.tolist()
            same, flags = v[0] == -v[1], v[2:]
        else:
            same = True
        ran, mismatch, failed, off_plan, twice, broke, profiler = map(bool, flags[:7])
        return _Agreed(ran=ran, same=same, mismatch=mismatch, failed=failed, off_plan=off_plan, twice=twice,
                       broke=broke, profiler=profiler,
                       uncompiled=frozenset(b for b, f in enumerate(flags[7:]) if f))

    def _end_step(self) -> bool:
        """Close the step on every rank alike; False when no rank ran a forward (nothing ended)."""
        step = self._step
        key = step_key(step.recordings)
        purpose = self._trace_purpose
        profile_error = self._check_profile(step) if purpose == "profile" else None
        agreed = self._agree(key, profile_error is not None)
        same, mismatch, failed, off_plan, twice = (agreed.same, agreed.mismatch, agreed.failed,
                                                   agreed.off_plan, agreed.twice)
        if not agreed.ran:
            return False
        self._allocator_everywhere = not agreed.profiler
        if self._compiled_mode():
            self._note_compiled(step.active if same else None, agreed)
        if self._allocator is not None:
            self._allocator.stop()
        allocator_peak = self._allocator.peak() if self._allocator is not None else None
        self._allocator = None
        memory = self._finish_trace()
        self.steps += 1
        self._last_key, self._last_same = key, same
        if step.recordings:
            self._starts[key] = (step.recordings[0].block, step.recordings[0].input_key)
        self._last_active = step.active if step.active is not None and step.active.key in self.plans else None
        active = step.active
        planned = active is not None and active.key == key and not off_plan
        if purpose == "profile":
            self._profile_wanted = False
        elif (not planned and self.phase is not Phase.WARMUP and key not in self.plans
              and key not in self._unplannable and self._compiled_mode() and self.device.type != "cuda"):
            self._profile_wanted = True
        self.last_step_mode = ("profiled" if purpose == "profile" else "warm-up" if self.phase is Phase.WARMUP
                               else "verified" if purpose == "verify" and planned and not active.verified
                               else "replay-only (no plan for a retained graph yet)" if purpose == "retained"
                               else "planned" if planned else "replay-only (no plan for these shapes yet)")
        if twice and not self._retains:
            self._first_retained(planned)
        if mismatch and active is not None and active.key in self.plans:
            self._log(logging.WARNING, "TapeSAC: a block's tape differs from the one its plan was made for (the "
                        "program or a saved policy changed); dropping the plan and profiling again")
            del self.plans[active.key]
            self._profile_failed(active.key, "the program changed under its plan")  # no endless re-profiling
            active = None
        if not same and (purpose == "profile" or self.steps >= self.config.warmup_steps):
            self._fail(PolicyError(
                f"TapeSAC: ranks ran different steps in step {self.steps} (the blocks' input shapes "
                "differ across ranks), so they cannot share one plan. Every rank must run the same "
                "shapes (sequence length, local batch size), or use replay-only mode"))
        if purpose == "profile":
            if failed:
                self._profile_failed(key, profile_error or "another rank's profile failed")
            elif memory is not None and key not in self.plans:
                self._plan_profiled(key, step, memory)
            self.phase = Phase.PLANNED
        elif (purpose == "verify" and (memory is not None or allocator_peak is not None) and same and not off_plan
              and active is not None and active.key == key and not active.verified):
            self._verify(active, memory.baseline_peak() if memory is not None else allocator_peak,
                         "trace" if memory is not None else "allocator events")
        elif (purpose == "retained" and twice and memory is not None and same and not off_plan
              and active is not None and active.key == key and key in self.plans and not active.retained):
            self._add_retained(active, memory)
        return True

    def _note_compiled(self, active: StepPlan | None, agreed: _Agreed) -> None:
        """Compiled mode: keep ``_compiled_everywhere`` as every rank's compiled code stands at the
        end of a step run under ``active`` (None: under no plan every rank shares), from agreed
        flags only, so it is the same set on every rank. Compiled code is made and broken only
        by block forwards under the step's plan: a pair of its blocks is added when every rank
        has code for it, and dropped when some rank does not. A policy that broke on some rank
        (full AC from now on, compiled at its next forward there) leaves every block that runs
        it in doubt: each pair of one of the plan's policies is dropped, whatever block, and the
        plan's own blocks are added back where every rank has their code."""
        if agreed.broke:
            keys = None if active is None else {CompiledRunner.policy_key(p) for p in active.policy.blocks.values()}
            self._compiled_everywhere = {(b, k) for b, k in self._compiled_everywhere
                                         if keys is not None and k not in keys}
        if active is None:
            return
        for b, p in active.policy.blocks.items():
            pair = (b, CompiledRunner.policy_key(p))
            if b in agreed.uncompiled:
                self._compiled_everywhere.discard(pair)
            else:
                self._compiled_everywhere.add(pair)

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

    def _add_retained(self, entry: StepPlan, memory: StepMemory) -> None:
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
        self._solve(entry, entry.limit_bytes, first=False)

    def _begin_step(self) -> None:
        self._step = _StepState()
        if self.phase is Phase.WARMUP and self.steps >= self.config.warmup_steps:
            self.phase = Phase.PLANNED
        if self.phase is Phase.WARMUP:
            return
        # A trace must start here, before the step allocates anything; whether the step is
        # profiled, verified or neither is decided at its first block forward (_resolve_trace).
        last_key = self._last_key
        unplanned = (last_key is not None and last_key not in self.plans and last_key not in self._unplannable
                     and self._last_same)
        if unplanned and len(self.plans) >= self.config.max_plans:
            self._give_up(last_key, f"already {len(self.plans)} plans (max_plans)")
            unplanned = False
        awaiting = any(self._awaits_retained(e) for e in self.plans.values())
        # Compiled mode on CPU: a step of shapes without a plan that could not be profiled (an
        # allocator trace, or none, was running) wants the next trace to be one that can profile.
        wanted = self._profile_wanted and len(self.plans) < self.config.max_plans
        if unplanned or awaiting or wanted or (self.config.verify and any(not e.verified for e in self.plans.values())):
            # Only a verify can follow: in compiled mode on CPU measure it with the allocator,
            # under which the step runs compiled (the storage counter would make it run eagerly).
            compiled_cpu = (not unplanned and not awaiting and not wanted and self.device.type != "cuda"
                            and self._compiled_mode())
            if compiled_cpu and not any(self._compiled_already(e) for e in self.plans.values() if not e.verified):
                # The first step under a new plan compiles it, unmeasured: compiling under the
                # profiler crashed the process (torch 2.13, CPU). A step after it is measured.
                return
            self._start_trace("pending", allocator=compiled_cpu and self._allocator_everywhere)

    def _compiled_already(self, entry: StepPlan) -> bool:
        """Every block of ``entry``'s plan has compiled code for it on every rank (compiled mode):
        a step under it compiles nothing anywhere. Read from ``_compiled_everywhere``, agreed at
        the last step's end, never from this rank's own code: a compile that fell back on one
        rank only must not make one rank measure a step (a collective) and another not."""
        return self._compiled_mode() and all((b, CompiledRunner.policy_key(p)) in self._compiled_everywhere
                                             for b, p in entry.policy.blocks.items())

    def _resolve_trace(self, active: StepPlan | None, start: tuple[int, str]) -> None:
        """At a traced step's first block forward: profile it if no plan starts this way, or if it
        starts like the last step, which had no plan (steps repeat: more micro-batches than a plan
        has start like it); verify it if it starts under a plan not measured yet; else stop."""
        last = self._last_key
        repeats_unplanned = (last is not None and last not in self.plans and last not in self._unplannable
                             and self._starts.get(last) == start)
        given_up = {self._starts.get(k) for k in self._unplannable}
        if (repeats_unplanned or active is None) and start not in given_up and len(self.plans) < self.config.max_plans:
            purpose = "profile"
        elif active is not None and self._awaits_retained(active):
            purpose = "retained"
        elif (active is not None and self.config.verify and not active.verified
              and not (self._trace is not None and self.device.type != "cuda" and self._compiled_mode()
                       and self._allocator_everywhere)):
            # (In compiled mode on CPU the storage counter, a dispatch mode, would measure the
            # plan run eagerly, not compiled: a later step under the plan is measured with the
            # allocator instead.)
            purpose = "verify"
        else:
            purpose = None
        if purpose == "verify" and self._allocator is not None and not self._compiled_already(active):
            purpose = None  # this step compiles the plan: not under the profiler (see _begin_step)
        if purpose is None or (self._allocator is not None and purpose != "verify"):
            # An allocator trace cannot profile (no windows): the next step, which starts the
            # same way after an unplanned one, is profiled under the storage counter.
            self._stop_trace()
            return
        self._trace_purpose = purpose
        if purpose == "profile":
            self._start_profile()

    def _start_profile(self) -> None:
        self._log(logging.INFO, "TapeSAC: profiling step %d: every op timed %d times and memory traced "
                  "(this step runs slower); the plan follows at its end", self.steps + 1, self.config.repeats)
        self.phase = Phase.PROFILE
        timer = OpTimer(self.config.repeats, self.device.type)
        for s in self.handle.blocks:
            s.timer = timer

    # Profiling and planning ---------------------------------------------------------------------

    def _check_profile(self, step: _StepState) -> str | None:
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

    def _profile_failed(self, key: str, why: str) -> None:
        n = self._profile_failures.get(key, 0) + 1
        self._profile_failures[key] = n
        if n >= self.config.max_profile_failures:
            self._give_up(key, f"profiling failed {n} times ({why})")
        else:
            self._log(logging.WARNING, "TapeSAC: profile discarded (%s); trying again", why)

    def _give_up(self, key: str, why: str) -> None:
        if key not in self._unplannable:
            self._unplannable[key] = why
            self._log(logging.WARNING, "TapeSAC: steps with these input shapes run replay-only: %s", why)

    def _plan_profiled(self, key: str, step: _StepState, memory: StepMemory) -> None:
        group = self.group
        by_block: dict[int, list[Any]] = {}
        for b, tape in step.tapes:
            by_block.setdefault(b, []).append(tape)
        signatures = {b: tapes[0].signature() for b, tapes in by_block.items()}
        try:
            tdist.check_signatures(signatures, group, describe=lambda b: by_block[b][0].signature_lines())
        except PolicyError as e:
            self._fail(e)
        merged = {b: merge_profiles(tapes) for b, tapes in by_block.items()}
        times = {b: m[0] for b, m in merged.items()}
        sizes = {b: m[1] for b, m in merged.items()}
        try:
            times, sizes, memory = tdist.reduce_profile(times, sizes, memory, self.config.timing_reduction, group)
        except ValueError as e:  # every rank gathered the same traces, so every rank lands here
            self._profile_failed(key, str(e))
            return
        orders = self._orders
        graphs = {b: block_graph(tapes[0], times[b], orders.get(b), sizes[b]) for b, tapes in by_block.items()}
        if self._overheads is None:
            # TapeSAC's own costs belong in the plan: each replayed op's bookkeeping, and recording
            # a block at all (saved when a block keeps everything and runs as plain autograd).
            self._overheads = tdist.broadcast(calibrate_overheads(self.device), group)
        record_s, replay_s = self._overheads
        for b, g in graphs.items():
            g.op_overhead_s = replay_s
            g.record_overhead_s = record_s * len(by_block[b][0].ops)
            if self._compiled_mode():  # plans run compiled: fused recompute, no replay
                compiled_costs(g)
        self._log(logging.INFO, "TapeSAC: planning %d block(s) of %d kind(s) for a step-peak limit of %s",
                  len(graphs), len({g.signature for g in graphs.values()}), fmt_bytes(self.config.memory_limit_bytes))
        recordings = [(r.block, r.input_key) for r in step.recordings]
        entry = StepPlan(key, recordings, Policy.replay_only(signatures),
                         programs={b: tapes[0].program_hash() for b, tapes in by_block.items()},
                         graphs=graphs, memory=memory,
                         limit_bytes=float(self.config.memory_limit_bytes), retained=memory.backwards_twice())
        self._solve(entry, entry.limit_bytes, first=True)
        self.plans[key] = entry

    def _solve(self, entry: StepPlan, limit: float, first: bool) -> None:
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
                payload = ("error", str(e))
            except Exception as e:  # noqa: BLE001 - never leave the other ranks in the broadcast
                payload = ("error", f"TapeSAC: the planner failed ({type(e).__name__}: {e}); please "
                                    "report it with the saved block graphs (PlanConfig.graph_dir)")
        kind, value = tdist.broadcast(payload, self.group)
        if kind == "error":
            if first:
                self._stop_trace()
                self._fail(PlanError(value))
            self._log(logging.WARNING, "TapeSAC: no plan fits the tightened limit %s (%s); this step shape runs "
                        "replay-only, the smallest peak there is", fmt_bytes(limit), value)
            entry.policy = Policy.replay_only({b: p.signature for b, p in entry.policy.blocks.items()})
            entry.plan, entry.verified = None, False
            return
        self._adopt(entry, value, limit)
        entry.verified = not cfg.verify

    def _adopt(self, entry: StepPlan, plan: Plan, limit: float) -> None:
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

    def _verify(self, entry: StepPlan, measured: float, meter: str = "trace") -> None:
        """``measured``: this rank's peak of the first step under ``entry``'s plan measured, by
        ``meter``: the step trace's (a storage counter on CPU, which runs compiled blocks
        eagerly; allocator statistics on CUDA), or the CPU allocator's events (compiled code)."""
        if tdist.active(self.group):
            measured = max(tdist.all_gather(measured, self.group))
        predicted = entry.policy.predicted_peak_bytes
        limit = self.config.memory_limit_bytes
        self.history.append({"step": self.steps, "step_key": entry.key, "limit_bytes": limit,
                             "planned_limit_bytes": entry.limit_bytes, "predicted_peak_bytes": predicted,
                             "measured_peak_bytes": measured, "compiled": self._compiled_mode(), "meter": meter})
        self._log(logging.INFO, "TapeSAC: first step under the plan: measured peak %s (predicted %s, limit %s)", fmt_bytes(measured),
                 fmt_bytes(predicted) if predicted is not None else "n/a", fmt_bytes(limit))
        entry.verified = True
        raised = entry.within is not None and entry.plan is not entry.within[0]
        if measured <= limit * (1 - RAISE_MARGIN if raised else 1):
            if self._compiled_mode() and entry.plan is not None and self.config.compiled_raise_into_slack:
                self._use_slack(entry, measured, limit)
            return
        if entry.within is not None:  # a plan raised into measured slack overshot: back, then bisect
            plan, planned = entry.within
            # Below the plan's own predicted peak, no solve picks that plan again.
            over = min(entry.limit_bytes, predicted if predicted is not None else entry.limit_bytes)
            entry.over = over if entry.over is None else min(entry.over, over)
            self._log(logging.WARNING, "TapeSAC: the plan raised into measured slack peaks at %s, over the limit "
                      "less a %.1f%% margin; back to the last plan measured within it (planned for %s)",
                      fmt_bytes(measured), RAISE_MARGIN * 100, fmt_bytes(planned))
            self._adopt(entry, plan, planned)
            self._raise(entry, (planned + entry.over) / 2, limit)
            return
        if entry.graphs is None:  # a loaded policy overshoots: profile and plan afresh
            self._log(logging.WARNING, "TapeSAC: the loaded policy exceeds the limit; profiling again")
            del self.plans[entry.key]
            return
        entry.replans += 1
        if entry.replans > self.config.max_replans:
            self._log(logging.WARNING, "TapeSAC: still over the limit after %d re-plans; this step shape runs replay-only",
                        self.config.max_replans)
            entry.policy = Policy.replay_only({b: p.signature for b, p in entry.policy.blocks.items()})
            return
        overshoot = measured - (predicted if predicted is not None else measured)
        tighter = entry.limit_bytes - max(overshoot, measured - limit) - 0.01 * limit
        self._log(logging.WARNING, "TapeSAC: measured peak over the limit by %s; re-planning for %s",
                    fmt_bytes(measured - limit), fmt_bytes(tighter))
        self._solve(entry, tighter, first=False)

    def _use_slack(self, entry: StepPlan, measured: float, limit: float) -> None:
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
        self._raise(entry, raised, limit)

    def _raise(self, entry: StepPlan, raised: float, limit: float) -> None:
        """Re-plan ``entry`` (now under its ``within`` plan) for the planned limit ``raised``, if
        that is worth a compile: at most ``max_replans`` raises, each at least ``RAISE_HEADROOM``
        of the limit above the plan measured within, and a plan that differs from it."""
        planned = entry.within[1]
        if entry.graphs is None or entry.raises >= self.config.max_replans or raised - planned < RAISE_HEADROOM * limit:
            entry.verified = True
            return
        entry.raises += 1
        before = {b: (sorted(p.keep), p.passthrough) for b, p in entry.policy.blocks.items()}
        self._log(logging.INFO, "TapeSAC: the compiled step left room under the limit; re-planning for %s "
                  "(measured within at %s%s)", fmt_bytes(raised), fmt_bytes(planned),
                  f", over at {fmt_bytes(entry.over)}" if entry.over is not None else "")
        self._solve(entry, raised, first=False)
        if entry.plan is None:  # cannot happen for a higher limit; keep the measured plan then
            self._adopt(entry, *entry.within)
            entry.verified = True
        elif {b: (sorted(p.keep), p.passthrough) for b, p in entry.policy.blocks.items()} == before:
            self._adopt(entry, *entry.within)  # the same plan: nothing new to measure
            entry.verified = True
            entry.raises = self.config.max_replans

    # Saved policies -----------------------------------------------------------------------------

    def _load_policy(self) -> None:
        """Rank 0 reads the policy file and decides; every rank applies the same (one broadcast).
        Nothing rank 0 meets in the file may stop it before the broadcast (the others wait there)."""
        path = self.config.policy_path
        if not path:
            return
        payload: Any = (None, None)
        if tdist.rank(self.group) == 0:
            import os

            if os.path.exists(path):
                try:
                    policy = Policy.load(path)
                    recordings = self._check_loaded(policy)
                    payload = ("policy", (policy.to_json(), recordings))
                except PolicyError as e:
                    payload = ("ignored", str(e))
                except Exception as e:  # noqa: BLE001 - a file must never crash a run
                    payload = ("ignored", f"{type(e).__name__}: {e}")
        kind, value = tdist.broadcast(payload, self.group)
        if kind == "ignored":
            self._log(logging.WARNING, "TapeSAC: ignoring policy file %s (%s); profiling instead", path, value)
        elif kind == "policy":
            data, recordings = value
            policy = Policy.from_json(data)
            entry = StepPlan(policy.meta["step_key"], recordings, policy,
                             limit_bytes=float(policy.limit_bytes or self.config.memory_limit_bytes),
                             verified=not self.config.verify, retained=policy.meta.get("retained") is True)
            self.plans[entry.key] = entry
            self.loaded_policy = True
            self._log(logging.INFO, "TapeSAC: loaded policy %s (checked against the recorded tapes)", path)

    def _check_loaded(self, policy: Policy) -> list[tuple[int, str]]:
        """Why ``policy`` does not fit this run (PolicyError), or the recordings it was made for."""
        requested = policy.meta.get("limit_requested_bytes", policy.limit_bytes)
        if requested != self.config.memory_limit_bytes:
            shown = fmt_bytes(requested) if isinstance(requested, (int, float)) else repr(requested)
            raise PolicyError(f"it was planned for a limit of {shown}, not "
                              f"{fmt_bytes(self.config.memory_limit_bytes)}")
        for key, value in self.config.policy_meta.items():
            if policy.meta.get(key) != value:
                raise PolicyError(f"it was planned for {key}={policy.meta.get(key)!r}, not {value!r}")
        recordings = policy.meta.get("recordings")
        if not isinstance(policy.meta.get("step_key"), str) or not isinstance(recordings, list) or any(
                not (isinstance(r, list) and len(r) == 2 and type(r[0]) is int and isinstance(r[1], str))
                for r in recordings):
            raise PolicyError("it does not say which step it was made for (made by an older TapeSAC?)")
        recordings = [(b, k) for b, k in recordings]
        if {b for b, _k in recordings} != set(policy.blocks):
            raise PolicyError("its blocks and its step's recordings do not match")
        if not set(policy.blocks) <= {s.index for s in self.handle.blocks}:
            raise PolicyError(f"it covers blocks {sorted(policy.blocks)}, this model has "
                              f"{len(self.handle.blocks)}")
        return recordings

    # Tracing ------------------------------------------------------------------------------------

    def _start_trace(self, purpose: str, inputs: Iterable[torch.Tensor] = (), allocator: bool = False) -> None:
        """Trace the step from here: a :class:`StepTrace` (windows, for profiling), or with
        ``allocator`` only its peak, from the CPU allocator's events (a compiled verify step)."""
        track: list[torch.Tensor] = []
        if self.device.type != "cuda":
            track = list(_tensors_of([s.module for s in self.handle.blocks])) + list(_tensors_of(list(inputs)))
            track += list(_tensors_of(self.config.track))
            track += list(_tensors_of([o for o in (r() for r in self._optimizers) if o is not None]))
        self._trace_purpose = purpose
        if allocator:
            self._allocator = AllocatorStepMeter(track)
            self._allocator.start()
            return
        self._trace = StepTrace(meter_for(self.device, track))
        self._trace.start()

    def _compiled_mode(self) -> bool:
        return any(s.compiled is not None for s in self.handle.blocks)

    def _finish_trace(self) -> StepMemory | None:
        trace, self._trace = self._trace, None
        self._trace_purpose = None
        if trace is None:
            return None
        self._orders = trace.unpack_orders()
        for s in self.handle.blocks:
            s.timer = None
        return trace.finish()

    def _stop_trace(self) -> None:
        if self._trace is not None:
            self._trace.abort()
        if self._allocator is not None:
            self._allocator.stop()
        self._trace = None
        self._allocator = None
        self._trace_purpose = None
        for s in self.handle.blocks:
            s.timer = None
