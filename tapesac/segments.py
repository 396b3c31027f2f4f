"""Pure module calls that a followed forward runs without the dispatch mode.

A followed forward (:class:`~tapesac.recorder.FollowPlan`) still pays the recorder's dispatch
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

Tensor = torch.Tensor

PURE_MODULES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    nn.Linear: (("weight", "bias"), ()),
    nn.RMSNorm: (("weight",), ("normalized_shape", "eps")),
    nn.LayerNorm: (("weight", "bias"), ("normalized_shape", "eps")),
}
"""Module class -> (its tensor attributes, its settings that reach the ops)."""

_PLAIN = (Tensor, nn.Parameter)


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
    """Values of ``sources`` first met inside the call (set by FollowPlan)."""
    hold_at_pack: frozenset = frozenset()
    """Values the tape holds that the call made and autograd saved (set by FollowPlan)."""
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
