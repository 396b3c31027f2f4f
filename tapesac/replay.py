"""Serve autograd's unpacks for one recorded block forward by rerunning only what is needed.

Invariants R1-R6 (the recorder's, 1-11, are in :mod:`tapesac.recorder`):

R1. An unpack runs only the producer chain of the asked value that is not already available
    (held, or cached by an earlier unpack). Values backward never unpacks are never rebuilt.
    The chain's inputs taken from the cache are referenced by the chain itself while it runs.
R2. A rebuilt (or kept) value stays cached while something may still need it: pending unpacks of
    it, or ops of the block's replay closure that read it and have not run; then it is dropped.
    The counts start afresh for each graph task (``backward(retain_graph=True)`` twice, double
    backward) and may only free early: correctness never depends on them, because everything
    backward can ask for is rebuildable from the *pinned* values, which live as long as the
    replayer (externals and keep-only outputs the producers of kept values need included).
R3. An in-place op is replayed on its own copy whenever the tensor it writes (or any alias of that
    storage) is still needed by someone else, so no cached or held value is ever clobbered.
R4. A held value that aliases a tensor outside the recording (a block input or a view of one, a
    parameter, a kept value the caller can reach) is checked against its version carrier
    (recorder invariant 7) right before replay reads it, and only then: a kept value that changed
    is dropped and rebuilt; a pinned one cannot be, and the unpack fails with autograd's message.
R5. Replay runs the recorded overloads with grad and autocast off; random ops restore their
    recorded generator state and put the current one back afterwards. Double backward needs no
    graph inside the replayed values: autograd reattaches each unpacked value's own grad edge.
R6. On verification forwards every saved handle carries a fingerprint of the tensor autograd
    saved (recorder's :meth:`~tapesac.recorder.Recorder._fingerprint`). A value replay rebuilt
    (not one it held) is compared with it before autograd gets it; bytes that differ mean a
    write the tape did not see (a kernel outside the dispatcher writing an existing tensor): the
    unpack fails with a :class:`ReplayError` naming the producer, and ``on_mismatch`` makes that
    producer keep-only for the block's later forwards.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from .errors import ReplayError, modified_error
from .tape import EXTERNAL, PRODUCED, UNSEEN, Ref, TapeOp, flatten_outputs
from .verify import Verification, comparable
from .walk import producer_ops

if TYPE_CHECKING:
    from .handoff import Recording

Tensor = torch.Tensor

def _resolve(a: Any, lookup) -> Any:
    if type(a) is Ref:
        return lookup(a.vid)
    if type(a) is list and a and any(type(x) is Ref for x in a):
        return [lookup(x.vid) if type(x) is Ref else x for x in a]
    return a


def _storage_ptr(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -id(t)


def _clone_storage(t: Tensor) -> Tensor:
    """A copy of ``t``'s whole storage, viewed exactly as ``t`` (same offset and strides)."""
    st = t.untyped_storage().clone()
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(st, t.storage_offset(), t.size(), t.stride())


@contextlib.contextmanager
def _replay_mode():
    """Grad and autocast off: the recorded overloads already carry the forward's casts (inv. R5)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield



class _ArgTemplate:
    """A tape op's positional arguments as a list to copy, and where its tensors go."""

    __slots__ = ("base", "refs", "lists", "call")

    def __init__(self, op: TapeOp) -> None:
        self.call = getattr(op.func, "_op", op.func)
        """The overload's C++ callable (an ``OpOverload`` call is one Python frame around it)."""
        self.base = list(op.args)
        self.refs = tuple((pos, a.vid) for pos, a in enumerate(op.args) if type(a) is Ref)
        self.lists = tuple((pos, tuple(a)) for pos, a in enumerate(op.args)
                           if type(a) is list and any(type(x) is Ref for x in a))


