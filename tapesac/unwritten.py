"""Bytes the dispatcher did not see written: the recorder's invariants 10 and 11.

Values no recorded op wrote (allocations filled by a kernel the dispatcher never saw, views of
them) are held at their first read, never rebuilt; Triton launches are tape steps whose values
are the arguments they wrote (:class:`UnseenWrites`, mixed into
:class:`~tapesac.recorder.Recorder`).
"""

from __future__ import annotations

from typing import Any

import torch

from .fingerprints import fingerprint
from .kernels import KernelLaunch, launch_constants, written_by_analysis
from .ops import OpInfo, clone_as_is, op_info
from .handoff import storage_alias
from .tape import PRODUCED, UNSEEN, Ref, TapeOp

Tensor = torch.Tensor


def _covers_storage(t: Tensor) -> bool:
    """Whether writing every element of ``t`` writes every byte of its storage."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    if t.storage_offset() != 0 or t.numel() * t.element_size() != nbytes:
        return False
    expected = 1  # non-overlapping and dense: the strides, sorted, are running products of sizes
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


_KERNEL_INFO = OpInfo(name="triton kernel", write_args=(), write_if_training=False, inplace_view=False,
                      random=False, keep_only=None)
"""What :meth:`~tapesac.recorder.Recorder._commit` needs to know of a Triton launch: it writes what it is told to."""


def kernel_arg_names(kernel: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``(name, value)`` of each argument of a launch (positional ones named by the kernel's
    signature)."""
    from .kernels import _signature_of

    names = _signature_of(kernel)[0]
    out = [(names[i] if i < len(names) else str(i), a) for i, a in enumerate(args)]
    out.extend(kwargs.items())
    return out


