"""Serve autograd's unpacks for one recorded block forward by rerunning only what is needed.

Invariants (numbered as in recorder.py's, continued):

8. An unpack runs only the producer chain of the asked value that is not already available
   (held, or cached by an earlier unpack). Values backward never unpacks are never rebuilt.
   The chain's inputs taken from the cache are referenced by the chain itself while it runs.
9. A rebuilt (or kept) value stays cached while something may still need it: pending unpacks of
   it, or ops of the block's replay closure that read it and have not run; then it is dropped.
   The counts start afresh for each graph task (``backward(retain_graph=True)`` twice, double
   backward) and may only free early: correctness never depends on them, because everything
   backward can ask for is rebuildable from the *pinned* values, which live as long as the
   replayer (externals and keep-only outputs the producers of kept values need included).
10. An in-place op is replayed on its own copy whenever the tensor it writes (or any alias of that
    storage) is still needed by someone else, so no cached or held value is ever clobbered.
11. A held value that aliases a tensor outside the recording (a block input or a view of one, a
    parameter, a kept value the caller can reach) is checked against its version carrier
    (recorder invariant 7) right before replay reads it, and only then: a kept value that changed
    is dropped and rebuilt; a pinned one cannot be, and the unpack fails with autograd's message.
12. Replay runs the recorded overloads with grad and autocast off; random ops restore their
    recorded generator state and put the current one back afterwards. Double backward needs no
    graph inside the replayed values: autograd reattaches each unpacked value's own grad edge.
13. On verification forwards every saved handle carries a fingerprint of the tensor autograd
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

from .errors import ReplayError
from .kernels import fingerprint
from .ops import op_info
from .tape import EXTERNAL, PRODUCED, UNSEEN, Ref, TapeOp, flatten_outputs

if TYPE_CHECKING:
    from .recorder import Recording

Tensor = torch.Tensor

AUTOGRAD_MODIFIED = ("one of the variables needed for gradient computation has been modified by an "
                     "inplace operation")
"""Autograd's own words for a saved tensor changed in place, so callers match one message."""

_LEGACY_TYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                 torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
                 torch.int64: "Long", torch.bool: "Bool"}


def _type_string(dtype: torch.dtype, device: torch.device) -> str:
    """The tensor type as autograd's message prints it (``torch.FloatTensor``, ``CPUBFloat16Type``)."""
    legacy = _LEGACY_TYPES.get(dtype)
    if legacy is not None and device.type in ("cpu", "cuda"):
        return f"torch.{'cuda.' if device.type == 'cuda' else ''}{legacy}Tensor"
    name = torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    return f"{device.type.upper()}{name}Type"


def modified_error(dtype: torch.dtype, device: torch.device, shape: Any, current: int, expected: int,
                   block: int, recomputes: str | None = None) -> ReplayError:
    """Autograd's error for a saved tensor changed in place, raised by TapeSAC on its behalf.

    ``recomputes`` says what replay rebuilds from the tensor, when autograd itself never reads it.
    """
    msg = (f"{AUTOGRAD_MODIFIED}: [{_type_string(dtype, device)} {list(shape)}] is at version "
           f"{current}; expected version {expected} instead.")
    if recomputes is None:
        return ReplayError(
            f"{msg} Hint: enable anomaly detection to find the operation that failed to compute its "
            "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False). (Checked by "
            f"TapeSAC block {block} for autograd, which cannot check tensors saved under its hooks.)"
        )
    return ReplayError(
        f"{msg} TapeSAC block {block} recomputes saved values from this tensor ({recomputes}) in "
        "backward, so it must not change between the block's forward and backward: clone it "
        "before updating it in place, or update a copy."
    )


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
    """Grad and autocast off: the recorded overloads already carry the forward's casts (inv. 12)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield


def rebuildable(tape, vid: int) -> bool:
    """Replay can make this value again: produced by a replayable op, aliasing no external."""
    v = tape.values[vid]
    return v.kind == PRODUCED and not v.free and tape.ops[v.op].keep_only is None



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

    __slots__ = ("reads", "closure_ops", "rc", "pinned", "kept", "templates")

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
        """vid -> uses still to come in one backward pass (invariant 9)."""
        fixed = {vid for vid in held if not rebuildable(tape, vid)}
        # Invariant 9: a kept value may be dropped and asked for again, so pin what rebuilding
        # everything backward reads without any kept value needs.
        needed = set(reads)
        for i in tape.producer_closure(reads, fixed):
            needed.update(tape.ops[i].deps)
        self.pinned = tuple(vid for vid in held if vid in fixed and vid in needed)
        self.kept = tuple(vid for vid in held if vid not in fixed and vid in rc)
        self.templates: dict[int, _ArgTemplate] = {}
        """op index -> argument template, made at the op's first replay."""


