"""Record one block forward at the dispatcher, and decide what autograd's saved tensors become.

During a wrapped block's forward two things are active:

* :class:`Recorder`, a ``TorchDispatchMode`` that appends every ATen op (post-autocast, post
  decomposition) to a :class:`~tapesac.tape.Tape`;
* ``saved_tensors_hooks(recorder.pack, unpack_saved)``: a tensor the block produced is packed as
  a small :class:`Saved` handle instead of the tensor, so autograd does not keep it alive.

When the forward returns, :meth:`Recorder.finalize` hands a plain :class:`Recording` (the tape and
the few tensors backward needs) to a :class:`~tapesac.replay.Replayer`, which owns it from then
on. Data flows one way: the handles reach the replayer through a :class:`ReplayLink`, never back
into the recorder, which is dropped.

Invariants the recorder keeps (each is relied on by replay):

1. Tensors are mapped to values by identity (``id`` plus a weak reference), never by order.
2. Every value backward may need is either *held* (a detached tensor kept here: externals,
   outputs of keep-only ops, values the policy keeps, views of externals) or PRODUCED by a
   replayable op whose arguments satisfy the same rule.
3. A held tensor is never the target of a later in-place write: before an op writes a storage,
   held values in it are copied (externals, keep-only outputs) or dropped back to replay (the rest).
4. Each version of a mutated tensor is its own value; a tensor read after another alias of its
   storage was written becomes a new value aliasing the written storage.
5. Random ops carry their generator state, so replay draws the same numbers.
6. Nothing here references autograd nodes: held tensors are detached, so no reference cycle
   runs through the graph (pytorch#154642), and the tape holds no tensors at all. Handles point
   at a :class:`ReplayLink`, which points at the replayer and at nothing that points back.
7. Autograd skips its saved-tensor version check when saved-tensor hooks are active, so TapeSAC
   takes it over: every packed tensor carries the version it was saved at (checked at unpack with
   autograd's message), and every held value that aliases a tensor outside the recording gets a
   version carrier: a detach of the original made outside the dispatch mode (a detach made below
   autograd gets a counter of its own), so replay can check it before reading it (replay's
   invariant 11). A held value the block itself overwrites is copied or dropped (invariant 3)
   and needs no carrier.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ReplayError
from .replay import modified_error
from .ops import generator_for, keep_only_reason, op_info, written_tensors
from .tape import EXTERNAL, PRODUCED, SNAPSHOT, Ref, Tape, TapeOp, flatten_outputs

Tensor = torch.Tensor


def storage_alias(src: Tensor, dtype: torch.dtype, size: tuple, stride: tuple, offset: int) -> Tensor:
    """A tensor with the given view metadata over ``src``'s storage (replays rule 4 above)."""
    return torch.empty((0,), dtype=dtype, device=src.device).set_(src.untyped_storage(), offset, size, stride)


class ReplayLink:
    """What a forward's saved handles point at: its block, and its replayer once forward returned."""

    __slots__ = ("block", "replayer")

    def __init__(self, block: int) -> None:
        self.block = block
        self.replayer = None


class Saved:
    """What autograd stores instead of a block-produced tensor: the value, and what autograd's
    version check needs (invariant 7)."""

    __slots__ = ("link", "vid", "family", "version", "final")

    def __init__(self, link: ReplayLink, vid: int, t: Tensor) -> None:
        self.link = link
        self.vid = vid
        base = t._base
        self.family: Any = weakref.ref(t if base is None else base)
        """During the forward, a weak reference to the saved tensor's view family (views share
        their base's version counter and keep it alive); afterwards a storage-free tensor sharing
        that counter, or None once nothing can write the family any more."""
        self.version = t._version
        self.final: int | None = None
        """The family's version when it became unreachable (family is None)."""

    def settle(self, tape: Tape, last_versions: dict[int, int]) -> None:
        """Forward is done: keep the family's version counter, not its memory (invariant 7).

        ``last_versions``: sid -> the version of the last value recorded in that storage.
        """
        family = self.family()
        if family is not None:
            self.family = version_carrier(family)
        else:  # unreachable since before the forward returned: only the block could write it
            self.family = None
            self.final = last_versions[tape.values[self.vid].sid]


def version_carrier(t: Tensor) -> Tensor:
    """An empty tensor sharing ``t``'s version counter (call it outside the dispatch mode)."""
    carrier = t.detach()
    version = carrier._version
    if hasattr(carrier, "_local_tensor"):  # a DTensor (no ``set_``): drop its shard instead
        carrier._local_tensor = carrier._local_tensor.new_empty(0)
        return carrier
    carrier.set_()  # drops the storage, and bumps the shared counter: put it back
    torch._C._autograd._unsafe_set_version_counter((carrier,), (version,))
    return carrier