class ReplayProgram:
    """What replaying one recording needs that depends only on its tape and which values it
    holds: made once per recording, or once for every forward that follows one tape."""

    __slots__ = ("reads", "closure_ops", "rc", "pinned", "kept", "templates", "producer", "deps")

    def __init__(self, tape, held: dict[int, Tensor]) -> None:
        values = tape.values
        reads = tape.read_vids()
        self.reads = reads
        """Values autograd saved for backward."""
        self.closure_ops = tape.producer_closure(reads, held)
        rc: Counter[int] = Counter()
        for vid in reads:
            rc[vid] += values[vid].reads
        for i in self.closure_ops:
            for d in tape.ops[i].deps:
                rc[d] += 1
        self.rc = dict(rc)
        """vid -> uses still to come in one backward pass (invariant R2)."""
        fixed = {vid for vid in held if not tape.rebuildable(vid)}
        # Invariant R2: a kept value may be dropped and asked for again, so pin what rebuilding
        # everything backward reads without any kept value needs.
        needed = set(reads)
        for i in tape.producer_closure(reads, fixed):
            needed.update(tape.ops[i].deps)
        self.pinned = tuple(vid for vid in held if vid in fixed and vid in needed)
        self.kept = tuple(vid for vid in held if vid not in fixed and vid in rc)
        self.templates: dict[int, _ArgTemplate] = {}
        """op index -> argument template, made at the op's first replay."""
        ops = tape.ops
        self.producer = [v.op if v.kind == PRODUCED and v.op >= 0 and ops[v.op].keep_only is None else -1
                         for v in values]
        """vid -> the op that makes it again, -1 where replay cannot (an unpack's walk, R1). Unlike
        :meth:`~tapesac.tape.Tape.rebuildable`, views of externals count: they are always held, and
        a walk that meets one is served from the hold first."""
        self.deps = [op.deps for op in tape.ops]
        """op index -> the values it reads."""


