"""Compiled mode: TapeSAC plans from eager tapes, ``torch.compile`` runs the plan.

A block's plan (the tape positions it keeps) becomes a selective-activation-checkpointing policy
for ``torch.utils.checkpoint``: the k-th op SAC sees is the tape's k-th op, saved
(``MUST_SAVE``) when the plan keeps one of its values and recomputed (``PREFER_RECOMPUTE``)
otherwise. The block then runs as ``torch.compile(checkpoint(forward, context_fn=...))``, so the
compiled forward saves what the plan keeps and the partitioner recomputes the rest, fused.

Invariants (cited as "compiled invariant N" where they are kept):

1. Positions are checked, never assumed. Every pass of SAC over the block (one per trace under
   compile, one per forward when it runs eagerly) must see exactly the tape's ops, in order,
   with the same overloads (ops SAC ignores, ``SAC_IGNORED_OPS``, and shape checks without
   outputs, ``SHAPE_CHECK_OPS``, skipped on both sides), up to the spellings dynamo is known to
   trace differently from eager code (torch 2.13), each accepted only where and as written here:

   a. ``unbind.int(t, d)`` with n outputs (Python unpacking, ``q, k, v = t``) as the run
      ``select.int(t, d, 0)``, ..., ``select.int(t, d, n - 1)``, nothing in between; each
      select gets the decision for its output (a kept output is saved). When all n outputs
      alias a block input or a parameter, the trace may run no op for it at all: those views
      are taken outside SAC's region, and holding them costs nothing.
   b. Off the tape, ``t.tolist()`` of a 1-d tensor of static length n, which dispatches no op
      eagerly, as the run ``select.int(t, 0, i)``, ``_local_scalar_dense`` for i = 0 .. n - 1,
      all of it, on the same tensor, wherever the tape's next op does not match first. The
      scalars are saved (invariant 5), the selects recomputed.
   c. Off the tape, ``clone.default`` of one tensor: ``dropout`` with ``p = 0`` or in eval mode
      returns its input eagerly (no op) and traces as ``input.clone()``
      (``torch._decomp.decompositions.dropout``). A copy changes no value; it is recomputed.
   d. ``lift_fresh.default`` of a 1-d tensor (``torch.tensor(python_list)``) as the run
      ``scalar_tensor.default`` per element, then ``stack.default`` of exactly those, nothing in
      between, once dynamo has made the list's values symbolic (their number may differ from the
      tape's: it is data, as the tape's signature treats it); of a 0-d tensor, as one
      ``scalar_tensor``. The op that ends the run gets the tape op's decision; the scalars
      before a ``stack`` are recomputed.

   ``split``, ``split_with_sizes``, ``chunk`` and ``tensor_split`` trace as the op eager code
   runs, so they need no other spelling. A pass that departs otherwise (a graph break, another
   decomposition, another program) marks the policy broken.
2. A broken policy warns once, naming the block and the first op that differs, and the block
   runs full activation checkpointing from its next forward on (every op recomputed: the lowest
   memory there is). SAC's choices decide memory only, never values: the forward that found the
   departure is still exact, it may just save what it saved before the departure. A plan the
   backend fails to compile (inductor on CPU has been seen to fail on a saved multi-output
   attention op) is broken too, and that very forward runs full AC instead.
3. Each policy compiles its own code object. Dynamo caches compiled graphs per code object and
   does not guard on ``context_fn``, so blocks sharing one code object would silently share the
   first one's saved set. Blocks with the same policy (tape signature and keep set) share one.
4. Counters start at zero in every ``context_fn`` call (one per forward, one per trace).
5. Ops TapeSAC never replays (collectives, data-dependent and effectful ops, ``keep_only`` on
   the tape) are saved in every plan, as in eager mode, so the plan's memory model holds; so are
   the scalars a traced ``tolist`` reads (1b), which eager code reads once and replay reuses.
6. A kept value whose storage the block writes in place later is recomputed, not saved: SAC
   holds the tensor itself (no snapshot as eager TapeSAC takes), and refuses a saved tensor that
   changed. Such a block saves less than its plan.
7. A kept view is saved through the op that made its storage as well. The partitioner never
   bans recomputing a view op (``select``, ``view``, ``permute``, ``slice``, ...), so it drops
   ``MUST_SAVE`` on one; the plan counts the view's whole storage, which saving the storage's
   maker holds, whatever spelling the view takes (1a). A multi-output view (``unbind``) that SAC
   saves itself aliases the same storage: no more bytes.

Plans for compiled mode are costed by ``tapesac.planner.compiled_cost`` (fused ops at ``FUSED_COST`` of
their eager time, no replay overheads). Memory is checked on a compiled step itself, measured (on
CUDA the first under a plan, by the allocator's statistics, not yet run on a GPU; on CPU a later
one, once every block has compiled code for the plan on every rank, by the allocator's events,
``tapesac.meter.AllocatorStepMeter``, which is no dispatch mode: the first compiles unmeasured,
since compiling under the profiler crashed the process, torch 2.13), re-planned tighter when over
the limit and re-planned into the slack when well under it (``tapesac.autoplan``). Only when a
step runs under a dispatch mode (the CPU storage counter, while another profiler keeps the
allocator meter out; or the user's own) does it run the same SAC policy eagerly: the same saved
set, eager kernels' transients.
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import Any, Callable

import torch
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

from .tape import PRODUCED, Tape

log = logging.getLogger("tapesac")

MUST_SAVE = CheckpointPolicy.MUST_SAVE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


class MappingWarning(UserWarning):
    """A compiled trace of a block did not run the ops of its tape: the block falls back to full
    activation checkpointing (compiled invariant 2)."""


_SELECT = torch.ops.aten.select.int
_UNBIND = torch.ops.aten.unbind.int
_SCALAR = torch.ops.aten._local_scalar_dense.default
_CLONE = torch.ops.aten.clone.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default
_STACK = torch.ops.aten.stack.default

SHAPE_CHECK_OPS = frozenset({
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
})
"""Ops that return nothing and only check symbolic sizes: dynamo inserts them for the unbacked
sizes of data-dependent code (``tolist``, ``item``), eager code calls them rarely. Having no
outputs, they have nothing to save; the mapping skips them on both sides (compiled invariant 1)."""


class _Pass:
    """Where one pass of SAC over a block stands in the expected stream."""

    __slots__ = ("seen", "step", "spelled", "read", "lifted", "departure")

    def __init__(self) -> None:
        self.seen = 0
        """Ops SAC asked about (shape checks left out)."""
        self.step = 0
        """The next tape op (index into ``TapePolicy.expected``)."""
        self.spelled = 0
        """Inside the select spelling of the tape op ``step``: how many of its selects ran."""
        self.read: list | None = None
        """Inside an off-tape ``tolist`` read: [the tensor read, elements read, scalar pending]."""
        self.lifted = 0
        """Inside the ``scalar_tensor`` spelling of the 1-d ``lift_fresh`` at ``step``: the
        scalars it ran."""
        self.departure: str | None = None


class TapePolicy:
    """One block's keep set as a checked SAC policy (compiled invariants 1, 4, 5, 6 and 7).

    ``expected`` is the op stream SAC sees when it runs the tape's ops, ``save`` the decision per
    position; ``spellings`` maps a position to the decisions of its other accepted spelling, one
    per output (compiled invariant 1). ``passes`` counts the passes seen (``context_fn`` calls);
    :meth:`check` reads the passes finished since the last check and returns a description of the
    first departure, or None."""

    def __init__(self, block: int, tape: Tape, keep: frozenset | set) -> None:
        self.block = block
        keep = set(keep)
        kept_ops = {op for op, _slot in keep} | _storage_producers(tape, keep)
        # SAC cannot save a tensor that the block later writes in place (eager SAC raises in
        # backward): such values are recomputed instead, less memory than the plan (invariant 6).
        written = {tape.values[before].sid for op in tape.ops for before, _after in op.writes}
        self.expected: list[Any] = []
        self.save: list[bool] = []
        self.spellings: dict[int, tuple[int, tuple[bool, ...]]] = {}
        """Position of an ``unbind`` -> (its dim, the decision for each output's ``select``)."""
        self.absent: set[int] = set()
        """Positions of ``unbind`` ops of external tensors, which a trace may not run at all."""
        self.lifts: dict[int, int] = {}
        """Position of a ``lift_fresh`` -> the dimensions of the tensor it made (0 or 1, 1d)."""
        for i, op in enumerate(tape.ops):
            if op.func in SAC_IGNORED_OPS or op.func in SHAPE_CHECK_OPS:
                continue
            overwritten = [v is not None and tape.values[v].sid in written for v in op.outs]
            if op.func is _UNBIND:
                # Python unpacking of a tensor (``q, k, v = t``) runs unbind eagerly; dynamo traces
                # it as one select per output. A kept output is saved as its select.
                dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
                self.spellings[len(self.expected)] = (dim, tuple(
                    op.keep_only is not None or ((i, slot) in keep and not overwritten[slot])
                    for slot in range(op.n_returned)))
                if all(v is None or tape.values[v].free for v in op.outs):
                    # Unpacking a block input or a parameter: the trace runs no op at all (the
                    # views are taken outside SAC's region). Such views cost nothing to hold.
                    self.absent.add(len(self.expected))
            if op.func is _LIFT_FRESH and op.outs[0] is not None and len(tape.values[op.outs[0]].shape) <= 1:
                self.lifts[len(self.expected)] = len(tape.values[op.outs[0]].shape)
            self.expected.append(op.func)
            self.save.append(op.keep_only is not None or (i in kept_ops and not any(overwritten)))
        self.passes = 0
        self._runs: list[_Pass] = []
        """The passes not yet checked."""
        self.context_fn = self._make_context_fn()

    def _make_context_fn(self) -> Callable[[], tuple]:
        # A plain closure: dynamo calls context_fn without a bound self.
        policy = self

        def context_fn() -> tuple:
            run = _Pass()  # compiled invariant 4: a fresh counter per pass
            policy._runs.append(run)
            policy.passes += 1
            return create_selective_checkpoint_contexts(
                lambda ctx, func, *args, **kwargs: policy._decide(run, func, args, kwargs))

        return context_fn

    def _decide(self, run: _Pass, func: Any, args: tuple, kwargs: dict) -> CheckpointPolicy:
        if func in SHAPE_CHECK_OPS:
            return PREFER_RECOMPUTE  # no outputs: nothing to save
        k = run.seen
        run.seen += 1
        if run.departure is not None:
            return PREFER_RECOMPUTE
        decision = self._match(run, func, args, kwargs)
        if decision is None:
            where = run.step
            if run.read is not None:
                source, done, _ = run.read
                run.departure = f"op {k} is {func} after {done} of the {source.shape[0]} elements of a tolist"
            elif where >= len(self.expected):
                run.departure = f"op {k} is {func}, past the tape's {len(self.expected)} ops"
            else:
                run.departure = f"op {k} is {func} where the tape has {self.expected[where]}"
            return PREFER_RECOMPUTE
        return decision

    def _match(self, run: _Pass, func: Any, args: tuple, kwargs: dict) -> CheckpointPolicy | None:
        """The decision for ``func`` at the pass's place in the expected stream, advancing it; None
        when ``func`` is no accepted spelling there (compiled invariant 1)."""
        if run.read is not None:  # inside a tolist read: its scalar, or the next element's select
            return self._read_on(run, func, args)
        if run.lifted:  # inside a lift spelled as scalars (1d): the next scalar, or the stack
            return self._lift_on(run, func, args, kwargs)
        if run.spelled:  # inside an unbind spelled as selects: the next select
            dim, saves = self.spellings[run.step]
            if func is not _SELECT or tuple(args[1:3]) != (dim, run.spelled):
                return None
            decision = saves[run.spelled]
            run.spelled += 1
            if run.spelled == len(saves):
                run.spelled, run.step = 0, run.step + 1
            return MUST_SAVE if decision else PREFER_RECOMPUTE
        k = run.step
        while k in self.absent and func != self.expected[k] and not self._starts_spelling(k, func, args):
            k = run.step = k + 1  # unpacked outside SAC's region
        if k < len(self.expected) and func == self.expected[k]:
            run.step += 1
            return MUST_SAVE if self.save[k] else PREFER_RECOMPUTE
        if func is _SCALAR_TENSOR and k in self.lifts:
            if self.lifts[k] == 0:  # a 0-d lift: this one scalar is the tensor
                run.step = k + 1
                return MUST_SAVE if self.save[k] else PREFER_RECOMPUTE
            run.lifted = 1
            return PREFER_RECOMPUTE
        if self._starts_spelling(k, func, args):
            run.spelled = 1
            saves = self.spellings[k][1]
            if len(saves) == 1:
                run.spelled, run.step = 0, k + 1
            return MUST_SAVE if saves[0] else PREFER_RECOMPUTE
        if func is _CLONE and len(args) == 1 and not kwargs:
            return PREFER_RECOMPUTE  # dropout that eager code skipped (1c): a copy, recomputed
        if func is _SELECT and _starts_tolist(args):
            run.read = [args[0], 0, True]
            return PREFER_RECOMPUTE
        return None

    def _starts_spelling(self, k: int, func: Any, args: tuple) -> bool:
        return k in self.spellings and func is _SELECT and tuple(args[1:3]) == (self.spellings[k][0], 0)

    def _lift_on(self, run: _Pass, func: Any, args: tuple, kwargs: dict) -> CheckpointPolicy | None:
        """Dynamo traces ``torch.tensor(values)`` of symbolic values as one ``scalar_tensor`` per
        value, then ``stack`` of them (compiled invariant 1d)."""
        if func is _SCALAR_TENSOR:
            run.lifted += 1
            return PREFER_RECOMPUTE
        if func is not _STACK or len(args[0]) != run.lifted or kwargs.get("dim", args[1] if len(args) > 1 else 0) != 0:
            return None
        k = run.step
        run.lifted, run.step = 0, k + 1
        return MUST_SAVE if self.save[k] else PREFER_RECOMPUTE

    def _read_on(self, run: _Pass, func: Any, args: tuple) -> CheckpointPolicy | None:
        """Dynamo traces ``t.tolist()`` of a 1-d tensor, which dispatches nothing eagerly (so the
        tape has no op for it), as ``select(t, 0, i)`` then ``_local_scalar_dense`` per element,
        in order. The scalars are data-dependent and saved, as the tape keeps ``item``'s
        (compiled invariant 5); the selects are views, recomputed."""
        source, done, scalar_pending = run.read
        if scalar_pending:
            if func is not _SCALAR:
                return None
            run.read[1:] = [done + 1, False]
            if done + 1 == source.shape[0]:
                run.read = None
            return MUST_SAVE
        if func is not _SELECT or args[0] is not source or tuple(args[1:3]) != (0, done):
            return None
        run.read[2] = True
        return PREFER_RECOMPUTE

    def check(self) -> str | None:
        """The first departure among the passes finished since the last check (compiled
        invariant 1), or None. Call it between forwards, never inside one."""
        runs, self._runs = self._runs, []
        for run in runs:
            departure = run.departure
            if departure is None and run.read is not None:
                departure = f"the trace stopped inside a tolist of {run.read[0].shape[0]} elements"
            elif departure is None and (self._end(run.step) != len(self.expected) or run.spelled or run.lifted):
                departure = f"the trace ran the tape's first {run.step} of {len(self.expected)} ops"
            if departure is not None:
                return departure
        return None

    def _end(self, step: int) -> int:
        """The position a pass that stopped at ``step`` reached: unpackings it ran outside SAC's
        region (1a) count as run."""
        while step in self.absent:
            step += 1
        return step


def _storage_producers(tape: Tape, keep: set) -> set[int]:
    """The ops that made the storages of the kept values that are views of another op's output
    (compiled invariant 7)."""
    made_by: dict[int, int] = {}
    """sid -> the op that made the storage (-1: made outside the block)."""
    for v in tape.values:
        made_by.setdefault(v.sid, v.op if v.kind == PRODUCED else -1)
    producers = set()
    for op, slot in keep:
        vid = tape.ops[op].outs[slot] if slot < len(tape.ops[op].outs) else None
        if vid is not None and made_by.get(tape.values[vid].sid, -1) not in (-1, op):
            producers.add(made_by[tape.values[vid].sid])
    return producers


def _starts_tolist(args: tuple) -> bool:
    """``select(t, 0, 0)`` of a 1-d tensor with a static length: how dynamo starts ``t.tolist()``."""
    t = args[0]
    return (isinstance(t, torch.Tensor) and t.dim() == 1 and isinstance(t.shape[0], int)
            and t.shape[0] > 0 and tuple(args[1:3]) == (0, 0))


class _RecomputeAll:
    """Full activation checkpointing as a SAC policy: the fallback of compiled invariant 2."""

    def __init__(self) -> None:
        def context_fn() -> tuple:
            return create_selective_checkpoint_contexts(lambda ctx, func, *a, **k: PREFER_RECOMPUTE)

        self.context_fn = context_fn

    def check(self) -> None:
        return None


def _checkpointed(forward: Callable, context_fn: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def _plain(forward: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return run


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own (compiled invariant 3)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") \
        else fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _compile_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [torch._dynamo.exc.BackendCompilerFailed]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(errors)


_COMPILE_ERRORS = _compile_errors()
"""What a backend raises when it cannot compile a traced plan (compiled invariant 2 covers it):
raised while compiling, before any of the forward runs. An error that generated code raises as
it runs is not one of them and propagates: inductor once emitted, in a MoE plan's forward, an
allocation sized by an unbacked symbol before the line that reads it (``UnboundLocalError: u24``,
torch 2.13). By then the kernels before it have run, and inductor runs input mutations in the
graph (the MoE router's ``tokens_per_expert.add_``) and draws random seeds at its start, in no
order TapeSAC can rely on; running the block again as full AC could apply them twice."""


def _dispatch_mode_active() -> bool:
    """A dispatch mode dynamo would decline to compile under is on the stack."""
    return any_torch_dispatch_mode_on_stack()


class CompiledRunner:
    """Runs wrapped blocks compiled under their plans; one per :func:`tapesac.wrap` call.

    Keeps one code object per policy (compiled invariant 3) and, per block, the compiled
    function of the policy it runs under. ``options`` are ``torch.compile``'s keyword arguments
    (backend, mode, dynamic, fullgraph)."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        self._codes: dict[Any, types.CodeType] = {}
        """Policy key -> the code object its compiled functions share."""
        self._policies: dict[Any, Any] = {}
        """Policy key -> its TapePolicy (or the recompute-all fallback), shared by blocks."""
        self._compiled: dict[tuple[int, Any], tuple[Callable, Callable]] = {}
        """(block index, policy key) -> that block's compiled function and its eager twin."""
        self.broken: dict[Any, str] = {}
        """Policy key -> the departure that broke it (compiled invariant 2)."""

    def policy_for(self, state: Any) -> Any:
        """The policy key ``state`` runs compiled under, or None when it must run eagerly (no
        plan, a profiling forward, or no tape of the plan's program recorded yet)."""
        entry = state.policy
        if entry is None or state.timing:
            return None
        key = self.policy_key(entry)
        if entry.passthrough:
            return key
        if key in self.broken:
            return "recompute-all"
        if key in self._policies:
            return key
        tape = state.last_tape
        if tape is None or tape.signature() != entry.signature:
            return None  # the next eager forward records the plan's program
        self._policies[key] = TapePolicy(state.index, tape, entry.keep)
        return key

    @staticmethod
    def policy_key(block_policy: Any) -> Any:
        """The key of the compiled code a block runs under ``block_policy`` (a ``BlockPolicy``)
        until that policy breaks: the same on every rank, and shared by blocks that run the
        same policy (compiled invariant 3)."""
        if block_policy.passthrough:
            return ("passthrough", block_policy.signature)
        return (block_policy.signature, frozenset(block_policy.keep))

    def has_compiled(self, index: int, block_policy: Any) -> bool:
        """Block ``index`` has compiled code for ``block_policy`` (a ``BlockPolicy``), or for the
        full AC it fell back to on this rank: a step under it runs compiled, with nothing left to
        compile. What this rank has; ranks may differ (a fall back is per rank)."""
        key = self.policy_key(block_policy)
        if not block_policy.passthrough and key in self.broken:
            key = "recompute-all"
        return (index, key) in self._compiled

    def clear(self) -> None:
        """Drop every compiled function (``handle.remove()``): they hold the blocks' forwards."""
        self._compiled.clear()
        self._policies.clear()
        self._codes.clear()

    def kept_bytes(self, state: Any, key: Any) -> int:
        """Bytes the plan keeps for ``state`` under ``key`` (0 after a fall back to full AC)."""
        entry = state.policy
        return 0 if key == "recompute-all" or entry is None else int(entry.kept_bytes)

    def forward(self, state: Any, key: Any, args: tuple, kwargs: dict) -> Any:
        fns = self._compiled.get((state.index, key))
        if fns is None:
            fns = self._compiled[(state.index, key)] = self._compile(state, key)
        policy = self._policies.get(key)
        # Dynamo declines frames entered under a dispatch mode (a CPU storage counter measuring
        # the step) and remembers to skip that code for good: run the same policy eagerly then.
        try:
            out = fns[1 if _dispatch_mode_active() else 0](*args, **kwargs)
        except _COMPILE_ERRORS as e:
            if key == "recompute-all":
                raise
            # Compilation fails before anything runs: nothing of this forward happened yet.
            first_line = (str(e).strip().splitlines() or [""])[0][:200]
            self._break(state.index, key, f"compiling it failed: {type(e).__name__}: {first_line}")
            if isinstance(policy, TapePolicy):
                policy.check()  # forget the failed trace's passes
            return self.forward(state, "recompute-all", args, kwargs)
        if isinstance(policy, TapePolicy):
            departure = policy.check()
            if departure is not None:
                self._break(state.index, key, departure)
        return out

    def _compile(self, state: Any, key: Any) -> Callable:
        if key == "recompute-all":
            policy = self._policies.setdefault(key, _RecomputeAll())
            fn = _checkpointed(state.original_forward, policy.context_fn)
        elif key[0] == "passthrough":
            fn = _plain(state.original_forward)
        else:
            fn = _checkpointed(state.original_forward, self._policies[key].context_fn)
        code = self._codes.get(key)
        if code is None:
            name = f"tapesac_block{state.index}_policy{len(self._codes)}"
            code = self._codes[key] = _own_code(fn, name).__code__
        own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        return torch.compile(own, **self.options), fn

    def _break(self, block: int, key: Any, departure: str) -> None:
        self.broken[key] = departure
        if departure.startswith("compiling it failed"):
            what = (f"its plan could not be compiled ({departure}); the block runs full activation "
                    "checkpointing from now on (recompute everything). Use eager TapeSAC for this "
                    "model to run the plan itself")
        else:
            what = (f"the compiled trace does not run the ops of the block's tape ({departure}), so "
                    "the plan's tape positions cannot be mapped onto it; the block runs full "
                    "activation checkpointing from now on (recompute everything). Graph breaks or "
                    "a program that differs under compile cause this: compile without graph "
                    "breaks (fullgraph=True shows where), or use eager TapeSAC for this model")
        warnings.warn(f"TapeSAC block {block}: {what}", MappingWarning, stacklevel=3)
        log.warning("TapeSAC block %d: the plan does not run compiled as made (%s); full AC from now on",
                    block, departure)
