"""The eager API: ``handle = tapesac.wrap(blocks)``, ``handle.stats()``, ``handle.remove()``."""

from __future__ import annotations

import weakref
from typing import Any, Iterable

from torch import nn

from . import kernels
from .block import BlockState, current_recorder
from .errors import TapeSACError, WrapError

try:  # torch.distributed may be built without these; only used to recognise AC wrappers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
except ImportError:  # pragma: no cover
    CheckpointWrapper = ()  # type: ignore[assignment,misc]


def _state_of(module: nn.Module) -> BlockState | None:
    fwd = module.__dict__.get("forward")
    return getattr(fwd, "__tapesac_state__", None)


class TapeSACHandle:
    """The wrapped blocks of one :func:`wrap` call. Also a context manager that removes on exit."""

    def __init__(self, states: list[BlockState]) -> None:
        self.blocks = states
        self._removed = False
        kernels.install(current_recorder)  # Triton launches inside the blocks become tape steps
        self._uninstall = weakref.finalize(states[0], kernels.uninstall) if states else (lambda: None)
        """Undoes the install once: at :meth:`remove`, or when the wrapped blocks are collected
        (a handle the caller drops leaves its blocks wrapped: launches in them stay recorded)."""
        self.planner = None
        """The :class:`~tapesac.autoplan.AutoPlanner` in planned mode, else None."""

    @property
    def plan(self):
        """The current :class:`~tapesac.planner.Plan` (planned mode, once profiled), else None."""
        return self.planner.plan if self.planner is not None else None

    def frontier(self) -> list[dict[str, float]]:
        """The step-level frontier of the current plan: predicted peak bytes vs recompute s."""
        if self.plan is None:
            raise TapeSACError("no plan yet: wrap with memory_limit_bytes and train a few steps")
        return list(self.plan.frontier)

    def __enter__(self) -> "TapeSACHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def stats(self) -> dict[int, dict[str, Any]]:
        """Per block index: ops recorded in the last forward, ops replayed in the last backward,
        ops in the replay closure, values read by backward, bytes kept (produced by the block),
        bytes of held inputs, bytes allocated by replay in the last backward, tape signature, and
        ``off_tape_bytes``: saved tensors no recorded op made, held as they are (0 when TapeSAC saw
        everything the block's backward reads being made); ``followed``: the last forward followed
        a verified tape instead of recording; ``ops_unobserved``: ops of it that ran in pure module
        calls with the dispatch mode off (:mod:`tapesac.segments`); ``unseen_bytes``: bytes held
        because no recorded op wrote them (a kernel, numpy) or their replay once differed;
        ``kernel_launches``: Triton launches recorded as tape steps; ``verified``: the last
        forward was a verification forward (its saved tensors fingerprinted)."""
        return {s.index: s.stats.as_dict() for s in self.blocks}

    def tapes(self) -> dict[int, Any]:
        """Per block index, the :class:`~tapesac.tape.Tape` of its last recorded forward."""
        return {s.index: s.last_tape for s in self.blocks if s.last_tape is not None}

    def set_policy(self, policy: "Any | None") -> None:
        """Keep the values a :class:`~tapesac.policy.Policy` names (None: replay-only)."""
        for s in self.blocks:
            s.use_policy(None if policy is None else policy.for_block(s.index),
                         None if policy is None else policy.predicted_peak_bytes)

    def step(self) -> None:
        """Mark the end of a training step (planned mode).

        Planned mode ends a step by itself when an optimizer over the blocks' parameters finishes
        ``step()``. Call this instead once per step if you update parameters otherwise; from the
        first call on, optimizer steps are ignored. A no-op in replay-only mode."""
        if self.planner is not None:
            self.planner.step()

    def remove(self) -> None:
        """Put every block back exactly as it was. Idempotent."""
        if self._removed:
            return
        if self.planner is not None:
            self.planner.close()
        for s in self.blocks:
            s.uninstall()
            s.drop_compiled()  # its compiled functions hold the modules' forwards
        self._uninstall()
        self._removed = True