class Replayer(Verification):
    """Replay state of one recorded forward; lives exactly as long as its saved handles."""

    def __init__(self, recording: "Recording", program: "ReplayProgram | None" = None) -> None:
        """``program``: the recording's :class:`ReplayProgram` if the caller has made it."""
        tape = recording.tape
        self.tape = tape
        self.block = recording.block
        self.owned_vids = recording.owned_vids
        self.stats = None
        """The block's replay counts (``ops_replayed``, ``recomputed_bytes``), updated in place while
        replaying (set by the block)."""
        held = recording.held
        verified = recording.verified
        if program is None and verified is not None:
            program = verified.program
        if program is None:
            program = ReplayProgram(tape, held)
            if verified is not None:
                verified.program = program  # forwards that follow one tape hold the same values
        self.program = program
        self.closure_ops = program.closure_ops
        """Ops replay runs when every kept value is available (the plan's recompute)."""
        self.pinned: dict[int, Tensor] = {vid: held[vid] for vid in program.pinned}
        """Held values replay cannot rebuild (externals, snapshots, keep-only outputs, free views)."""
        self.kept: dict[int, Tensor] = {vid: held[vid] for vid in program.kept}
        """Held values replay could rebuild; kept by the policy and dropped at their last use, as
        the cache drops rebuilt ones."""
        self._versions = {vid: w for vid, w in recording.versions.items()
                          if vid in self.pinned or vid in self.kept}
        """vid -> (version carrier, version) of held values that alias outside tensors (inv. R4)."""
        self._rng = recording.rng
        self._args = recording.args
        self._prepared: dict[int, _ArgTemplate] = program.templates
        """Where this forward's generator states and constants differ from the tape's."""
        self.debug_refs = recording.debug_refs
        self.device = next(iter(held.values())).device if held else torch.device("cpu")
        """Where the block ran (for messages)."""
        self._rc0 = program.rc
        self.rc = dict(program.rc)
        self.cache: dict[int, Tensor] = dict(self.pinned)
        self.cache.update(self.kept)
        self._task: int | None = None
        """The graph task of the current pass (invariant R2); None before the first unpack."""
        self.on_unpack = None
        """Memory tracing: called with the value's id at the start of every unpack."""
        self.fingerprints = comparable(tape, recording.fingerprints, held, self.device)
        """Verification forwards: vid -> fingerprint of what autograd saved (invariant R6)."""
        self.handles = recording.handles
        """Weak references to the forward's saved handles (verification forwards only)."""
        self.checks = [False, False]
        """Verification forwards: [backward unpacked from it, a difference found]; shared
        with whoever waits for this replayer's verdict (it outlives the replayer)."""
        self.on_mismatch = None
        """A weak method called with the op index whose replayed value differed from its
        fingerprint (invariant R6); weak, so no cycle runs through the block's state."""
        recording.link.replayer = self  # the handles reach the replayer; nothing here points back

    # Accounting -------------------------------------------------------------------------------

    def release_kept(self) -> None:
        """Drop every kept value now; replay rebuilds any that backward still asks for (what it
        needs for that is pinned, invariant R2). Planned mode calls this when a step leaves the
        plan it started under."""
        for vid in list(self.kept):
            self._drop(vid)

    def kept_bytes(self) -> int:
        """Bytes of distinct storages held for backward that the block itself produced."""
        seen: dict[int, int] = {}
        values = self.tape.values
        for vid, t in list(self.pinned.items()) + list(self.kept.items()):
            v = values[vid]
            if v.kind == EXTERNAL or v.free:
                continue
            seen[_storage_ptr(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def unseen_bytes(self) -> int:
        """Bytes of distinct storages held because no recorded op wrote them (recorder
        invariant 10) or their replay differed once (invariant R6)."""
        seen: dict[int, int] = {}
        tape = self.tape
        values, ops = tape.values, tape.ops
        for vid, t in self.pinned.items():
            v = values[vid]
            if tape.produced(vid) and ops[v.op].keep_only == UNSEEN:
                seen[_storage_ptr(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def fingerprint_bytes(self) -> int:
        """Bytes of the fingerprints a verification forward holds until backward (invariant R6):
        TapeSAC's own memory, alive with the kept values."""
        return sum(fp.untyped_storage().nbytes() for fp in self.fingerprints.values()) if self.fingerprints else 0

    def input_bytes(self) -> int:
        """Bytes of distinct non-parameter external storages held (the block's checkpoint)."""
        seen: dict[int, int] = {}
        values = self.tape.values
        for vid, t in self.pinned.items():
            v = values[vid]
            if v.kind == EXTERNAL and vid not in self.owned_vids:
                seen[_storage_ptr(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())

    # Unpack -----------------------------------------------------------------------------------

    def _new_pass(self, task: int) -> None:
        """A graph task's first unpack: the counts start again (invariant R2)."""
        self._task = task
        self.rc = dict(self._rc0)
        if self.stats is not None:
            self.stats["ops_replayed"] = 0
            self.stats["recomputed_bytes"] = 0

    def unpack(self, vid: int) -> Tensor:
        task = torch._C._current_graph_task_id()
        if task != self._task or self._task is None:
            self._new_pass(task)
        if self.on_unpack is not None:
            self.on_unpack(vid)
        fp = self.fingerprints.get(vid) if self.fingerprints else None
        rebuilt = fp is not None and vid not in self.pinned and vid not in self.kept
        t = self._available(vid)
        if t is None:
            t = self._materialize(vid)
        if rebuilt:
            self._verify(vid, t, fp)
        self.checks[0] = True
        self._release(vid)
        if self.debug_refs is not None:
            self._check(vid, t)
        return t

    def _available(self, vid: int) -> Tensor | None:
        """The cached value, if it is still what the forward made (invariant R4)."""
        t = self.cache.get(vid)
        if t is None:
            return None
        w = self._versions.get(vid)
        if w is not None and w[0]._version != w[1]:
            if vid in self.kept:  # changed by the caller after forward: make it again
                self._drop(vid)
                return None
            raise self._modified(vid, w[0], w[1])
        return t

    def _modified(self, vid: int, carrier: Tensor, version: int) -> ReplayError:
        v = self.tape.values[vid]
        if v.kind == EXTERNAL:
            what = "a block input, parameter or buffer"
        elif v.free:
            what = f"a view of a block input made by op {v.op} ({self.tape.op_name(v.op)})"
        else:
            what = f"the output of op {v.op} ({self.tape.op_name(v.op)}), which is never recomputed"
        return modified_error(v.dtype, carrier.device, v.shape, carrier._version, version, self.block,
                              recomputes=f"value %{vid}, {what}")

    def _drop(self, vid: int) -> None:
        """Forget a value that is not pinned; what is needed again is rebuilt (invariant R2)."""
        self.cache.pop(vid, None)
        if self.kept.pop(vid, None) is not None:
            self._versions.pop(vid, None)

    def _release(self, vid: int) -> None:
        n = self.rc.get(vid, 0) - 1
        self.rc[vid] = n
        if n <= 0 and vid not in self.pinned:
            self._drop(vid)

    def _check(self, vid: int, t: Tensor) -> None:
        ref = self.debug_refs.pop(vid, None)
        if ref is None:
            return
        v = self.tape.values[vid]
        if ref.shape != t.shape or ref.dtype != t.dtype or not torch.equal(ref, t):
            where = f"op {v.op} ({self.tape.op_name(v.op)}) slot {v.slot}" if v.op >= 0 else "an input"
            raise ReplayError(
                f"TapeSAC block {self.block}: the recomputed value %{vid} from {where} differs from "
                f"the forward's (shape {list(t.shape)} vs {list(ref.shape)}, dtype {t.dtype} vs "
                f"{ref.dtype}). The op is not deterministic on replay; keep its output in the policy."
            )

    def _materialize(self, vid: int) -> Tensor:
        tape = self.tape
        ops = tape.ops
        local: dict[int, Tensor] = {}
        """This chain's values still to be read: its inputs from the cache (invariant R1) and what
        it made."""
        available = self._available

        def fetched(u: int) -> bool:
            t = available(u)
            if t is None:
                return False
            local[u] = t
            return True

        program = self.program
        producer = program.producer

        def op_of(u: int) -> int:
            o = producer[u]
            if o < 0:
                raise ReplayError(
                    f"TapeSAC block {self.block}: value %{u} is needed again but is neither held nor "
                    "replayable. This is a bug in TapeSAC (invariant R2): please report it with the block"
                )
            return o

        order = sorted(producer_ops((vid,), op_of, program.deps.__getitem__, fetched))
        pending: dict[int, int] = {}
        """vid -> reads by ops of this chain that have not run."""
        get = pending.get
        for i in order:
            for d in ops[i].deps:
                pending[d] = get(d, 0) + 1
        prepared = self._prepared
        args_over = self._args
        with _replay_mode():
            for i in order:
                op = ops[i]
                if op.writes or op.rng is not None or i in args_over:
                    self._run(i, op, local, pending, vid)
                    continue
                # The common op (no write, no generator, the tape's constants): arguments from a
                # template made once per tape op.
                prep = prepared.get(i)
                if prep is None:
                    prep = prepared[i] = _ArgTemplate(op)
                args = prep.base.copy()
                for pos, d in prep.refs:
                    args[pos] = local[d]
                for pos, items in prep.lists:
                    args[pos] = [local[x.vid] if type(x) is Ref else x for x in items]
                kwargs = {k: _resolve(a, local.__getitem__) for k, a in op.kwargs.items()} if op.kwargs else {}
                for d in op.deps:
                    pending[d] -= 1
                self._finish_op(op, prep.call(*args, **kwargs), None, local, pending, vid)
        return local[vid]

    def _run(self, i: int, op: TapeOp, local: dict[int, Tensor], pending: dict[int, int], target: int) -> None:
        """Run one op of an unpack's chain that writes, draws random numbers or has this forward's
        own constants; ``local`` holds this chain's values still to be read."""
        lookup = local.__getitem__
        op_args, op_kwargs = self._args[i] if i in self._args else (op.args, op.kwargs)
        args = [_resolve(a, lookup) for a in op_args]
        kwargs = {k: _resolve(a, lookup) for k, a in op_kwargs.items()} if op_kwargs else {}
        for d in op.deps:
            pending[d] -= 1
        stats = self.stats
        write_out: dict[int, Tensor] = {}
        for before, after in op.writes:
            t = lookup(before)
            if op.inplace_view:
                copy = torch.ops.aten.alias.default(t)
            elif self._shared(before, t, local, pending):
                copy = _clone_storage(t)
                if stats is not None:
                    stats["recomputed_bytes"] += copy.untyped_storage().nbytes()
            else:
                copy = None
            if copy is not None:
                _swap(args, kwargs, t, copy)
                t = copy
            else:  # written in place: the old version is gone (invariant R3 said nobody needs it)
                local.pop(before, None)
                self._drop(before)
            write_out[after] = t

        rng = self._rng.get(i, op.rng) if op.rng is not None else None
        if rng is not None:
            gen, state = rng
            current = gen.get_state()
            gen.set_state(state)
            try:
                out = op.func(*args, **kwargs)
            finally:
                gen.set_state(current)
        else:
            out = op.func(*args, **kwargs)
        self._finish_op(op, out, write_out, local, pending, target)

    def _finish_op(self, op: TapeOp, out: Any, write_out: dict[int, Tensor], local: dict[int, Tensor],
                   pending: dict[int, int], target: int) -> None:
        """Keep what a replayed op made while it is needed; let go of what it was the last to read."""
        cache = self.cache
        rc = self.rc
        pinned = self.pinned
        stats = self.stats
        if stats is not None:
            stats["ops_replayed"] += 1
            stats["recomputed_bytes"] += op.alloc_bytes  # the same op allocated as much in the forward
        flat = out if type(out) is Tensor else flatten_outputs(out)
        for slot, vid in enumerate(op.outs):
            if vid is None:
                continue
            t = write_out.get(vid) if write_out else None
            if t is None:
                t = flat if type(flat) is Tensor else flat[slot]
            if pending.get(vid, 0) > 0 or vid == target:
                local[vid] = t
            if rc.get(vid, 0) > 0 and vid not in pinned:
                cache[vid] = t
        for d in op.deps:
            n = rc.get(d, 0) - 1
            rc[d] = n
            if n <= 0 and d not in pinned:
                self._drop(d)
            if pending[d] <= 0 and d != target:
                local.pop(d, None)

    def _shared(self, vid: int, t: Tensor, local: dict, pending: dict[int, int]) -> bool:
        """Invariant R3: would writing ``t`` in place clobber something still needed?"""
        if vid in self.pinned or vid in self.kept or self.rc.get(vid, 0) > 1 or pending.get(vid, 0) > 0:
            return True
        ptr = _storage_ptr(t)
        for other in (self.cache, local):
            for ovid, o in other.items():
                if ovid != vid and o is not t and _storage_ptr(o) == ptr:
                    return True
        return False


def _swap(args: list, kwargs: dict, old: Tensor, new: Tensor) -> None:
    """Replace every occurrence of ``old`` that is a written argument by ``new`` (in place)."""
    for i, a in enumerate(args):
        if a is old:
            args[i] = new
        elif type(a) is list:
            args[i] = [new if x is old else x for x in a]
    for k, a in kwargs.items():
        if a is old:
            kwargs[k] = new
        elif type(a) is list:
            kwargs[k] = [new if x is old else x for x in a]
