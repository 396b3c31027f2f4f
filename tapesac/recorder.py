"""Record one block forward at the dispatcher, and decide what autograd's saved tensors become.

During a wrapped block's forward two things are active:

* :class:`Recorder`, a ``TorchDispatchMode`` that appends every ATen op (post-autocast, post
  decomposition) to a :class:`~tapesac.tape.Tape`;
* ``saved_tensors_hooks(recorder.pack, unpack_saved)``: a tensor the block produced is packed as
  a small :class:`Saved` handle instead of the tensor, so autograd does not keep it alive.

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
   runs through the graph (pytorch#154642), and the tape holds no tensors at all.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ReplayError
from .ops import generator_for, keep_only_reason, op_info, written_tensors
from .tape import EXTERNAL, PRODUCED, SNAPSHOT, Ref, Tape, TapeOp, flatten_outputs

Tensor = torch.Tensor


def storage_alias(src: Tensor, dtype: torch.dtype, size: tuple, stride: tuple, offset: int) -> Tensor:
    """A tensor with the given view metadata over ``src``'s storage (replays rule 4 above)."""
    return torch.empty((0,), dtype=dtype, device=src.device).set_(src.untyped_storage(), offset, size, stride)


class Saved:
    """What autograd stores instead of a block-produced tensor: the recording and the value."""

    __slots__ = ("recorder", "vid")

    def __init__(self, recorder: "Recorder", vid: int) -> None:
        self.recorder = recorder
        self.vid = vid


def unpack_saved(obj: Any) -> Any:
    """The unpack hook: rebuild (or fetch) a packed value; tensors packed as-is pass through."""
    if type(obj) is Saved:
        replayer = obj.recorder.replayer
        if replayer is None:
            raise ReplayError(
                f"TapeSAC block {obj.recorder.block}: backward asked for a saved value before the "
                "block's forward returned (autograd.grad inside the block's forward is not supported); "
                "unwrap this block or move the inner backward out of it"
            )
        return replayer.unpack(obj.vid)
    return obj


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    return None


def _copy(t: Tensor) -> Tensor:
    return t.clone(memory_format=torch.preserve_format)


class Recorder(TorchDispatchMode):
    """Builds the tape of one block forward; ``pack`` is the matching saved-tensor pack hook."""

    def __init__(self, block: int, keep: frozenset | None = None, debug: bool = False,
                 owned: set[int] | None = None, timer=None) -> None:
        super().__init__()
        self.block = block
        self.timer = timer
        """An :class:`~tapesac.profile.OpTimer` in profiling forwards, else None."""
        self.tape = Tape()
        self.held: dict[int, Tensor] = {}
        """vid -> detached tensor kept for backward (see invariant 2)."""
        self.replayer = None
        self.debug_refs: dict[int, Tensor] | None = {} if debug else None
        self._keep = keep or frozenset()
        self._owned = owned or set()
        """ids of the block's own parameters and buffers (not counted as inputs)."""
        self.owned_vids: set[int] = set()
        self.watch: dict[int, tuple[weakref.ref, int]] = {}
        """vid -> (weak ref to the original tensor, its version): held values that alias live
        tensors. A detach made below autograd does not share the version counter, so the
        original is watched instead (invariant 11)."""
        self._ids: dict[int, tuple[weakref.ref, int]] = {}
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._held_by_sid: dict[int, set[int]] = {}
        self._last_write: dict[int, int] = {}
        self._bypass = False

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
        self.held[vid] = t
        self._held_by_sid.setdefault(self.tape.values[vid].sid, set()).add(vid)

    def _external(self, t: Tensor) -> int:
        sid = self._sid(t)
        self.tape.external_sids.add(sid)
        vid = self.tape.add_value(-1, -1, EXTERNAL, t, t._version, sid)
        self._ids[id(t)] = (weakref.ref(t), vid)
        self._hold(vid, t.detach())
        self.watch[vid] = (weakref.ref(t), t._version)
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
                self._hold(vid, t.detach())
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
                vid = self._produced(idx, len(outs), o, o._version, self._sid(o))
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
                t = tensors[slot]
                self._hold(vid, t.detach())
                if values[vid].free:
                    self.watch[vid] = (weakref.ref(t), values[vid].version)
        return out

    def _write_value(self, idx: int, slot: int, t: Tensor, bumps: bool) -> int:
        sid = self._sid(t)
        vid = self._produced(idx, slot, t, t._version + (1 if bumps else 0), sid)
        self._last_write[sid] = vid
        return vid

    # Saved-tensor hook ----------------------------------------------------------------------

    def pack(self, t: Tensor) -> Any:
        """Pack hook: block-produced values become handles; everything else is kept as is."""
        self._bypass = True
        try:
            vid = self._lookup(t)
            if vid is None:
                return t.detach()
            v = self.tape.values[vid]
            if v.kind != PRODUCED or v.free:
                return t.detach()
            v.reads += 1
            if self.debug_refs is not None:
                self.debug_refs[vid] = t.detach()
            return Saved(self, vid)
        finally:
            self._bypass = False

    # End of forward -------------------------------------------------------------------------

    def finalize(self):
        """Forward is done: drop identity maps and unneeded holds, and build the replayer."""
        from .replay import Replayer

        self._ids = {}
        self._storages = {}
        self._held_by_sid = {}
        self._last_write = {}
        self.replayer = Replayer(self)
        return self.replayer