class UnseenWrites:
    """The recorder's part that keeps invariants 10 (unwritten values are held) and 11 (a Triton
    launch is a tape step; other aliases of what it wrote are read as new values)."""

    def _init_unseen(self, keep_only_ops: frozenset | set) -> None:
        self._keep_only_ops = keep_only_ops
        """Op indices whose replay gave other bytes than their forward: keep-only (:data:`UNSEEN`)."""
        self._unwritten: set[int] = set()
        """Values no recorded op wrote, not held yet (invariant 10)."""
        self._unwritten_sids: set[int] = set()
        """Storages an allocation made that no recorded op has overwritten whole (invariant 10)."""
        self._kernel_written: dict[int, int] = {}
        """sid -> the value a Triton launch last wrote there (invariant 11)."""
        self.kernel_launches = 0
        """Triton launches recorded as tape steps in this forward."""

    def _vid_now(self, t: Any) -> int | None:
        """The value ``t`` is mapped to now, without refreshing it (None: not on the tape)."""
        ent = self._ids.get(id(t)) if isinstance(t, Tensor) else None
        return ent[1] if ent is not None and ent[0]() is t else None

    def _read_unwritten(self, info: OpInfo, args: tuple, kwargs: dict) -> None:
        """Hold every unwritten value whose contents this op reads (invariant 10)."""
        unread = info.unread
        for where, a in (*enumerate(args), *kwargs.items()):
            if where in unread:
                continue
            for t in (a if type(a) in (list, tuple) else (a,)):
                vid = self._vid_now(t)
                if vid is not None and vid in self._unwritten:
                    self._hold_unseen(vid, t)

    def _note_unwritten(self, op: TapeOp, info: OpInfo, tensors: list, view_unwritten: bool) -> None:
        """After an op: which of its values are unwritten, and which storages it wrote whole."""
        values = self.tape.values
        written = {after for _, after in op.writes}
        for before, _after in op.writes:  # superseded: a later read is of the new version
            self._unwritten.discard(before)
        for vid, t in zip(op.outs, tensors):
            if vid is None:
                continue
            v = values[vid]
            if info.allocates or (view_unwritten and vid not in written):
                self._unwritten.add(vid)
                if info.allocates:
                    self._unwritten_sids.add(v.sid)
            elif vid in written and v.sid in self._unwritten_sids and _covers_storage(t):
                self._unwritten_sids.discard(v.sid)

    def _hold_unseen(self, vid: int, t: Tensor) -> None:
        """Hold an unwritten value as it is now and make its op keep-only (invariant 10): replay
        cannot make bytes that no recorded op wrote. Other outputs of that op still alive are
        held with it (it is keep-only as a whole)."""
        tape = self.tape
        root, root_t = self._unwritten_root(vid)
        if root_t is not None and root != vid:
            vid, t = root, root_t  # hold the allocation itself: the views of it replay from it
        op = tape.ops[tape.values[vid].op]
        if op.keep_only is None:
            op.keep_only = UNSEEN
        bypass, self._bypass = self._bypass, True
        try:
            pending = [(vid, t)]
            if len(op.outs) > 1:
                alive = {v: r for r, v in self._ids.values()}
                for o in op.outs:
                    r = alive.get(o) if o is not None and o != vid else None
                    t_o = None if r is None else r()
                    if t_o is not None and t_o._version == tape.values[o].version:
                        pending.append((o, t_o))
            for o, t_o in pending:
                self._unwritten.discard(o)
                if o not in self.held:
                    self._hold(o, t_o)
        finally:
            self._bypass = bypass
        if op_info(op.func).allocates:  # the whole storage is held now: its views replay from it
            values = tape.values
            sid = values[vid].sid
            self._unwritten_sids.discard(sid)
            self._unwritten = {u for u in self._unwritten if values[u].sid != sid}

    def _unwritten_root(self, vid: int) -> tuple[int, Tensor | None]:
        """The allocation an unwritten view was taken from (through view ops), and its tensor if
        it is still alive; ``(vid, None)`` when there is none to hold instead."""
        tape = self.tape
        values, ops = tape.values, tape.ops
        root = vid
        while True:
            v = values[root]
            if v.op < 0:
                break
            op = ops[v.op]
            info = op_info(op.func)
            if info.allocates or info.view_of is None or not op.deps or op.deps[0] not in self._unwritten:
                break
            root = op.deps[0]
        if root == vid or not op_info(ops[values[root].op].func).allocates:
            return vid, None
        for r, bound in self._ids.values():
            if bound == root:
                t = r()
                if t is not None and t._version == values[root].version:
                    return root, t
        return vid, None

    def launch_kernel(self, kernel: Any, run: Any, args: tuple, kwargs: dict) -> Any:
        """A Triton launch inside the block's forward (:mod:`tapesac.kernels` routes it here):
        run it and put it on the tape as a :class:`~tapesac.kernels.KernelLaunch` step whose
        values are the arguments it wrote (invariants 10 and 11); following, check it against
        the tape's next step instead."""
        if self._bypass or self._seg_run is not None or "grid" not in kwargs:
            # Inside another launch or a pure call; or a launcher that is not Triton's own
            # (invariant 10 and replay invariant R6 cover what it writes).
            return run(kernel, *args, **kwargs)
        if self._fresh:
            self._settle()
        self._bypass = True  # what runs here (the launch, copies, fingerprints) is not the block's
        try:
            return self._launch(kernel, args, kwargs)
        finally:
            self._bypass = False

    def _launch(self, kernel: Any, args: tuple, kwargs: dict) -> Any:
        kwargs = dict(kwargs)
        grid = kwargs.pop("grid")
        kwargs.pop("warmup", None)
        launch = KernelLaunch(kernel, grid, launch_constants(kernel, args, kwargs))
        tensors: dict[int, Tensor] = {}
        for a in (*args, *kwargs.values()):
            for t in (a if type(a) in (list, tuple) else (a,)):
                if isinstance(t, Tensor):
                    tensors.setdefault(id(t), t)
        static = written_by_analysis(kernel, args, kwargs)
        if static is not None:
            maybe = list({id(t): t for n, t in kernel_arg_names(kernel, args, kwargs)
                          if n in static and isinstance(t, Tensor)}.values())
        else:
            maybe = list(tensors.values())
        self.kernel_launches += 1
        verified = self._verified
        if verified is not None:
            i = self._i
            step = verified.steps[i] if i < len(verified.steps) else None
            seen = (self._match_args(step, args, kwargs)
                    if step is not None and step.func == launch and step.func.same_grid(launch) else None)
            if seen is None:
                self._leave_follow()
            else:
                # Held values a write would clobber, should the launch write other arguments than
                # the tape's (then it is recorded after all, and invariant 3 needs them).
                values = verified.tape.values
                sids = {values[seen[id(t)]].sid for t in maybe if id(t) in seen}
                copies = {vid: clone_as_is(h) for vid, h in self.held.items()
                          if values[vid].sid in sids and not (values[vid].kind == PRODUCED
                                                             and verified.tape.ops[values[vid].op].keep_only is None)}
                out, written_ts, _ = self._run_launch(launch, args, kwargs, maybe, static)
                if {seen.get(id(t)) for t in written_ts} == set(step.after):
                    return self._follow_out(step, i, launch, args, kwargs, [(t, False) for t in written_ts], seen, out)
                self._leave_follow()  # it wrote other arguments than when it was recorded
                return self._commit_launch(launch, args, kwargs, tensors, written_ts, copies, None, out)
        eargs_deps = self._encode_all(args, kwargs)
        # What the written arguments were before the launch (its own ATen ops, an autotuner's
        # pre-hook zeroing an output, may move their version counters).
        before = {id(t): self._lookup(t) for t in maybe}
        # Held values in the storages the launch may write, as they are before it (invariant 3).
        copies = {}
        for t in maybe:
            for hv in self._held_by_sid.get(self._sid(t), ()):
                v = self.tape.values[hv]
                if hv not in copies and not (v.kind == PRODUCED and self.tape.ops[v.op].keep_only is None):
                    copies[hv] = clone_as_is(self.held[hv])
        out, written_ts, elapsed = self._run_launch(launch, args, kwargs, maybe, static, timed=True)
        return self._commit_launch(launch, args, kwargs, tensors, written_ts, copies, elapsed, out, eargs_deps,
                                   before)

    def _run_launch(self, launch: KernelLaunch, args: tuple, kwargs: dict, maybe: list, static: Any,
                    timed: bool = False) -> tuple[Any, list, float | None]:
        """Run a launch (the mode bypassed); (its result, the tensors it wrote, its measured time
        when profiling). Without PyTorch's analysis of the kernel, the tensors it wrote are those
        whose bytes it changed."""
        before = [fingerprint(t) for t in maybe] if static is None else None
        if before is not None and any(fp is None for fp in before):
            before = None  # a tensor subclass: take every argument as written
        if timed and self.timer is not None:
            out, elapsed = self.timer.call(launch, args, kwargs, can_repeat=False, rng=None)
        else:
            out, elapsed = launch(*args, **kwargs), None
        if before is None:
            return out, maybe, elapsed
        return out, [t for t, fp in zip(maybe, before) if not torch.equal(fingerprint(t), fp)], elapsed

    def _commit_launch(self, launch: KernelLaunch, args: tuple, kwargs: dict, tensors: dict, written_ts: list,
                       copies: dict, elapsed: float | None, out: Any, encoded: Any = None,
                       looked_up: dict | None = None) -> Any:
        """Put a launch that has run on the tape (recording mode)."""
        eargs, ekwargs, deps = encoded if encoded is not None else self._encode_all(args, kwargs)
        if self._unwritten:  # what the launch read but did not write
            written_ids = {id(t) for t in written_ts}
            for t in tensors.values():
                vid = self._vid_now(t)
                if id(t) not in written_ids and vid is not None and vid in self._unwritten:
                    self._hold_unseen(vid, t)
        before = [looked_up[id(t)] if looked_up is not None and id(t) in looked_up else self._lookup(t)
                  for t in written_ts]
        for t in written_ts:
            self._before_write(t, copies)
        self._commit(launch, _KERNEL_INFO, args, eargs, ekwargs, deps, [(t, False) for t in written_ts], before,
                     None, elapsed, out)
        op = self.tape.ops[-1] if self.tape.ops else None
        if op is not None and op.func is launch:
            for b, after in op.writes:
                self._kernel_written[self.tape.values[after].sid] = after
                self._unwritten.discard(after)
                self._unwritten.discard(b)
            for t in written_ts:  # a launch writes what it writes: taken as whole (see README)
                if _covers_storage(t):
                    self._unwritten_sids.discard(self._sid(t))
            if op.writes and self._saved:
                self._repoint_saved(op)
        return out

    def _repoint_saved(self, op: TapeOp) -> None:
        """Invariant 11: autograd reads a saved tensor's storage as it is in backward, and a
        launch moves no version counter, so a tensor saved before a launch wrote its storage is
        read with the launch's bytes. Point its handle at a value of the written storage with the
        saved tensor's view (it replays from the launch's output)."""
        values = self.tape.values
        written = {values[after].sid: after for _, after in op.writes}
        afters = set(written.values())
        for h in self._saved:
            v = values[h.vid]
            if v.sid not in written or h.vid in afters:
                continue
            t = h.ref() if h.ref is not None else None
            if t is None:
                v.reads -= 1
                h.vid = -1  # the saved view is gone: its unpack explains (unpack_saved)
                continue
            src = written[v.sid]
            new = self._step(storage_alias, (Ref(src), t.dtype, tuple(t.shape), tuple(t.stride()),
                                             t.storage_offset()), src, t)
            v.reads -= 1
            values[new].reads += 1
            h.vid = new
            if self.verify:
                self._fingerprint(new, t)
