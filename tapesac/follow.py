"""Follow mode: later forwards of a verified program check their ops against its tape instead of
building one (:class:`VerifiedTape`, and the recorder's :class:`Following` part).

A followed forward keeps the recorder's invariants (:mod:`tapesac.recorder`) with the verified
tape's values: identities in ``_fids``, with this forward's versions, generator states and differing
constants kept beside the shared tape. At the first op that departs it turns what it followed
into a tape of its own (:meth:`Following._leave_follow`) and records from there.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from .errors import TapeSACError
from .handoff import _DTENSOR_STEPS, _PLAIN, Saved, _dtensor_parts, local_shard
from .kernels import KernelLaunch
from .ops import base_version, device_of, generator_for, op_info, written_tensors
from .segments import eligible as segment_eligible
from .tape import EXTERNAL, SNAPSHOT, Ref, Tape, TapeOp, _has_ref, flatten_outputs

Tensor = torch.Tensor


_NOTHING_WRITTEN: dict[int, int] = {}
"""What :meth:`Following._match_args` returns for an op that writes nothing (never filled)."""


class _FollowStep:
    """One tape op as a followed forward checks and maps it."""

    __slots__ = ("func", "info", "args", "kwargs", "outs", "n_returned", "holds", "rng", "view_of",
                 "after", "written", "next_vid", "may_differ", "single", "tensors", "lists", "kw_tensors",
                 "const_pos", "consts", "const_types", "kw_const_names", "kw_consts", "kw_const_types",
                 "call", "fast", "nargs")

    def __init__(self, op: TapeOp, held: set[int]) -> None:
        self.func = op.func
        self.info = op_info(op.func)
        self.args = op.args
        self.kwargs = op.kwargs
        self.outs = tuple(op.outs)
        self.n_returned = op.n_returned
        self.holds = tuple((slot, vid) for slot, vid in enumerate(op.outs) if vid is not None and vid in held)
        self.rng = op.rng is not None
        self.view_of = self.info.view_of
        self.after = dict(op.writes)
        """vid before -> vid after, of each argument the op writes."""
        self.written = frozenset(self.after.values())
        self.may_differ = not op.writes and not self.rng
        """Constants may differ from the tape's (nothing written, no generator): the outputs are
        checked after the op runs, and a different number of them departs from the tape."""
        self.single = len(op.outs) == 1 and op.n_returned == 1 and op.outs[0] is not None and not op.writes
        """One tensor returned, nothing written: mapped without the general output loop."""
        tensors, lists, const_pos = [], [], []
        for pos, a in enumerate(op.args):
            if type(a) is Ref:
                tensors.append((pos, -1, a.vid))
            elif type(a) is list and _has_ref(a):
                lists.append((pos, tuple(a)))
                tensors.extend((pos, sub, x.vid) for sub, x in enumerate(a) if type(x) is Ref)
            else:
                const_pos.append(pos)
        self.tensors = tuple(tensors)
        self.lists = tuple(lists)
        self.const_pos = tuple(const_pos)
        self.consts = tuple(op.args[p] for p in const_pos)
        self.const_types = tuple(map(type, self.consts))
        self.kw_tensors = tuple((k, a.vid) for k, a in op.kwargs.items() if type(a) is Ref)
        self.kw_const_names = tuple(k for k, a in op.kwargs.items() if not _has_ref(a))
        self.kw_consts = tuple(op.kwargs[k] for k in self.kw_const_names)
        self.kw_const_types = tuple(map(type, self.kw_consts))
        self.call = getattr(op.func, "_op", op.func)
        """The overload's C++ callable (an ``OpOverload`` call is one Python frame around it)."""
        self.nargs = len(op.args)
        self.fast = (self.single and not self.rng and not lists and not op.kwargs
                     and op.func not in _DTENSOR_STEPS)
        """The common op (one tensor out, nothing written, no generator, positional tensors and
        constants only): :meth:`Following._follow_op` checks it inline."""


