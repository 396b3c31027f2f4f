"""The producer walk: which ops rebuild a set of values. One definition for replay (an unpack's
chain), the replay program (what backward's reads need), the planner (a keep set's recompute
closure) and its simulator; each says where the walk stops and what produced a value."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence


def producer_ops(targets: Iterable[int], op_of: Callable[[int], int], deps_of: Callable[[int], Sequence[int]],
                 stop: Callable[[int], bool]) -> set[int]:
    """Indices of the ops to run to make ``targets``.

    From each target, a value for which ``stop`` is true (held, cached, not made by an op) ends
    the walk there; any other value is made by op ``op_of(value)`` (which raises when it cannot
    be), and that op's inputs ``deps_of(op)`` are walked in turn. Each value is visited once.
    """
    ops: set[int] = set()
    seen: set[int] = set()
    stack = list(targets)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if stop(v):
            continue
        o = op_of(v)
        if o not in ops:
            ops.add(o)
            stack.extend(deps_of(o))
    return ops
