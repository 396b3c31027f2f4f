"""Serve autograd's unpacks for one recorded block forward by rerunning only what is needed.

Invariants (numbered as in recorder.py's, continued):

7. An unpack runs only the producer chain of the asked value that is not already available
   (held, or cached by an earlier unpack). Values backward never unpacks are never rebuilt.
8. A rebuilt value stays cached exactly while something still needs it: pending unpacks of it, or
   ops of the block's replay closure that read it and have not run. Then it is dropped.
9. An in-place op is replayed on its own copy whenever the tensor it writes (or any alias of that
   storage) is still needed by someone else, so no cached or held value is ever clobbered.
10. Replay runs the recorded overloads with grad and autocast off; random ops restore their
    recorded generator state and put the current one back afterwards.
11. Held inputs and views of them must not have changed since the forward; if they did (an
    in-place op after the block), the unpack fails with an error instead of computing garbage.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from .errors import ReplayError
from .tape import EXTERNAL, PRODUCED, Ref, TapeOp, flatten_outputs

if TYPE_CHECKING:
    from .recorder import Recorder

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
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield


class Replayer:
    """Replay state of one recorded forward; lives exactly as long as its saved handles."""

    def __init__(self, rec: "Recorder") -> None:
        tape = rec.tape
        self.tape = tape
        self.block = rec.block
        self.stats = None
        """The block's stats dict, updated in place while replaying (set by the wrapper)."""
        values = tape.values
        held = rec.held
        reads = tape.read_vids()
        self.closure_ops = tape.producer_closure(reads, held)
        rc: Counter[int] = Counter()
        for vid in reads:
            rc[vid] += values[vid].reads
        for i in self.closure_ops:
            for d in tape.ops[i].deps:
                rc[d] += 1
        # Invariant 2 is now exact: hold only what is read or feeds the closure.
        for vid in [v for v in held if v not in rc]:
            del held[vid]
        self.pinned: dict[int, Tensor] = {}
        """Held values replay cannot rebuild (externals, snapshots, keep-only outputs, free views)."""
        self.kept: dict[int, Tensor] = {}
        """Held values replay could rebuild; kept by the policy, dropped at their last use (as
        the cache drops rebuilt ones), or at the end of the pass."""
        for vid, t in held.items():
            v = values[vid]
            if v.kind == PRODUCED and not v.free and tape.ops[v.op].keep_only is None:
                self.kept[vid] = t
            else:
                self.pinned[vid] = t
        held.clear()
        self._watch = {vid: w for vid, w in rec.watch.items() if vid in self.pinned}
        rec.watch = {}
        self.debug_refs = rec.debug_refs
        rec.debug_refs = None
        self._rc0 = dict(rc)
        self._reads0 = sum(values[v].reads for v in reads)
        self.rc = dict(rc)
        self.cache: dict[int, Tensor] = dict(self.pinned)
        self.cache.update(self.kept)
        self._reads_left = self._reads0
        self._pass_started = False
        self.on_unpack = None
        """Memory tracing: called with the value's id at the start of every unpack."""

    # Accounting -------------------------------------------------------------------------------

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

    def input_bytes(self, owned_vids: set[int]) -> int:
        """Bytes of distinct non-parameter external storages held (the block's checkpoint)."""
        seen: dict[int, int] = {}
        values = self.tape.values
        for vid, t in self.pinned.items():
            v = values[vid]
            if v.kind == EXTERNAL and vid not in owned_vids:
                seen[_storage_ptr(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())

    # Unpack -----------------------------------------------------------------------------------

    def _new_pass(self) -> None:
        """Every saved value was unpacked once (or this is the first unpack): reset the counts."""
        self.rc = dict(self._rc0)
        self._reads_left = self._reads0
        self._pass_started = True
        for vid, (ref, version) in self._watch.items():
            t = ref()
            if t is not None and t._version != version:
                raise ReplayError(
                    f"TapeSAC block {self.block}: a tensor the block read (value %{vid}, shape "
                    f"{list(t.shape)}) was modified in place after the block's forward, so the "
                    "block cannot be recomputed. Avoid in-place updates of block inputs or "
                    "parameters between forward and backward."
                )
        if self.stats is not None:
            self.stats["ops_replayed"] = 0
            self.stats["recomputed_bytes"] = 0

    def unpack(self, vid: int) -> Tensor:
        if not self._pass_started or self._reads_left <= 0:
            self._new_pass()
        if self.on_unpack is not None:
            self.on_unpack(vid)
        t = self.cache.get(vid)
        if t is None:
            t = self._materialize(vid)
        self._reads_left -= 1
        self._release(vid)
        if self._reads_left <= 0:
            # The pass is over: kept values go too (a retained graph's next pass rebuilds them).
            self.kept.clear()
        if self.debug_refs is not None:
            self._check(vid, t)
        return t

    def _release(self, vid: int) -> None:
        n = self.rc.get(vid, 0) - 1
        self.rc[vid] = n
        if n <= 0 and vid not in self.pinned:
            self.cache.pop(vid, None)
            self.kept.pop(vid, None)

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
        cache = self.cache
        to_run: set[int] = set()
        seen: set[int] = set()
        stack = [vid]
        while stack:
            u = stack.pop()
            if u in seen or u in cache:
                continue
            seen.add(u)
            v = values[u]
            if v.kind != PRODUCED or v.op < 0 or ops[v.op].keep_only is not None:
                raise ReplayError(
                    f"TapeSAC block {self.block}: value %{u} is needed again but is neither held nor "
                    "replayable (a second backward through a graph whose held inputs were released?)"
                )
            if v.op not in to_run:
                to_run.add(v.op)
                stack.extend(ops[v.op].deps)
        order = sorted(to_run)
        pending: Counter[int] = Counter()
        for i in order:
            pending.update(ops[i].deps)
        local: dict[int, Tensor] = {}
        with _replay_mode():
            for i in order:
                self._run(ops[i], local, pending, vid)
        return local[vid]

    def _run(self, op: TapeOp, local: dict[int, Tensor], pending: Counter, target: int) -> None:
        """Run one op of an unpack's chain; ``local`` holds this chain's values still to be read."""
        cache = self.cache

        def lookup(vid: int) -> Tensor:
            t = local.get(vid)
            return t if t is not None else cache[vid]

        args = [_resolve(a, lookup) for a in op.args]
        kwargs = {k: _resolve(a, lookup) for k, a in op.kwargs.items()} if op.kwargs else {}
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
            else:  # written in place: the old version is gone (invariant 9 said nobody needs it)
                local.pop(before, None)
                cache.pop(before, None)
                self.kept.pop(before, None)
            write_out[after] = t

        if op.rng is not None:
            gen, state = op.rng
            current = gen.get_state()
            gen.set_state(state)
            try:
                out = op.func(*args, **kwargs)
            finally:
                gen.set_state(current)
        else:
            out = op.func(*args, **kwargs)

        flat = flatten_outputs(out)
        rc = self.rc
        if stats is not None:
            stats["ops_replayed"] += 1
            stats["recomputed_bytes"] += op.alloc_bytes  # the same op allocated as much in the forward
        for slot, vid in enumerate(op.outs):
            if vid is None:
                continue
            t = write_out.get(vid)
            if t is None:
                t = flat[slot]
            if pending[vid] > 0 or vid == target:
                local[vid] = t
            if rc.get(vid, 0) > 0:
                cache[vid] = t
        pinned = self.pinned
        for d in op.deps:
            n = rc.get(d, 0) - 1
            rc[d] = n
            if n <= 0 and d not in pinned:
                cache.pop(d, None)
                self.kept.pop(d, None)
            if pending[d] <= 0 and d != target:
                local.pop(d, None)

    def _shared(self, vid: int, t: Tensor, local: dict, pending: Counter) -> bool:
        """Invariant 9: would writing ``t`` in place clobber something still needed?"""
        if vid in self.pinned or self.rc.get(vid, 0) > 1 or pending[vid] > 0:
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
