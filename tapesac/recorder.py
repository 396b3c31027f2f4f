"""Record one block forward at the dispatcher, and decide what autograd's saved tensors become.

During a wrapped block's forward two things are active:

* :class:`Recorder`, a ``TorchDispatchMode`` that appends every ATen op (post-autocast, post
  decomposition) to a :class:`~tapesac.tape.Tape`;
* ``saved_tensors_hooks(recorder.pack, unpack_saved)``: a tensor the block produced is packed as
  a small :class:`Saved` handle instead of the tensor, so autograd does not keep it alive.

When the forward returns, :meth:`Recorder.finalize` hands a plain :class:`Recording` (the tape and
the few tensors backward needs) to a :class:`~tapesac.replay.Replayer`, which owns it from then
on.

Data flows one way: the handles reach the replayer through a :class:`ReplayLink`, never back
into the recorder, which is dropped.

The recorder is one dispatch mode per forward (the per-op path cannot afford a hop between
objects), assembled from parts that each keep their own state and invariants:

* :class:`~tapesac.values.ValueMap` (``values.py``): tensors to values (invariants 1, 4, 8);
* :class:`~tapesac.unwritten.UnseenWrites` (``unwritten.py``): bytes no recorded op wrote,
  Triton launches (invariants 10, 11);
* :class:`~tapesac.follow.Following` (``follow.py``): later forwards of a verified program check
  their ops against its tape instead of building one;
* :class:`~tapesac.segments.SegmentRunning` (``segments.py``): pure module calls learned while
  recording, run unobserved while following;
* this module: recording an op (invariants 2, 3, 5, 9), the pack hook (6, 7) and the hand-over
  (:meth:`Recorder.finalize`). What is handed over is in :mod:`tapesac.handoff`.

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
   invariant R4). A held value the block itself overwrites is copied or dropped (invariant 3)
   and needs no carrier.
8. A DTensor and its local shard are one storage (the shard's). What DTensor code makes outside
   the dispatcher (``to_local`` reads ``_local_tensor``; ``from_local`` and ``redistribute``
   wrap a local tensor in a new DTensor) goes on the tape as :func:`local_shard` and
   :func:`as_dtensor`, so those values are replayable and a write through either side invalidates
   the other (a DTensor's own version counter does not see writes to its shard: its value also
   goes stale when the shard's version moves).
9. A module inside the block that is an FSDP2 unit of its own (MoE experts under expert
   parallel) has its parameters freed after its forward and gathered again only in its
   backward, which runs after the nodes that read what the block computed from its outputs. So
   its outputs are held and their ops made keep-only (:meth:`Recorder.hold_outputs`): no replay
   reaches into it from outside; inside its own backward replay reads what FSDP gathered.
10. Replay never rebuilds bytes that no recorded op wrote. The outputs of allocations (``empty``
    and its kin: :attr:`~tapesac.ops.OpInfo.allocates`), views of them, and reads of a storage
    that such an allocation made and no recorded op has overwritten whole are *unwritten*: what
    is in them came from code the dispatcher never saw (a Triton or CUDA kernel, numpy, ctypes)
    or from nobody. The first time an unwritten value is read (by an op that reads its contents,
    not a view or an overwrite; or saved by autograd), it is held as it is then and its op made
    keep-only (:data:`UNSEEN`); what is computed from it replays from that hold. A Triton launch
    is an op like any other (:meth:`Recorder.launch_kernel`), so its outputs are written values.
11. A Triton launch writes its pointer arguments without moving their version counters, so
    every other alias of a storage it wrote is read as a new value of that storage
    (``_kernel_written``), as after a write through a view.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .follow import Following, VerifiedTape
from .handoff import _PLAIN, AsIs, Recording, ReplayLink, Saved, _dtensor_parts
from .fingerprints import fingerprint
from .kernels import KernelLaunch
from .modes import _Mode
from .ops import base_version, clone_as_is, device_of, generator_for, keep_only_reason, op_info, written_tensors
from .segments import SegmentRunning
from .tape import PRODUCED, SNAPSHOT, UNSEEN, Ref, Tape, TapeOp, flatten_outputs
from .unwritten import UnseenWrites
from .values import ValueMap

Tensor = torch.Tensor


class Recorder(ValueMap, UnseenWrites, Following, SegmentRunning, _Mode):
    """Builds the tape of one block forward; ``pack`` is the matching saved-tensor pack hook."""

    def __init__(self, block: int, keep: frozenset | None = None, debug: bool = False,
                 owned: set[int] | None = None, timer=None, follow: "VerifiedTape | None" = None,
                 learn_segments: bool = False, verify: bool = False,
                 keep_only_ops: frozenset | set = frozenset()) -> None:
        super().__init__()
        self.block = block
        self.verify = verify
        """A verification forward: saved handles carry fingerprints (replay invariant R6)."""
        self._init_unseen(keep_only_ops)
        self._kept_as_is: list[weakref.ref] = []
        """Verification forwards: weak references to the :class:`AsIs` handles made."""
        self.fingerprints: dict[int, Tensor] = {}
        """Verification forwards: vid -> fingerprint of the tensor autograd saved (replay
        invariant R6)."""
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
        self._init_values(owned)
        self._held_by_sid: dict[int, set[int]] = {}
        self._last_write: dict[int, int] = {}
        self._bypass = False
        self._init_following(None if (debug or timer is not None) else follow)
        self._init_segments(not debug and timer is None and learn_segments)
        self.off_tape_bytes = 0
        """Bytes of distinct storages autograd saved that are on no tape value (held as they are,
        never replayable): what TapeSAC could not see being made."""
        self._off_tape_storages: set[int] = set()
        ref = weakref.ref(self)

        def pack(t: Tensor) -> Any:
            rec = ref()
            if rec._seg_run is not None:
                return rec._segment_pack(t)
            verified = rec._verified
            if verified is not None and type(t) in _PLAIN:
                # Following, the common case inline (:meth:`_follow_pack` has the rest): a value
                # of the tape, unwritten since it was made, that replay can make again.
                ent = rec._fids.get(id(t))
                if ent is not None and ent[1] in verified.replayable and ent[0]() is t and t._version == ent[2]:
                    vid = ent[1]
                    reads = rec._reads
                    reads[vid] = reads.get(vid, 0) + 1
                    handle = Saved(rec.link, vid, t)
                    if rec.verify:
                        rec._fingerprint(vid, t)
                    rec._saved.append(handle)
                    return handle
            return rec._pack(t)

        self.pack = pack
        """The pack hook. Autograd keeps it in every saved variable, so it refers to the recorder
        weakly: the graph must not keep the recorder alive (invariant 6)."""

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

    def _before_write(self, t: Tensor, copies: dict[int, Tensor] | None = None) -> None:
        """Invariant 3: nothing held may be clobbered by the write about to happen to ``t``.

        ``copies``: vid -> a copy of a held value taken before a write that has already happened
        (a Triton launch whose written arguments are known only afterwards)."""
        sid = self._sid(t)
        vids = self._held_by_sid.pop(sid, None)
        if not vids:
            return
        values = self.tape.values
        if self._fresh:
            # Held by this very op (an unwritten value it reads before writing it, invariant 10):
            # not yet settled, and never to be, since the original is about to change.
            self._fresh = [(vid, ref) for vid, ref in self._fresh if vid not in vids]
        for vid in vids:
            v = values[vid]
            # Either way the held value no longer aliases the tensor the caller sees: nothing to
            # check its version against (invariant 7).
            self._originals.pop(vid, None)
            if v.kind == PRODUCED and self.tape.ops[v.op].keep_only is None:
                del self.held[vid]  # replayable: drop the hold, replay rebuilds this version
                continue
            copy = copies[vid] if copies is not None and vid in copies else clone_as_is(self.held[vid])
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
        if self._verified is not None:
            return self._follow_op(func, args, kwargs)
        return self._record(func, args, kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = op_info(func)
        eargs, ekwargs, deps = self._encode_all(args, kwargs)
        if self._unwritten:
            self._read_unwritten(info, args, kwargs)
        written = written_tensors(info, args, kwargs) if info.write_args else ()
        before = []
        if written:
            for t, _ in written:
                before.append(self._lookup(t))
                if not info.inplace_view:
                    self._before_write(t)
        rng = None
        if info.random:
            gen = generator_for(func, args, kwargs, device_of(args, kwargs))
            if gen is not None:
                rng = (gen, gen.get_state())

        if self.timer is None:
            out = func(*args, **kwargs)
            elapsed = None
        else:
            out, elapsed = self.timer.call(func, args, kwargs, can_repeat=not written, rng=rng)
        self._commit(func, info, args, eargs, ekwargs, deps, written, before, rng, elapsed, out)
        return out

    def _commit(self, func: Any, info: Any, args: tuple, eargs: tuple, ekwargs: dict, deps: list[int],
                written: Any, before: list, rng: Any, elapsed: float | None, out: Any) -> None:
        """Put an op that has run on the tape: its values, and what is held of them."""
        flat = flatten_outputs(out)
        # A launch stays on the tape even when it wrote nothing: ProgramCheck hashes every launch.
        if not written and type(func) is not KernelLaunch and not any(isinstance(o, Tensor) for o in flat):
            return
        tape = self.tape
        idx = len(tape.ops)
        op = TapeOp(func, eargs, ekwargs, tuple(deps) if len(deps) < 2 else tuple(dict.fromkeys(deps)))
        op.rng = rng
        op.time_s = elapsed
        op.inplace_view = info.inplace_view
        op.keep_only = (keep_only_reason(info, args) if info.keep_only else None) or (
            "random op on a device without a known generator" if info.random and rng is None else None) or (
            UNSEEN if idx in self._keep_only_ops else None)
        view_unwritten = (info.view_of is not None and self._unwritten and info.view_of < len(args)
                          and self._vid_now(args[info.view_of]) in self._unwritten)
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
                version = o._version if info.view_of is None else base_version(args, info.view_of, o)
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
        if info.allocates or view_unwritten or writes and self._unwritten_sids:
            self._note_unwritten(op, info, tensors, view_unwritten)
        nbytes = tape.storage_nbytes
        if len(nbytes) > first_new_sid:
            op.alloc_bytes = sum([nbytes[s] for s in range(first_new_sid, len(nbytes))])

        keep_all = op.keep_only is not None
        keep = self._keep
        values = tape.values
        for slot, vid in enumerate(outs):
            if vid is not None and (keep_all or values[vid].free or (idx, slot) in keep):
                self._hold(vid, tensors[slot])

    def _as_is(self, t: Tensor) -> "AsIs":
        """A saved tensor left as it is; on verification forwards also remembered (weakly), since
        its version check explains a replayed difference first (replay invariant R6)."""
        handle = AsIs(self.link, t)
        if self.verify:
            self._kept_as_is.append(weakref.ref(handle))
        return handle

    def _fingerprint(self, vid: int, t: Tensor) -> None:
        """Verification forwards: what replay must rebuild of a saved value, bit for bit (replay
        invariant R6)."""
        if vid not in self.fingerprints:
            with torch._C._DisableTorchDispatch():  # TapeSAC's own check: no op of the block, no meter
                fp = fingerprint(t)
            if fp is not None:
                self.fingerprints[vid] = fp

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

    def hold_outputs(self, out: Any, reason: str) -> None:
        """Make the ops that produced ``out`` keep-only and hold their outputs (invariant 9).

        Called from a forward hook of a module inside the block whose parameters FSDP2 frees
        after that module's forward and gathers again only in that module's backward: replay
        that reaches into the module from a node that runs earlier would read freed storage.
        A followed forward holds what the verified forward held: nothing to do."""
        if self._verified is not None:
            return
        bypass, self._bypass = self._bypass, True
        try:
            tape = self.tape
            alive = None
            for t in flatten_outputs(out):
                if not isinstance(t, Tensor):
                    continue
                vid = self._lookup(t)
                if vid is None or not tape.produced(vid):
                    continue
                v = tape.values[vid]
                op = tape.ops[v.op]
                if op.keep_only is None:
                    op.keep_only = reason
                if alive is None:
                    alive = {vid: ref for ref, vid in self._ids.values()}
                for o in op.outs:
                    ref = alive.get(o)
                    t_o = None if ref is None else ref()
                    if t_o is not None and o not in self.held and t_o._version == tape.values[o].version:
                        self._hold(o, t_o)
        finally:
            self._bypass = bypass

    # Saved-tensor hook ----------------------------------------------------------------------

    def _pack(self, t: Tensor) -> Any:
        """Pack hook: block-produced values become handles; everything else is kept as is."""
        self._bypass = True
        try:
            if self._verified is not None:
                handle = self._follow_pack(t)
                if handle is not None:
                    return handle
            vid = self._lookup(t)
            if self._seg_learn is not None:
                self._seg_learn.append((vid, vid is not None and self.tape.produced(vid),
                                        None if vid is not None else (id(t), weakref.ref(t))))
            if vid is None:
                self._note_off_tape(t)
                return self._as_is(t)
            if self._unwritten and vid in self._unwritten:
                self._hold_unseen(vid, t)  # invariant 10: autograd reads it in backward
            if not self.tape.produced(vid):
                return self._as_is(t)
            v = self.tape.values[vid]
            v.reads += 1
            if self.debug_refs is not None:
                self.debug_refs[vid] = t.detach()
            handle = Saved(self.link, vid, t)
            if self.verify:
                self._fingerprint(vid, t)
            self._saved.append(handle)
            return handle
        finally:
            self._bypass = False

    def _note_off_tape(self, t: Tensor, alias: Tensor | None = None) -> None:
        if self._verified is not None and alias is not None:
            # Following: autograd saves an op's inputs before the op reaches the dispatcher, so a
            # parameter is saved before its first op binds it. Decide at the end, when the
            # forward's bindings tell whether it was the block's own (:meth:`_flush_off_tape`),
            # instead of listing the block's parameters every forward.
            self._off_tape_later.append((id(t), weakref.ref(t), alias))
            return
        if id(t) in self._owned:  # the block's own parameter, saved before an op read it
            return
        self._count_off_tape(t)

    def _count_off_tape(self, t: Tensor) -> None:
        parts = _dtensor_parts(t)
        try:
            st = (t if parts is None else parts[0]).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(st) not in self._off_tape_storages:
            self._off_tape_storages.add(id(st))
            self.off_tape_bytes += st.nbytes()

    # End of forward -------------------------------------------------------------------------

    def finalize(self) -> Recording:
        """Forward is done (call it outside the dispatch mode): hand over what backward needs."""
        self._settle()
        verified = self._verified
        if verified is not None and (self._i != len(verified.steps) or self._reads != verified.reads):
            self._leave_follow()  # it stopped short, or autograd saved other values
            verified = None
        if verified is not None:
            self._flush_off_tape()
            self.tape = verified.tape
        values = self.tape.values
        if verified is not None:
            self.followed = True
            last_versions, wrapper_versions = verified.last_versions, verified.wrapper_versions
        else:
            last_versions, wrapper_versions = self.tape.last_versions(), self.tape.last_versions(wrappers=True)
        if self.fingerprints:
            # Verification: what autograd will read is the saved tensors' bytes as the forward
            # leaves them; a write after the save that no op made (numpy, a kernel) shows here.
            done: set[int] = set()
            with torch._C._DisableTorchDispatch():
                for handle in self._saved:
                    t = handle.ref() if handle.ref is not None else None
                    if t is not None and handle.vid in self.fingerprints and handle.vid not in done:
                        done.add(handle.vid)
                        fp = fingerprint(t)
                        if fp is not None:
                            self.fingerprints[handle.vid] = fp
        for handle in self._saved:
            if handle.vid < 0:  # re-pointing found its view gone (invariant 11)
                handle.ref = None
                continue
            handle.settle(self.tape, wrapper_versions if values[handle.vid].wrapper else last_versions)
        handles = [weakref.ref(h) for h in self._saved] + self._kept_as_is if self.fingerprints else []
        self._saved = []
        # Outside the mode a detach shares the original's version counter (invariant 7).
        seen = self._held_versions if verified is not None else None
        versions = {vid: (t.detach(), values[vid].version if seen is None else seen[vid])
                    for vid, t in self._originals.items()}
        recording = Recording(self.block, self.tape, self.held, versions, self.owned_vids,
                              self.debug_refs, self.link, self._rng, self._args, verified,
                              self.segments if verified is None else [], self.fingerprints, handles)
        self.held, self.debug_refs, self._originals = {}, None, {}
        self._ids, self._storages, self._held_by_sid, self._last_write = {}, {}, {}, {}
        self._fids, self._verified = {}, None
        return recording