class VerifiedTape:
    """A verified block forward prepared for later forwards of the same program to *follow*.

    A forward that follows runs under the recorder as usual, but instead of building a tape it
    checks each op against the tape's (same overload, the same values as arguments, by identity
    and version, the same constants) and only does what backward needs: it maps outputs to the
    tape's values, holds what the verified forward held, keeps generator states, and turns saved
    tensors into handles. The tape (no tensors) is shared by every forward that follows it.

    What a followed forward guarantees is what a recorded one does: its replay runs exactly the
    ops it dispatched, on the values they read. Every op is checked before it runs; at the first
    one that departs (another overload, another argument, another constant where the op's output
    could change shape or number, a tensor written through an alias, a saved tensor the tape did
    not save, fewer ops) the forward hands what it followed over to a recording of its own and
    records the rest, so a program that changes with its input is recorded, never replayed from a
    stale tape. Constants of ops that write nothing and draw no random numbers may differ (sizes
    that depend on the data, such as MoE split sizes, or a scale read with ``.item()``): replay
    uses this forward's, and an op whose outputs then differ in number or kind departs.

    Calls of pure modules (``nn.Linear``, ``nn.RMSNorm``, ``nn.LayerNorm``) that the verified
    forward made are run with the dispatch mode off where their guard holds (:mod:`tapesac.segments`,
    :meth:`~tapesac.segments.SegmentRunning.run_module`): their ops are taken as followed, checked by what they saved.

    Not eligible (recorded every time): tapes where replay needs a snapshot (a held value that was
    written in place), with storage aliases (a tensor written through another alias) or with
    tensor lists passed by keyword; debug mode; profiling. The recorder's DTensor steps
    (:func:`~tapesac.handoff.local_shard`, :func:`~tapesac.handoff.as_dtensor`) are followed: a
    tensor the forward has not seen is the next such step's output when it is that step's shard
    or DTensor, checked by identity, version, placements and shape
    (:meth:`Following._follow_derive`). A snapshot replay does not need (a buffer updated in
    place, such as MoE load statistics) is not taken when following.
    """

    def __init__(self, tape: Tape, held: Any, owned_vids: Any = (), segments: Any = ()) -> None:
        self.tape = tape
        values = tape.values
        held = set(held)
        steps = []
        next_vid = 0
        for op in tape.ops:
            step = _FollowStep(op, held)
            for vid in (*op.deps, *(o for o in op.outs if o is not None)):
                next_vid = max(next_vid, vid + 1)
            step.next_vid = next_vid
            steps.append(step)
        self.steps = steps
        self.replayable = frozenset(v.vid for v in values if tape.produced(v.vid))
        """Values a saved tensor is packed as a :class:`Saved` handle of (the rest as they are)."""
        self.reads = {v.vid: v.reads for v in values if v.reads}
        """vid -> times autograd saved it: a followed forward must save the same."""
        self.last_versions = tape.last_versions()
        self.wrapper_versions = tape.last_versions(wrappers=True)
        """sid -> version of the last value in that storage (see :meth:`Saved.settle`)."""
        self.program = None
        """The replay program of forwards that follow this tape (made by the first one)."""
        self.owned_vids = frozenset(owned_vids)
        """Externals that were the block's own parameters and buffers."""
        self.segments = {seg.start: seg for seg in segments
                         if segment_eligible(seg, tape, steps, self.replayable)}
        """First op index -> a pure module call later forwards run unobserved
        (:mod:`~tapesac.segments`)."""

    @staticmethod
    def eligible(tape: Tape, program: Any) -> bool:
        """Whether forwards may follow ``tape`` (``program``: its :class:`ReplayProgram`)."""
        values = tape.values
        # A snapshot replay needs is a copy the recorder made before a write: record every time.
        # One it does not need (a buffer updated in place, e.g. MoE load statistics) costs nothing.
        return not any(values[vid].kind == SNAPSHOT for vid in (*program.pinned, *program.kept)) and all(
            (hasattr(op.func, "_schema") or op.func in _DTENSOR_STEPS or type(op.func) is KernelLaunch)
            and not any(type(a) is not Ref and _has_ref(a) for a in op.kwargs.values())
            for op in tape.ops)


