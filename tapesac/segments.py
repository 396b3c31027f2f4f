"""Pure module calls that a followed forward runs without the dispatch mode.

A followed forward (:class:`~tapesac.follow.VerifiedTape`) still pays the recorder's dispatch
mode on every op: a Python call per op, most of it torch's own machinery (a do-nothing mode
costs as much as TapeSAC's checks). Inside some modules that cost buys nothing, because what
their forward dispatches is fixed by what can be checked before it runs:

* its class is one of :data:`PURE_MODULES` (exactly; not a subclass), whose ``forward`` is one
  functional call on its arguments and parameters, with no state, no random numbers, no writes
  to anything it did not make, and no branch on tensor values;
* the same ``forward`` function (the class attribute), the same tensors where the verified
  forward read values it had already seen (identity and version), the same metadata of every
  tensor argument and parameter (shape, strides, dtype, device, requires_grad), the same
  non-tensor arguments and module settings (``eps``, ``normalized_shape``), grad mode on or off
  alike, no autocast, and no other dispatch or function mode active.

Those fix the ATen ops the call dispatches, their constants, and which tensors autograd saves,
in which order. So when a followed forward reaches such a call where its verified forward made
one (a :class:`Segment`, learned while recording), it runs the call with the dispatch mode off
and maps what it needs by order: the k-th saved tensor to the k-th value the verified call
saved, the output to its output, parameters met for the first time to their values. Before
anything of that is kept, the counts, shapes and dtypes are checked against the tape; on any
difference the call's results are dropped and the call runs again under the mode, op by op (the
module is pure: running it twice changes nothing), where a real change of program departs from
the tape as usual.

Not covered (run op by op as before): calls with keyword arguments, tensor subclasses (DTensor),
calls under autocast or under another mode (TapeSAC's storage counter in measured steps, a
user's), segments whose ops draw random numbers or write a tensor the call did not make, or
whose held values (what a keep set keeps) are neither saved, nor the output, nor a parameter.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

from .handoff import _PLAIN, Saved

Tensor = torch.Tensor

PURE_MODULES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    nn.Linear: (("weight", "bias"), ()),
    nn.RMSNorm: (("weight",), ("normalized_shape", "eps")),
    nn.LayerNorm: (("weight", "bias"), ("normalized_shape", "eps")),
}
"""Module class -> (its tensor attributes, its settings that reach the ops)."""



@dataclasses.dataclass(eq=False)
class Segment:
    """One pure module call of a recorded forward: ops ``[start, end)``, values ``[n_start, n_end)``."""

    start: int
    end: int
    n_start: int
    n_end: int
    module: weakref.ref
    fn: Any
    """``type(module).forward`` when recorded."""
    key: tuple
    """:func:`call_key` of the recorded call."""
    sources: tuple[tuple[int, bool], ...]
    """Per tensor argument, then per tensor attribute: (value, first met inside the call)."""
    packs: tuple[tuple[int, bool], ...]
    """Per tensor autograd saved inside the call, in order: (value, saved as a replay handle)."""
    out: int
    first_met: frozenset = frozenset()
    """Values of ``sources`` first met inside the call (set by VerifiedTape)."""
    hold_at_pack: frozenset = frozenset()
    """Values the tape holds that the call made and autograd saved (set by VerifiedTape)."""
    hold_out: bool = False


_MISSING = object()


def module_tensors(module: nn.Module) -> tuple[Any, ...]:
    """The module's tensor attributes (parameters first looked up where nn.Module keeps them)."""
    registered = module._parameters
    out = []
    for name in PURE_MODULES[type(module)][0]:
        t = registered.get(name, _MISSING)
        out.append(getattr(module, name, None) if t is _MISSING else t)
    return tuple(out)