class AsIs:
    """A saved tensor TapeSAC leaves as it is (inputs, parameters), with its version when saved."""

    __slots__ = ("link", "tensor", "version")

    def __init__(self, link: ReplayLink, t: Tensor) -> None:
        self.link = link
        self.tensor = t.detach()  # made at autograd level: shares t's version counter
        self.version = t._version


def unpack_saved(obj: Any) -> Any:
    """The unpack hook: check the version as autograd would, then rebuild or fetch the value."""
    kind = type(obj)
    if kind is Saved:
        replayer = obj.link.replayer
        if replayer is None:
            raise ReplayError(
                f"TapeSAC block {obj.link.block}: backward asked for a saved value before the "
                "block's forward returned (autograd.grad inside the block's forward is not supported); "
                "unwrap this block or move the inner backward out of it"
            )
        family = obj.family
        current = obj.final if family is None else family._version
        if current is not None and current != obj.version:
            v = replayer.tape.values[obj.vid]
            raise modified_error(v.dtype, replayer.device, v.shape, current, obj.version, obj.link.block)
        return replayer.unpack(obj.vid)
    if kind is AsIs:
        t = obj.tensor
        if t._version != obj.version:
            raise modified_error(t.dtype, t.device, t.shape, t._version, obj.version, obj.link.block)
        return t
    return obj


@dataclasses.dataclass(eq=False)
class Recording:
    """One recorded block forward, handed from the recorder to replay, which then owns it."""

    block: int
    tape: Tape
    held: dict[int, Tensor]
    """vid -> detached tensor kept for backward (invariant 2)."""
    versions: dict[int, tuple[Tensor, int]]
    """vid -> (version carrier, version) for held values that alias tensors outside the recording
    (invariant 7): replay checks the carrier's ``_version`` before it reads the value."""
    owned_vids: set[int]
    """Externals that are the block's own parameters and buffers (not counted as inputs)."""
    debug_refs: dict[int, Tensor] | None
    """Debug mode: vid -> the forward's tensor, to compare the replayed value with."""
    link: ReplayLink
    """What the forward's :class:`Saved` handles point at; the replayer binds itself to it."""


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    return None


def _version_of(args: tuple, pos: int, default: Tensor) -> int:
    base = args[pos] if pos < len(args) else None
    return base._version if isinstance(base, Tensor) else default._version


def _copy(t: Tensor) -> Tensor:
    return t.clone(memory_format=torch.preserve_format)


_DETACH = torch.ops.aten.detach.default


class ProgramCheck(TorchDispatchMode):
    """Runs a block unrecorded (pass-through) and hashes the ATen overloads it dispatches, with
    the recorder's rule for what reaches a tape (an op that returns no tensor and writes nothing
    does not): equal to :meth:`Tape.program_hash` of the same program, at a fraction of the cost
    of recording (one hash per op, nothing held)."""

    def __init__(self) -> None:
        super().__init__()
        self.program_hash = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _DETACH:  # see Tape.program_hash
            return out
        info = op_info(func)
        if (info.write_args and written_tensors(info, args, kwargs)) or any(
                isinstance(o, Tensor) for o in flatten_outputs(out)):
            self.program_hash = hash((self.program_hash, func))
        return out


