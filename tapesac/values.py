"""The recorder's map from tensors to tape values: invariants 1 (identity, never order), 4 (each
version of a mutated tensor is a value of its own) and 8 (a DTensor and its shard are one storage).

:class:`ValueMap` is mixed into :class:`~tapesac.recorder.Recorder`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .handoff import _PLAIN, _dtensor_parts, as_dtensor, local_shard, storage_alias
from .tape import EXTERNAL, PRODUCED, UNSEEN, Ref, TapeOp

Tensor = torch.Tensor


class ValueMap:
    """Tensors to values by identity (``id`` plus a weak reference), storages to storage ids, and
    the values of DTensor shards; new values for tensors written through another alias."""

    def _init_values(self, owned: Any) -> None:
        self._owned_of = owned
        """The block's own parameters and buffers, or a callable that lists their ids."""
        self._owned_ids: set[int] | None = None
        """ids of the block's own parameters and buffers (not counted as inputs), from ``owned``
        (a callable) at the first external."""
        self.owned_vids: set[int] = set()
        self._ids: dict[int, tuple[weakref.ref, int]] = {}
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._shards: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        """id(local shard) -> (weak ref to it, weak ref to its DTensor), for DTensors on the tape."""
        self._shard_versions: dict[int, int] = {}
        """vid of a DTensor value -> its shard's version then (invariant 8)."""

    def _sid(self, t: Tensor) -> int:
        parts = _dtensor_parts(t) if type(t) not in _PLAIN else None
        if parts is not None:
            t = parts[0]  # invariant 8: a DTensor lives in its shard's storage
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
            return self._derived(t) if self._shards or type(t) not in _PLAIN else None
        vid = ent[1]
        if t._version != self.tape.values[vid].version or (
                self._shard_versions and vid in self._shard_versions
                and t._local_tensor._version != self._shard_versions[vid]) or (
                self._kernel_written and vid < self._kernel_written.get(self.tape.values[vid].sid, -1)):
            vid = self._refresh(t)
        return vid

    def _note_dtensor(self, vid: int, t: Tensor, shard_version: int | None = None) -> None:
        """Register a DTensor value's shard, so a later read of the shard maps to it, with the
        shard's version while the value is current (now, unless given) (invariant 8)."""
        parts = _dtensor_parts(t)
        if parts is not None:
            local = parts[0]
            self._shards[id(local)] = (weakref.ref(local), weakref.ref(t))
            self._shard_versions[vid] = local._version if shard_version is None else shard_version
            self.tape.values[vid].wrapper = True

    def _derived(self, t: Tensor) -> int | None:
        """A tensor no recorded op returned that is the shard of a DTensor on the tape, or a
        DTensor over a local tensor on the tape, becomes a value of a :func:`local_shard` or
        :func:`as_dtensor` step (invariant 8); None for anything else."""
        if type(t) in _PLAIN:
            if not self._shards:
                return None
            ent = self._shards.get(id(t))
            if ent is None or ent[0]() is not t:
                return None
            owner = ent[1]()
            dvid = None if owner is None else self._lookup(owner)
            return None if dvid is None else self._step(local_shard, (Ref(dvid),), dvid, t)
        parts = _dtensor_parts(t)
        if parts is None:
            return None
        lvid = self._lookup(parts[0])
        if lvid is None:
            return None
        return self._step(as_dtensor, (Ref(lvid), parts[1], str(parts[1].placements)), lvid, t)

    def _step(self, func: Any, args: tuple, dep: int, t: Tensor) -> int:
        """Put a step of the recorder's own (not a dispatched op) on the tape, producing ``t``."""
        idx = len(self.tape.ops)
        op = TapeOp(func, args, {}, (dep,))
        self.tape.ops.append(op)
        vid = self._produced(idx, 0, t, t._version, self._sid(t))
        if dep in self._unwritten:
            # Invariant 10 through invariant 8: a DTensor over an unwritten shard, or the shard of
            # an unwritten DTensor (a kernel's output wrapped by ``local_map``), is as unwritten.
            self._unwritten.add(vid)
        op.outs = [vid]
        op.n_returned = 1
        op.time_s = 0.0
        if idx in self._keep_only_ops:  # its replay once differed (replay invariant R6)
            op.keep_only = UNSEEN
        if (idx, 0) in self._keep or op.keep_only is not None:
            self._bypass, bypass = True, self._bypass
            try:
                self._hold(vid, t)
            finally:
                self._bypass = bypass
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
        if type(t) not in _PLAIN:
            self._note_dtensor(vid, t)
        self._hold(vid, t)
        if id(t) in self._owned:
            self.owned_vids.add(vid)
        return vid

    @property
    def _owned(self) -> set[int]:
        if self._owned_ids is None:
            owned = self._owned_of
            self._owned_ids = set() if owned is None else owned() if callable(owned) else owned
        return self._owned_ids

    def _produced(self, op: int, slot: int, t: Tensor, version: int, sid: int) -> int:
        vid = self.tape.add_value(op, slot, PRODUCED, t, version, sid)
        self._ids[id(t)] = (weakref.ref(t), vid)
        if type(t) not in _PLAIN:
            self._note_dtensor(vid, t)
        return vid

    def _refresh(self, t: Tensor) -> int:
        """``t`` was written through another alias of its storage: make its new content a value."""
        parts = _dtensor_parts(t)
        if parts is not None:  # invariant 8: the DTensor over its shard's current value
            ent = self._ids.get(id(parts[0]))
            lvid = self._lookup(parts[0]) if ent is not None and ent[0]() is parts[0] else None
            if lvid is None:
                return self._external(t)
            return self._step(as_dtensor, (Ref(lvid), parts[1], str(parts[1].placements)), lvid, t)
        sid = self._sid(t)
        src = self._last_write.get(sid)
        if src is None:
            # Written by code the dispatcher never saw: all we can do is hold it as it is now.
            return self._external(t)
        vid = self._step(storage_alias, (Ref(src), t.dtype, tuple(t.shape), tuple(t.stride()),
                                         t.storage_offset()), src, t)
        if sid in self._unwritten_sids:  # invariant 10: parts of it no recorded op wrote
            self._unwritten.add(vid)
        return vid