def _meta(a: Any) -> Any:
    if isinstance(a, Tensor):
        return (a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
    return (type(a), a)


def call_key(module: nn.Module, args: tuple, params: tuple) -> tuple | None:
    """What fixes the ops of a call of ``module`` (see the module docstring), or None when the
    call is not one a followed forward may run unobserved."""
    for a in (*args, *params):
        if isinstance(a, Tensor) and type(a) not in _PLAIN:
            return None
    if (torch._C._len_torch_dispatch_stack() != 1 or torch._C._len_torch_function_stack()
            or torch._C._is_any_autocast_enabled()):
        return None
    settings = tuple(getattr(module, name) for name in PURE_MODULES[type(module)][1])
    return (torch.is_grad_enabled(), tuple(map(_meta, args)), tuple(map(_meta, params)), settings)


def eligible(seg: Segment, tape: Any, steps: list, replayable: frozenset) -> bool:
    """Whether a followed forward may run ``seg`` unobserved; sets what it then holds."""
    if seg.end <= seg.start or any(p[0] is None for p in seg.packs):
        return False
    inside = range(seg.n_start, seg.n_end)
    first_met = {vid for vid, new in seg.sources if new}
    for op in tape.ops[seg.start:seg.end]:
        if op.rng is not None or not hasattr(op.func, "_schema"):
            return False
        if any(before not in inside or before in first_met for before, _ in op.writes):
            return False  # writes what the call did not make (eps added in place is fine)
    if any(saved != (vid in replayable) for vid, saved in seg.packs):
        return False
    packed = {vid for vid, _ in seg.packs}
    held = {vid for step in steps[seg.start:seg.end] for _, vid in step.holds}
    if not held <= first_met | packed | {seg.out}:
        return False  # a value the tape holds that the call makes and nobody sees
    escapes = first_met | {seg.out}
    for op in tape.ops[seg.end:]:
        if any(d in inside and d not in escapes for d in op.deps):
            return False  # read after the call: it is not what the call returned
    seg.first_met = frozenset(first_met)
    seg.hold_at_pack = frozenset(held & packed - first_met - {seg.out})
    seg.hold_out = seg.out in held
    return True


class SegmentRunning:
    """The recorder's part for pure module calls (mixed into :class:`~tapesac.recorder.Recorder`):
    learn them while recording, run them unobserved while following."""

    def _init_segments(self, learn: bool) -> None:
        self._learn = learn
        """Recording: note pure module calls (:meth:`run_module`) for forwards that follow."""
        self.segments: list[Segment] = []
        self._seg_learn: list | None = None
        """While recording a pure module call: what each pack inside it returned."""
        self._seg: Segment | None = None
        self.unobserved_ops = 0
        """Tape ops this forward ran with the dispatch mode off (pure module calls)."""
        self._seg_run: list | None = None
        """While a followed forward runs a pure module call unobserved: (tensor, handle) per pack."""

    def run_module(self, module: nn.Module, fn: Any, args: tuple, kwargs: dict) -> Any:
        """A call of a :data:`~tapesac.segments.PURE_MODULES` module inside the block: learn it
        (recording), run it unobserved (following, where the verified tape has it), or just run it."""
        if kwargs or self._seg_run is not None or self._seg_learn is not None or self._bypass:
            return fn(*args, **kwargs)
        verified = self._verified
        if verified is not None:
            # A verification forward fingerprints every saved tensor: no call runs unobserved.
            seg = None if self.verify else verified.segments.get(self._i)
            if seg is not None:
                out = self._run_segment(verified, seg, module, fn, args)
                if out is not None:
                    return out
            return fn(*args)
        if not self._learn:
            return fn(*args)
        params = module_tensors(module)
        key = call_key(module, args, params)
        if key is None:
            return fn(*args)
        tape = self.tape
        start, n_start = len(tape.ops), len(tape.values)
        tensors = [t for t in (*args, *params) if isinstance(t, Tensor)]
        before = [self._lookup(t) for t in tensors]
        self._seg_learn = []
        try:
            out = fn(*args)
        finally:
            packs, self._seg_learn = self._seg_learn, None
        if self._verified is not None or type(out) is not Tensor:
            return out
        # An argument or parameter autograd saved before the op that reads it was dispatched
        # was on no value then; it is by now.
        for k, (vid, saved, ident) in enumerate(packs):
            if vid is None:
                t = ident[1]()
                vid = None if t is None or id(t) != ident[0] else self._lookup(t)
            packs[k] = (vid, saved)
        sources = []
        for t, b in zip(tensors, before):
            vid = self._lookup(t)
            if vid is None or b is not None and b != vid:
                return out  # not read, or written inside: not a call to run unobserved
            sources.append((vid, b is None))
        out_vid = self._lookup(out)
        if out_vid is None or out_vid < n_start:
            return out
        self.segments.append(Segment(start, len(tape.ops), n_start, len(tape.values), weakref.ref(module),
                                     type(module).forward, key, tuple(sources), tuple(packs), out_vid))
        return out

    def _segment_pack(self, t: Tensor) -> Any:
        """The pack hook inside an unobserved call: the handle the verified call's k-th pack had
        (checked and committed after the call, :meth:`_run_segment`)."""
        run = self._seg_run
        seg = self._seg
        k = len(run)
        if k < len(seg.packs) and seg.packs[k][1] and type(t) in _PLAIN:
            handle: Any = Saved(self.link, seg.packs[k][0], t)
        else:
            handle = self._as_is(t)
        run.append((t, handle))
        return handle

    def _run_segment(self, verified: Any, seg: Segment, module: nn.Module, fn: Any, args: tuple) -> Any:
        """Run a pure module call unobserved where the verified tape has one (see :mod:`~tapesac.segments`);
        None (nothing changed) when it may not, or when its results differ from the tape's (the
        call then runs again, op by op)."""
        if module is not seg.module() or type(module).forward is not seg.fn or self._n != seg.n_start:
            return None
        if self._fresh:
            self._settle()  # the last op's holds, before this call's
        params = module_tensors(module)
        if call_key(module, args, params) != seg.key:
            return None
        tensors = [t for t in (*args, *params) if isinstance(t, Tensor)]
        fids = self._fids
        for t, (vid, new) in zip(tensors, seg.sources):
            ent = fids.get(id(t))
            bound = ent is not None and ent[0]() is t
            if new:
                if bound:
                    return None  # seen before, where the verified forward met it first here
            elif not bound or ent[1] != vid or t._version != ent[2]:
                return None
        run: list = []
        self._seg, self._seg_run = seg, run
        # The mode is off for the call and for the holds' detaches (not the block's ops).
        with torch._C._DisableTorchDispatch():
            try:
                out = fn(*args)
            finally:
                self._seg_run = None
            values = verified.tape.values
            v = values[seg.out]
            if len(run) != len(seg.packs) or type(out) is not Tensor or out.shape != v.shape or out.dtype != v.dtype:
                return None  # dropped: the call runs again under the mode
            for (t, _), (vid, _) in zip(run, seg.packs):
                v = values[vid]
                if t.shape != v.shape or t.dtype != v.dtype:
                    return None
            ref = weakref.ref
            held_versions = self._held_versions
            for t, (vid, new) in zip(tensors, seg.sources):
                if new:
                    version = t._version
                    fids[id(t)] = (ref(t), vid, version)
                    self._follow_hold(vid, t)
                    held_versions[vid] = version
                    if vid in verified.owned_vids:
                        self.owned_vids.add(vid)
            reads = self._reads
            for (t, handle), (vid, saved) in zip(run, seg.packs):
                if vid in seg.first_met and vid not in verified.owned_vids:
                    self._count_off_tape(t)  # an input saved before its first op, as when recorded
                if saved:
                    reads[vid] = reads.get(vid, 0) + 1
                    self._saved.append(handle)
                if vid in seg.hold_at_pack and vid not in self.held:
                    self._follow_hold(vid, t)
                    held_versions[vid] = t._version
            version = out._version
            fids[id(out)] = (ref(out), seg.out, version)
            if seg.hold_out:
                self._follow_hold(seg.out, out)
                held_versions[seg.out] = version
        self._i, self._n = seg.end, seg.n_end
        self.unobserved_ops += seg.end - seg.start
        self._settle()
        return out