class Recorder(TorchDispatchMode):
    """Builds the tape of one block forward; ``pack`` is the matching saved-tensor pack hook."""

    def __init__(self, block: int, keep: frozenset | None = None, debug: bool = False,
                 owned: set[int] | None = None, timer=None) -> None:
        super().__init__()
        self.block = block
        self.timer = timer
        """An :class:`~tapesac.profile.OpTimer` in profiling forwards, else None."""
        self.tape = Tape()
        self.link = ReplayLink(block)
        self.held: dict[int, Tensor] = {}
        """vid -> detached tensor kept for backward (see invariant 2)."""
        self._saved: list[Saved] = []
        self._fresh: list[tuple[int, weakref.ref]] = []
        """Held values of the op being recorded: (vid, weak ref to the original tensor)."""
        self._originals: dict[int, Tensor] = {}
        """vid -> the tensor a held value was detached from, until the forward returns: its
        version carrier is made from it then (invariant 7)."""
        self.debug_refs: dict[int, Tensor] | None = {} if debug else None
        self._keep = keep or frozenset()
        self._owned = owned or set()
        """ids of the block's own parameters and buffers (not counted as inputs)."""
        self.owned_vids: set[int] = set()
        self._ids: dict[int, tuple[weakref.ref, int]] = {}
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._held_by_sid: dict[int, set[int]] = {}
        self._last_write: dict[int, int] = {}
        self._bypass = False
        ref = weakref.ref(self)

        def pack(t: Tensor) -> Any:
            return ref()._pack(t)

        self.pack = pack
        """The pack hook. Autograd keeps it in every saved variable, so it refers to the recorder
        weakly: the graph must not keep the recorder alive (invariant 6)."""

    # Identity maps --------------------------------------------------------------------------

    def _sid(self, t: Tensor) -> int:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
            sid = len(self.tape.storage_nbytes)
            self.tape.storage_nbytes[sid] = t.numel() * t.element_size()
            return sid
        ent = self._storages.get(id(st))
        if ent is not None and ent[0]() is st:
            return ent[1]
        sid = len(self.tape.storage_nbytes)
        self.tape.storage_nbytes[sid] = st.nbytes()
        self._storages[id(st)] = (weakref.ref(st), sid)
        return sid

    def _lookup(self, t: Tensor) -> int | None:
        ent = self._ids.get(id(t))
        if ent is None or ent[0]() is not t:
            return None
        vid = ent[1]
        if t._version != self.tape.values[vid].version:
            vid = self._refresh(t)
        return vid

    def _hold(self, vid: int, t: Tensor) -> None:
        self.held[vid] = t.detach()
        self._fresh.append((vid, weakref.ref(t)))
        self._held_by_sid.setdefault(self.tape.values[vid].sid, set()).add(vid)

    def _external(self, t: Tensor) -> int:
        sid = self._sid(t)
        self.tape.external_sids.add(sid)
        vid = self.tape.add_value(-1, -1, EXTERNAL, t, t._version, sid)
        self._ids[id(t)] = (weakref.ref(t), vid)
        self._hold(vid, t)
        if id(t) in self._owned:
            self.owned_vids.add(vid)
        return vid

    def _produced(self, op: int, slot: int, t: Tensor, version: int, sid: int) -> int:
        vid = self.tape.add_value(op, slot, PRODUCED, t, version, sid)
        self._ids[id(t)] = (weakref.ref(t), vid)
        return vid

    def _refresh(self, t: Tensor) -> int:
        """``t`` was written through another alias of its storage: make its new content a value."""
        sid = self._sid(t)
        src = self._last_write.get(sid)
        if src is None:
            # Written by code the dispatcher never saw: all we can do is hold it as it is now.
            return self._external(t)
        idx = len(self.tape.ops)
        op = TapeOp(storage_alias, (Ref(src), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()),
                    {}, (src,))
        self.tape.ops.append(op)
        vid = self._produced(idx, 0, t, t._version, sid)
        op.outs = [vid]
        op.n_returned = 1
        op.time_s = 0.0
        if (idx, 0) in self._keep:
            self._bypass, bypass = True, self._bypass
            try:
                self._hold(vid, t)
            finally:
                self._bypass = bypass
        return vid

    # Recording ------------------------------------------------------------------------------

    def _encode(self, a: Any, deps: list[int]) -> Any:
        if isinstance(a, Tensor):
            vid = self._lookup(a)
            if vid is None:
                vid = self._external(a)
            deps.append(vid)
            return Ref(vid)
        if isinstance(a, (list, tuple)):
            if any(isinstance(x, Tensor) for x in a):
                return [self._encode(x, deps) for x in a]
            return list(a) if isinstance(a, list) else a
        return a

    def _before_write(self, t: Tensor) -> None:
        """Invariant 3: nothing held may be clobbered by the write about to happen to ``t``."""
        sid = self._sid(t)
        vids = self._held_by_sid.pop(sid, None)
        if not vids:
            return
        values = self.tape.values
        for vid in vids:
            v = values[vid]
            # Either way the held value no longer aliases the tensor the caller sees: nothing to
            # check its version against (invariant 7).
            self._originals.pop(vid, None)
            if v.kind == PRODUCED and self.tape.ops[v.op].keep_only is None:
                del self.held[vid]  # replayable: drop the hold, replay rebuilds this version
                continue
            copy = _copy(self.held[vid])
            new_sid = len(self.tape.storage_nbytes)
            self.tape.storage_nbytes[new_sid] = copy.untyped_storage().nbytes()
            v.kind, v.sid, v.nbytes, v.free = SNAPSHOT, new_sid, self.tape.storage_nbytes[new_sid], False
            self.held[vid] = copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._bypass:
            return func(*args, **kwargs)
        if self._fresh:
            self._settle()
        info = op_info(func)
        deps: list[int] = []
        encode = self._encode
        eargs = tuple([encode(a, deps) for a in args])
        ekwargs = {k: encode(v, deps) for k, v in kwargs.items()} if kwargs else kwargs
        written = written_tensors(info, args, kwargs) if info.write_args else ()
        before = []
        if written:
            for t, _ in written:
                before.append(self._lookup(t))
                if not info.inplace_view:
                    self._before_write(t)
        rng = None
        if info.random:
            gen = generator_for(func, args, kwargs, _device_of(args, kwargs))
            if gen is not None:
                rng = (gen, gen.get_state())

        if self.timer is None:
            out = func(*args, **kwargs)
            elapsed = None
        else:
            out, elapsed = self.timer.call(func, args, kwargs, can_repeat=not written, rng=rng)

        flat = flatten_outputs(out)
        if not written and not any(isinstance(o, Tensor) for o in flat):
            return out
        tape = self.tape
        idx = len(tape.ops)
        op = TapeOp(func, eargs, ekwargs, tuple(deps) if len(deps) < 2 else tuple(dict.fromkeys(deps)))
        op.rng = rng
        op.time_s = elapsed
        op.inplace_view = info.inplace_view
        op.keep_only = (keep_only_reason(info, args) if info.keep_only else None) or (
            "random op on a device without a known generator" if info.random and rng is None else None)
        tape.ops.append(op)
        pending = {id(t): (t, bumps, b) for (t, bumps), b in zip(written, before)} if written else {}
        first_new_sid = len(tape.storage_nbytes)
        writes = []
        outs: list[int | None] = []
        tensors: list[Tensor | None] = []
        for o in flat:
            if not isinstance(o, Tensor):
                outs.append(None)
                tensors.append(None)
                continue
            w = pending.pop(id(o), None)
            if w is not None:
                vid = self._write_value(idx, len(outs), o, w[1] and not info.inplace_view)
                writes.append((w[2], vid))
            else:
                # A view's own counter still reads 0 here; autograd then shares its base's.
                version = o._version if info.view_of is None else _version_of(args, info.view_of, o)
                vid = self._produced(idx, len(outs), o, version, self._sid(o))
            outs.append(vid)
            tensors.append(o)
        op.n_returned = len(outs)
        for t, bumps, b in pending.values():
            vid = self._write_value(idx, len(outs), t, bumps and not info.inplace_view)
            writes.append((b, vid))
            outs.append(vid)
            tensors.append(t)
        op.outs = outs
        op.writes = tuple(writes)
        nbytes = tape.storage_nbytes
        if len(nbytes) > first_new_sid:
            op.alloc_bytes = sum([nbytes[s] for s in range(first_new_sid, len(nbytes))])

        keep_all = op.keep_only is not None
        keep = self._keep
        values = tape.values
        for slot, vid in enumerate(outs):
            if vid is not None and (keep_all or values[vid].free or (idx, slot) in keep):
                self._hold(vid, tensors[slot])
        return out

    def _settle(self) -> None:
        """Reference the originals of the last op's held values strongly, now that autograd has
        finished making them (invariant 7).

        A strong reference taken while the op is still being dispatched would make autograd wrap
        a shallow copy instead of the tensor itself (``make_variable`` reuses a tensor only while
        nothing else references it), and the caller would see an object the recorder never saw.
        An original already gone is unreachable: no later write can change the held value.
        """
        originals, held = self._originals, self.held
        for vid, ref in self._fresh:
            t = ref()
            if t is not None and vid in held:
                originals[vid] = t
        self._fresh = []

    def _write_value(self, idx: int, slot: int, t: Tensor, bumps: bool) -> int:
        sid = self._sid(t)
        vid = self._produced(idx, slot, t, t._version + (1 if bumps else 0), sid)
        self._last_write[sid] = vid
        return vid

    # Saved-tensor hook ----------------------------------------------------------------------

    def _pack(self, t: Tensor) -> Any:
        """Pack hook: block-produced values become handles; everything else is kept as is."""
        self._bypass = True
        try:
            vid = self._lookup(t)
            if vid is None:
                return AsIs(self.link, t)
            v = self.tape.values[vid]
            if v.kind != PRODUCED or v.free:
                return AsIs(self.link, t)
            v.reads += 1
            if self.debug_refs is not None:
                self.debug_refs[vid] = t.detach()
            handle = Saved(self.link, vid, t)
            self._saved.append(handle)
            return handle
        finally:
            self._bypass = False

    # End of forward -------------------------------------------------------------------------

    def finalize(self) -> Recording:
        """Forward is done (call it outside the dispatch mode): hand over what backward needs."""
        self._settle()
        values = self.tape.values
        last_versions = {v.sid: v.version for v in values}
        for handle in self._saved:
            handle.settle(self.tape, last_versions)
        self._saved = []
        # Outside the mode a detach shares the original's version counter (invariant 7).
        versions = {vid: (t.detach(), values[vid].version) for vid, t in self._originals.items()}
        recording = Recording(self.block, self.tape, self.held, versions, self.owned_vids,
                              self.debug_refs, self.link)
        self.held, self.debug_refs, self._originals = {}, None, {}
        self._ids, self._storages, self._held_by_sid, self._last_write = {}, {}, {}, {}
        return recording