class Following:
    """The recorder's follow mode (mixed into :class:`~tapesac.recorder.Recorder`, whose dispatch
    mode and pack hook call it): the cursor on a :class:`VerifiedTape`'s steps and the identity map
    of the values it has met."""

    def _init_following(self, verified: VerifiedTape | None) -> None:
        self._verified = verified
        """The verified tape this forward follows; None once it departs (or when recording)."""
        self.followed = False
        """The forward ran to its end on the verified tape: ``tape`` is that (shared) tape."""
        self._i = 0
        """Index of the next tape op."""
        self._n = 0
        """Id of the next value."""
        self._fids: dict[int, tuple[weakref.ref, int, int]] = {}
        """id(tensor) -> (weak ref, vid, version): the identity map, with each value's version
        kept here because the shared tape's are another forward's."""
        self._reads: dict[int, int] = {}
        """vid -> times saved for backward so far."""
        self._rng: dict[int, tuple] = {}
        """op index -> (generator, state) of this forward's random ops."""
        self._args: dict[int, tuple[tuple, dict]] = {}
        """op index -> (args, kwargs) where this forward's constants differ."""
        self._held_versions: dict[int, int] = {}
        """vid -> version of the held values (the shared tape's are another forward's)."""
        self._off_tape_later: list[tuple[int, weakref.ref, Tensor]] = []
        """Saved tensors on no value yet, counted or not at the end (_flush_off_tape)."""
        self._dtensors: dict[int, tuple[weakref.ref, int]] = {}
        """vid -> (this forward's DTensor of that value, its shard's version then): for
        :func:`local_shard` steps, and to see a write through the shard (invariant 8)."""

    def _follow_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one op of a followed forward: check it is the tape's next op on the same values,
        then do only what backward needs of it (map its outputs, hold what the tape held)."""
        verified = self._verified
        i = self._i
        step = verified.steps[i] if i < len(verified.steps) else None
        if step is not None and step.func in _DTENSOR_STEPS:
            step = self._follow_dtensor_steps(args, kwargs)
            i = self._i
        if step is not None and step.fast and func is step.func and not kwargs and len(args) == step.nargs:
            # The common op, checked inline: each tensor argument is the tape's value (identity,
            # version; plain tensors), the constants are the tape's. Anything else, including a
            # tensor this forward has not seen yet, goes the general way below.
            fids = self._fids
            for pos, _sub, vid in step.tensors:
                a = args[pos]
                ent = fids.get(id(a))
                if ent is None or ent[1] != vid or ent[0]() is not a or a._version != ent[2] or type(a) not in _PLAIN:
                    break
            else:
                consts = tuple([args[p] for p in step.const_pos]) if step.const_pos else ()
                if tuple(map(type, consts)) == step.const_types and consts == step.consts:
                    return self._follow_out(step, i, func, args, kwargs, (), _NOTHING_WRITTEN, step.call(*args))
        if step is None or func is not step.func:
            if not op_info(func).returns_tensor and not op_info(func).write_args:
                return func(*args, **kwargs)  # never on a tape (``.item()``): nothing to follow
            self._leave_follow()
            return self._record(func, args, kwargs)
        seen = self._match_args(step, args, kwargs)
        if seen is None:
            self._leave_follow()
            return self._record(func, args, kwargs)
        written = written_tensors(step.info, args, kwargs) if step.info.write_args else ()
        if step.rng:
            gen = generator_for(func, args, kwargs, device_of(args, kwargs))
            self._rng[i] = (gen, gen.get_state())
        out = func(*args, **kwargs)
        return self._follow_out(step, i, func, args, kwargs, written, seen, out)

    def _follow_out(self, step: "_FollowStep", i: int, func: Any, args: tuple, kwargs: dict, written: Any,
                    seen: dict[int, int], out: Any) -> Any:
        """Map the outputs of a followed op that has run (and hold what the tape held)."""
        if step.single and isinstance(out, Tensor):  # one tensor out, no writes
            vid = step.outs[0]
            view_of = step.view_of
            # A view's own counter still reads 0 here; autograd then shares its base's.
            version = out._version if view_of is None else base_version(args, view_of, out)
            self._fids[id(out)] = (weakref.ref(out), vid, version)
            if type(out) not in _PLAIN:
                self._follow_dtensor(vid, out)
            if step.holds:
                self._follow_hold(vid, out)
                self._held_versions[vid] = version
            self._n = step.next_vid
            self._i = i + 1
            return out
        flat = flatten_outputs(out)
        outs = step.outs
        n = step.n_returned
        if len(flat) != n or any((vid is None) != (not isinstance(o, Tensor)) for o, vid in zip(flat, outs)):
            # Same op on the same values, other returns (a data-dependent count): record it.
            if written:
                raise TapeSACError(
                    f"TapeSAC block {self.block}: in-place op {func} returned other values than when "
                    "the block was recorded; please report this with the block")
            rng = self._rng.get(i)
            self._leave_follow()
            self._commit(func, step.info, args, *self._encode_all(args, kwargs), (), [], rng, None, out)
            return out
        fids = self._fids
        ref = weakref.ref
        tensors: list[Tensor | None] = list(flat)
        view_of = step.view_of
        for slot in range(n):
            vid = outs[slot]
            if vid is None or vid in step.written:
                continue
            o = flat[slot]
            # A view's own counter still reads 0 here; autograd then shares its base's.
            fids[id(o)] = (ref(o), vid, o._version if view_of is None else base_version(args, view_of, o))
            if type(o) not in _PLAIN:
                self._follow_dtensor(vid, o)
        for t, bumps in written:
            after = step.after[seen[id(t)]]
            fids[id(t)] = (ref(t), after, t._version + (1 if bumps and not step.info.inplace_view else 0))
            if outs.index(after) >= n:
                tensors.append(t)
        for slot, vid in step.holds:
            self._follow_hold(vid, tensors[slot])
            self._held_versions[vid] = fids[id(tensors[slot])][2]
        self._n = step.next_vid
        self._i = i + 1
        return out

    def _match_args(self, step: "_FollowStep", args: tuple, kwargs: dict) -> dict[int, int] | None:
        """id(tensor) -> vid for the op's tensor arguments if they are the tape's (and its
        constants match, or may differ here); None if the program departs from the tape."""
        if len(args) != len(step.args) or (kwargs or step.kwargs) and kwargs.keys() != step.kwargs.keys():
            return None
        for pos, expected in step.lists:  # tensor lists: same length, same non-tensor entries
            a = args[pos]
            if type(a) not in (list, tuple) or len(a) != len(expected):
                return None
            for x, y in zip(a, expected):
                if type(y) is not Ref and (type(x) is not type(y) or x != y):
                    return None
        seen: dict[int, int] | None = {} if step.after else None
        match = self._match_tensor
        for pos, sub, vid in step.tensors:  # in the order the recorder met them
            if not match(args[pos] if sub < 0 else args[pos][sub], vid, seen):
                return None
        for name, vid in step.kw_tensors:
            if not match(kwargs[name], vid, seen):
                return None
        consts = tuple([args[p] for p in step.const_pos])
        kw_consts = tuple([kwargs[k] for k in step.kw_const_names]) if step.kw_const_names else ()
        # Same overload, so the schema fixes each position's kind; a type can still differ where
        # the schema allows several (``Tensor?``, ``Scalar``): compare types first, then values.
        if (tuple(map(type, consts)) != step.const_types or consts != step.consts
                or kw_consts and (tuple(map(type, kw_consts)) != step.kw_const_types or kw_consts != step.kw_consts)):
            if not step.may_differ or any(isinstance(x, Tensor) or type(x) in (list, tuple) and any(
                    isinstance(y, Tensor) for y in x) for x in (*consts, *kw_consts)):
                return None
            # Integers and floats are data (sizes, scales): replay must use this forward's.
            self._args[self._i] = self._encode_follow(step, args, kwargs)
        return _NOTHING_WRITTEN if seen is None else seen

    def _match_tensor(self, a: Any, vid: int, seen: dict[int, int] | None) -> bool:
        """``a`` is value ``vid`` (binding it if it is where the tape met a new external);
        ``seen`` (ops that write) collects id -> vid."""
        ent = self._fids.get(id(a))
        if ent is not None and ent[0]() is a:
            if ent[1] != vid or a._version != ent[2] or type(a) not in _PLAIN and self._stale_dtensor(a, vid):
                return False
            if seen is not None:
                seen[id(a)] = vid
            return True
        if not isinstance(a, Tensor):
            return False
        # A tensor this forward has not seen: it must be where the tape met a new external (or
        # the snapshot the recorder later made of one, which it was until then).
        v = self._verified.tape.values[vid]
        if v.op >= 0 or vid != self._n or a.shape != v.shape or a.dtype != v.dtype:
            return False
        self._fids[id(a)] = (weakref.ref(a), vid, a._version)
        if type(a) not in _PLAIN:
            self._follow_dtensor(vid, a)
        self._n = vid + 1
        self._follow_hold(vid, a)
        self._held_versions[vid] = a._version
        if vid in self._verified.owned_vids:  # the same program: the same parameters
            self.owned_vids.add(vid)
        if seen is not None:
            seen[id(a)] = vid
        return True

    def _follow_dtensor_steps(self, args: tuple, kwargs: dict) -> "_FollowStep | None":
        """The tape's next steps are DTensor steps the recorder met at this op's arguments: map
        them to the arguments they made (in order) and return the step after them, or None when
        one of them matches no argument (the program departs)."""
        steps = self._verified.steps
        # Unseen tensors, and DTensors read again after a write through their shard.
        candidates = [t for a in (*args, *kwargs.values()) for t in (a if type(a) in (list, tuple) else (a,))
                      if isinstance(t, Tensor)]
        while self._i < len(steps) and steps[self._i].func in _DTENSOR_STEPS:
            if not any(self._follow_derive(t) is not None for t in candidates):
                return None
        return steps[self._i] if self._i < len(steps) else None

    def _follow_dtensor(self, vid: int, t: Tensor) -> None:
        parts = _dtensor_parts(t)
        if parts is not None:
            self._dtensors[vid] = (weakref.ref(t), parts[0]._version)

    def _stale_dtensor(self, t: Tensor, vid: int) -> bool:
        """Follow mode: DTensor ``t`` (value ``vid``) was read after a write through its shard."""
        ent = self._dtensors.get(vid)
        return ent is not None and ent[0]() is t and t._local_tensor._version != ent[1]

    def _follow_derive(self, t: Tensor) -> int | None:
        """If the tape's next step is a DTensor step whose output ``t`` is (the shard of the
        DTensor it read, or a DTensor over the shard it read, with the recorded placements and
        shape), map ``t`` to its value and move past the step (recorder invariant 8)."""
        steps = self._verified.steps
        i = self._i
        step = steps[i] if i < len(steps) else None
        if step is None or step.func not in _DTENSOR_STEPS:
            return None
        src = step.args[0].vid
        out = step.outs[0]
        if step.func is local_shard:
            owner = self._dtensors.get(src)
            owner = None if owner is None else owner[0]()
            if owner is None or type(t) not in _PLAIN or owner._local_tensor is not t:
                return None
        else:
            parts = _dtensor_parts(t)
            if parts is None:
                return None
            ent = self._fids.get(id(parts[0]))
            v = self._verified.tape.values[out]
            if (ent is None or ent[0]() is not parts[0] or ent[1] != src or parts[0]._version != ent[2]
                    or str(parts[1].placements) != step.args[2] or tuple(t.shape) != v.shape or t.dtype != v.dtype):
                return None
            self._follow_dtensor(out, t)
        self._fids[id(t)] = (weakref.ref(t), out, t._version)
        if step.holds:
            self._follow_hold(out, t)
            self._held_versions[out] = t._version
        self._n = step.next_vid
        self._i = i + 1
        return out

    def _follow_hold(self, vid: int, t: Tensor) -> None:
        """:meth:`_hold` while following (storages are tracked again if the forward departs)."""
        self.held[vid] = t.detach()
        self._fresh.append((vid, weakref.ref(t)))

    def _encode_follow(self, step: "_FollowStep", args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This forward's arguments in tape form: the tape's Refs, this forward's constants."""
        eargs = tuple(e if type(e) is Ref or (type(e) is list and _has_ref(e)) else a
                      for a, e in zip(args, step.args))
        ekwargs = {k: e if _has_ref(e) else kwargs[k] for k, e in step.kwargs.items()}
        return eargs, ekwargs

    def _encode_all(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[int]]:
        """An op's arguments in tape form, and the values they read (recording mode)."""
        deps: list[int] = []
        eargs = tuple([self._encode(a, deps) for a in args])
        ekwargs = {k: self._encode(v, deps) for k, v in kwargs.items()} if kwargs else kwargs
        return eargs, ekwargs, deps

    def _follow_pack(self, t: Tensor) -> Any:
        """The pack hook while following; None to fall back to recording mode's answer."""
        ent = self._fids.get(id(t))
        if ent is None or ent[0]() is not t:
            if self._follow_derive(t) is None:
                handle = self._as_is(t)
                self._note_off_tape(t, handle.tensor)
                return handle
            ent = self._fids[id(t)]
        vid = ent[1]
        if type(t) not in _PLAIN and self._stale_dtensor(t, vid):  # its shard was written
            if self._follow_derive(t) is None:
                self._leave_follow()
                return None
            vid = self._fids[id(t)][1]
        elif t._version != ent[2]:  # written through another alias: recording mode makes a new value
            self._leave_follow()
            return None
        if not self._verified.tape.produced(vid):
            return self._as_is(t)
        self._reads[vid] = self._reads.get(vid, 0) + 1
        handle = Saved(self.link, vid, t)
        if self.verify:
            self._fingerprint(vid, t)
        self._saved.append(handle)
        return handle

    def _leave_follow(self) -> None:
        """The program departs from the followed tape: turn what was followed into a recording
        of its own (the tape's ops and values so far, with this forward's versions, constants,
        generator states and reads) and record the rest of the forward."""
        self._flush_off_tape()
        verified = self._verified
        self._verified = None
        ref = verified.tape
        tape = self.tape
        n = self._n
        snapshot_sids = set()
        for rv in ref.values[:n]:
            v = copy.copy(rv)
            v.reads = self._reads.get(v.vid, 0)
            if v.kind == SNAPSHOT:  # here the live external, not a copy (VerifiedTape.eligible)
                v.kind = EXTERNAL
                snapshot_sids.add(v.sid)
            tape.values.append(v)
        for i in range(self._i):
            op = copy.copy(ref.ops[i])
            if i in self._args:
                op.args, op.kwargs = self._args[i]
            if op.rng is not None:
                op.rng = self._rng[i]
            op.time_s = None
            tape.ops.append(op)
        n_sids = 1 + max((v.sid for v in tape.values), default=-1)
        tape.storage_nbytes = {s: ref.storage_nbytes[s] for s in range(n_sids)}
        tape.external_sids = {s for s in ref.external_sids if s < n_sids} | snapshot_sids
        values = tape.values
        for r, vid, version in self._fids.values():
            t = r()
            if t is None:
                continue
            values[vid].version = version
            self._ids[id(t)] = (r, vid)
            parts = _dtensor_parts(t)
            if parts is not None:
                known = self._dtensors.get(vid)
                self._note_dtensor(vid, t, known[1] if known is not None and known[0]() is t else None)
            try:
                st = (t if parts is None else parts[0]).untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            self._storages[id(st)] = (weakref.ref(st), values[vid].sid)
        # A held value's version as this forward saw it, also where its tensor is gone and its id
        # reused (a parameter's transpose that only the held alias outlives): the tape's version
        # is the verified forward's, and backward checks the held alias against it.
        for vid, version in self._held_versions.items():
            values[vid].version = version
        for vid in self.held:
            self._held_by_sid.setdefault(values[vid].sid, set()).add(vid)
        for op in tape.ops:
            for _, after in op.writes:
                self._last_write[values[after].sid] = after
            if type(op.func) is KernelLaunch:  # invariant 11 from here on
                for _, after in op.writes:
                    self._kernel_written[values[after].sid] = after
                continue
            info = op_info(op.func)
            if info.allocates or info.view_of is not None and any(d in self._unwritten for d in op.deps):
                # Invariant 10 from here on: what the followed part allocated and did not hold.
                # Whole overwrites are not known without the tensors: those storages stay unwritten.
                for o in op.outs:
                    if o is not None and o not in self.held:
                        self._unwritten.add(o)
                        if info.allocates:
                            self._unwritten_sids.add(values[o].sid)
        self._fids, self._reads, self._rng, self._args, self._held_versions = {}, {}, {}, {}, {}
        self._dtensors = {}

    def _flush_off_tape(self) -> None:
        """Count the saved tensors a followed forward put off (:meth:`_note_off_tape`), but the
        ones the forward bound to a value that was the block's own parameter or buffer."""
        later, self._off_tape_later = self._off_tape_later, []
        fids = self._fids
        for key, r, alias in later:
            t = r()
            ent = fids.get(key)
            if t is not None and ent is not None and ent[0]() is t:
                # Bound: the block's own when the value was in the verified forward (the same
                # program reads the same parameters at the same place); else an input.
                if ent[1] not in self.owned_vids:
                    self._count_off_tape(t)
                continue
            self._note_off_tape(alias if t is None else t)