class Replayer:
    """Replay state of one recorded forward; lives exactly as long as its saved handles."""

    def __init__(self, recording: "Recording", program: "ReplayProgram | None" = None) -> None:
        """``program``: the recording's :class:`ReplayProgram` if the caller has made it."""
        tape = recording.tape
        self.tape = tape
        self.block = recording.block
        self.owned_vids = recording.owned_vids
        self.stats = None
        """The block's stats dict, updated in place while replaying (set by the wrapper)."""
        held = recording.held
        plan = recording.plan
        if program is None and plan is not None:
            program = plan.program
        if program is None:
            program = ReplayProgram(tape, held)
            if plan is not None:
                plan.program = program  # forwards that follow one plan hold the same values
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
        """vid -> (version carrier, version) of held values that alias outside tensors (inv. 11)."""
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
        """The graph task of the current pass (invariant 9); None before the first unpack."""
        self.on_unpack = None
        """Memory tracing: called with the value's id at the start of every unpack."""
        self.fingerprints = _comparable(tape, recording.fingerprints, held, self.device)
        """Verification forwards: vid -> fingerprint of what autograd saved (invariant 13)."""
        self.handles = recording.handles
        """Weak references to the forward's saved handles (verification forwards only)."""
        self.checks = [False, False]
        """Verification forwards: [backward unpacked from it, a difference found]; shared
        with whoever waits for this replayer's verdict (it outlives the replayer)."""
        self.on_mismatch = None
        """A weak method called with the op index whose replayed value differed from its
        fingerprint (invariant 13); weak, so no cycle runs through the block's state."""
        recording.link.replayer = self  # the handles reach the replayer; nothing here points back

    # Accounting -------------------------------------------------------------------------------

    def release_kept(self) -> None:
        """Drop every kept value now; replay rebuilds any that backward still asks for (what it
        needs for that is pinned, invariant 9). Planned mode calls this when a step leaves the
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
        invariant 10) or their replay differed once (invariant 13)."""
        seen: dict[int, int] = {}
        values, ops = self.tape.values, self.tape.ops
        for vid, t in self.pinned.items():
            v = values[vid]
            if v.kind == PRODUCED and ops[v.op].keep_only == UNSEEN and not v.free:
                seen[_storage_ptr(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())

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
        """A graph task's first unpack: the counts start again (invariant 9)."""
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

    def _differs(self, t: Tensor, fp: Tensor) -> bool:
        with torch._C._DisableTorchDispatch():
            now = fingerprint(t)
            return now is not None and not bool(torch.equal(now, fp))

    def _explain_by_versions(self) -> None:
        """A rebuilt value differs because a tensor it was made from changed in place where
        autograd's version counters saw it: raise what autograd would raise for that instead."""
        for vid, (carrier, version) in self._versions.items():
            if carrier._version != version:
                raise self._modified(vid, carrier, version)
        for ref in self.handles:
            h = ref()
            if h is None:
                continue
            if not hasattr(h, "family"):  # left as it is (AsIs): the tensor itself
                t = h.tensor
                if t._version != h.version:
                    raise modified_error(t.dtype, t.device, t.shape, t._version, h.version, self.block)
                continue
            current = h.final if h.family is None else h.family._version
            if current is not None and current != h.version:
                v = self.tape.values[h.vid]
                raise modified_error(v.dtype, self.device, v.shape, current, h.version, self.block)

    def _describe(self, vid: int) -> str:
        """``op 3 (aten.view.default, a view of op 2 aten.addmm.default) slot 0, shape [...]``."""
        tape, values = self.tape, self.tape.values
        v = values[vid]
        name = tape.op_name(v.op)
        base = v
        while base.op >= 0 and op_info(tape.ops[base.op].func).view_of is not None and tape.ops[base.op].deps:
            base = values[tape.ops[base.op].deps[0]]
        if base is not v and base.op >= 0:
            name += f", a view of op {base.op} {tape.op_name(base.op)}"
        return f"op {v.op} ({name}) slot {v.slot}, shape {list(v.shape)} {v.dtype}"

    def _verify(self, vid: int, t: Tensor, fp: Tensor) -> None:
        """Invariant 13: a rebuilt value has the bytes autograd saved, or the unpack fails.

        On a difference, every fingerprinted value replay can rebuild is checked, and the ones
        that differ while nothing they are rebuilt from does are blamed: their producers are
        made keep-only for the block's next forwards, so one failure covers them all."""
        if not self._differs(t, fp):
            return
        self.checks[1] = True
        self._explain_by_versions()
        tape = self.tape
        values = tape.values
        differ = {vid}
        originals = set(self.pinned) | set(self.kept)
        for u in sorted(self.fingerprints):
            if u == vid or u in originals or any(
                    op_info(tape.ops[i].func).collective for i in tape.producer_closure([u], originals)):
                continue  # a collective would run on this rank alone
            try:
                other = self._available(u)
                if other is None:
                    other = self._materialize(u)
            except ReplayError:
                continue
            if self._differs(other, self.fingerprints[u]):
                differ.add(u)
        roots = []
        for u in sorted(differ):
            made = {o for i in tape.producer_closure([u], originals) for o in tape.ops[i].outs if o is not None}
            if not (made - {u}) & differ:
                roots.append(u)
        notify = self.on_mismatch() if self.on_mismatch is not None else None
        if notify is not None:
            for u in roots:
                notify(values[u].op)
        where = "; ".join(self._describe(u) for u in roots)
        raise ReplayError(
            f"TapeSAC block {self.block}: replay rebuilt other bytes than the forward saved, first "
            f"from {where}: something wrote {'it' if len(roots) == 1 else 'them'} where the dispatcher "
            "could not see (a Triton or CUDA-extension kernel, numpy, ctypes). Register that kernel "
            "as a torch.library custom op (or launch it as a Triton kernel, which TapeSAC records), "
            "or let TapeSAC keep the value: from the block's next forward on, those outputs are "
            "kept, never rebuilt, so later steps are exact. (A kernel whose results differ from run "
            "to run, such as one with atomic adds, differs here too: make it deterministic, or keep "
            "its outputs.)")

    def _available(self, vid: int) -> Tensor | None:
        """The cached value, if it is still what the forward made (invariant 11)."""
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
        """Forget a value that is not pinned; what is needed again is rebuilt (invariant 9)."""
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
        values = tape.values
        local: dict[int, Tensor] = {}
        """This chain's values still to be read: its inputs from the cache (invariant 8) and what
        it made."""
        to_run: set[int] = set()
        seen: set[int] = set()
        stack = [vid]
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            t = self._available(u)
            if t is not None:
                local[u] = t
                continue
            v = values[u]
            if v.kind != PRODUCED or v.op < 0 or ops[v.op].keep_only is not None:
                raise ReplayError(
                    f"TapeSAC block {self.block}: value %{u} is needed again but is neither held nor "
                    "replayable. This is a bug in TapeSAC (invariant 9): please report it with the block"
                )
            if v.op not in to_run:
                to_run.add(v.op)
                stack.extend(ops[v.op].deps)
        order = sorted(to_run)
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
            else:  # written in place: the old version is gone (invariant 10 said nobody needs it)
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
        """Invariant 10: would writing ``t`` in place clobber something still needed?"""
        if vid in self.pinned or vid in self.kept or self.rc.get(vid, 0) > 1 or pending.get(vid, 0) > 0:
            return True
        ptr = _storage_ptr(t)
        for other in (self.cache, local):
            for ovid, o in other.items():
                if ovid != vid and o is not t and _storage_ptr(o) == ptr:
                    return True
        return False


def _comparable(tape, fingerprints: dict, held: dict, device: torch.device) -> dict:
    """The fingerprints replay can be held to (invariant 13): on a GPU, unless deterministic
    algorithms are on, not those of values whose rebuild runs an op tagged
    ``nondeterministic_bitwise`` (``index_add_``, ``scatter_add_`` accumulate in another order
    each run): a difference there is not a write TapeSAC missed."""
    if not fingerprints or device.type == "cpu" or torch.are_deterministic_algorithms_enabled():
        return fingerprints
    tag = torch.Tag.nondeterministic_bitwise
    kept = set(held)
    return {vid: fp for vid, fp in fingerprints.items()
            if not any(tag in getattr(tape.ops[i].func, "tags", ()) for i in tape.producer_closure([vid], kept))}


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