def wrap(blocks: Iterable[nn.Module], *, policy: Any = None, memory_limit_bytes: int | None = None,
         plan_config: Any = None, debug: bool = False, compile: bool = False,
         compile_options: dict[str, Any] | None = None, verify_every: int = 0) -> TapeSACHandle:
    """Wrap ``blocks`` in place so their activations are recomputed by targeted replay.

    By default nothing a block produces is kept: backward holds only the block's inputs and
    external tensors (the memory of full activation checkpointing) and recomputes, per saved
    value, only its producer chain. ``policy`` keeps chosen values per block.

    ``memory_limit_bytes`` (or a full ``tapesac.autoplan.PlanConfig``) turns on planned mode:
    the first steps are profiled, a plan keeping what pays most under that step-peak limit is
    solved and applied, and the next step is measured against it (``handle.plan``,
    ``handle.frontier()``). ``debug`` compares every recomputed value with the forward's.

    ``compile=True`` (compiled mode, ``tapesac.compiled``): forwards without a plan (warm-up,
    profiling, replay-only) record eagerly as above; a forward under a plan runs as
    ``torch.compile(checkpoint(forward))`` with a selective-checkpointing policy that saves
    exactly the plan's kept values, checked op by op against the block's tape (a compiled trace
    that departs from it warns and falls back to full activation checkpointing).
    ``compile_options`` are ``torch.compile``'s keyword arguments (``backend``, ``mode``, ...).
    Gradients are then compiled numerics, not bit-identical to eager.

    Verification forwards (each block's first forward of every new input shape or policy, and
    profiled and measured steps; with ``verify_every = n`` also every n-th forward) fingerprint
    what autograd saves and check what replay rebuilds against it: a kernel that wrote a tensor
    where the dispatcher could not see is a :class:`~tapesac.errors.ReplayError` there, and that
    value is kept from then on.
    """
    blocks = list(blocks)
    if not blocks:
        raise WrapError("tapesac.wrap needs at least one block")
    seen: set[int] = set()
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise WrapError(f"block {i} is a {type(b).__name__}, not an nn.Module")
        if id(b) in seen:
            raise WrapError(f"block {i} appears twice in the list")
        seen.add(id(b))
        existing = _state_of(b)
        if existing is not None:
            raise WrapError(
                f"block {i} ({type(b).__name__}) is already wrapped by TapeSAC (as block "
                f"{existing.index}); call remove() on the earlier handle first"
            )
        if CheckpointWrapper and isinstance(b, CheckpointWrapper):
            raise WrapError(
                f"block {i} is wrapped by torch activation checkpointing (CheckpointWrapper). "
                "TapeSAC replaces activation checkpointing: remove it (torchtitan: "
                "activation_checkpoint.mode = 'none')"
            )
        if getattr(b, "_compiled_call_impl", None) is not None:
            raise WrapError(
                f"block {i} was compiled with module.compile(); TapeSAC records eager ops and "
                "compiles blocks itself: pass the block uncompiled with tapesac.wrap(..., compile=True)"
            )
    ids = {id(b): i for i, b in enumerate(blocks)}
    for i, b in enumerate(blocks):
        for name, sub in b.named_modules():
            if sub is not b and id(sub) in ids:
                raise WrapError(
                    f"block {ids[id(sub)]} is nested inside block {i} (as '{name}'); wrap either "
                    "the outer or the inner blocks, not both"
                )
    if compile_options is not None and not compile:
        raise WrapError("compile_options given without compile=True")
    if not isinstance(verify_every, int) or verify_every < 0:
        raise WrapError(f"verify_every must be an int >= 0 (0: verification forwards only), got {verify_every!r}")
    if compile and debug:
        raise WrapError("debug=True checks eager replay; it cannot check compiled forwards: pick one")
    runner = None
    if compile:
        from .compiled import CompiledRunner

        runner = CompiledRunner(compile_options)
    states = [BlockState(i, b, debug=debug, verify_every=verify_every, compiled=runner)
              for i, b in enumerate(blocks)]
    for s in states:
        s.install()
    handle = TapeSACHandle(states)
    if policy is not None:
        handle.set_policy(policy)
    if memory_limit_bytes is not None or plan_config is not None:
        from .autoplan import AutoPlanner, PlanConfig

        if policy is not None:
            raise WrapError("give either a policy or a memory limit, not both")
        if plan_config is None:
            plan_config = PlanConfig(memory_limit_bytes=int(memory_limit_bytes))
        elif memory_limit_bytes is not None:
            raise WrapError("give the memory limit once: in plan_config or as memory_limit_bytes")
        try:
            handle.planner = AutoPlanner(handle, plan_config)
        except Exception:
            handle.remove()
            raise
    return handle
