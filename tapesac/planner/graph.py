"""The planner's view of a block: plain data, no tensors.

A :class:`BlockGraph` is a tape reduced to what the keep/recompute decision needs: ops with a
replay time, values with a producing op and the storage they live in, which values backward
reads, and which values are always available (held anyway: block inputs, parameters and their
views, outputs of ops that must never be replayed). It is JSON-serialisable, so a graph
measured on a real model can be saved, shared between ranks and planned offline.

The cost model is the executor's: replaying a keep set runs the producer closure of the read
values that are not kept, stopping at kept and always-available values; its time is the sum of
those ops' times (each op once). Kept memory counts each storage once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from ..walk import producer_ops


@dataclasses.dataclass
class BlockGraph:
    op_time_s: list[float]
    """Replay time of each op."""
    op_deps: list[list[int]]
    """Values each op reads."""
    value_op: list[int]
    """Producing op of each value; -1 for values that are always available."""
    value_storage: list[int]
    """Storage of each value (values that alias share one)."""
    storage_bytes: list[float]
    """Bytes of each storage."""
    read: list[int]
    """Values backward reads."""
    read_counts: list[int] | None = None
    """How many times autograd saved each read value (None: once each)."""
    unpack_order: list[int] | None = None
    """Values in the order a profiled backward unpacked them (for the time-resolved memory model)."""
    keepable: list[bool] | None = None
    """Whether each value may be kept (False: an in-place write clobbers it later). None: all."""
    names: list[str] | None = None
    """Value names (for display); None: indices."""
    op_names: list[str] | None = None
    positions: list[tuple[int, int]] | None = None
    """Tape position ``(op index, slot)`` of each value: what a policy stores."""
    op_overhead_s: float = 0.0
    """TapeSAC's own cost of replaying one op (Python bookkeeping), added to every replayed op."""
    record_overhead_s: float = 0.0
    """TapeSAC's cost of recording the block and serving its unpacks; saved when the block keeps
    everything backward reads and runs as plain autograd."""
    fixed_bytes: float = 0.0
    """Bytes held whatever the plan (outputs of keep-only ops that backward needs)."""
    unseen_bytes: float = 0.0
    """Of ``fixed_bytes``, those held because no recorded op wrote them (written outside the
    dispatcher: a kernel, numpy) or their replay once differed from the forward."""
    signature: str = ""
    storage_bound_bytes: list[float] | None = None
    """Where sizes depend on the data (``tapesac.bounds``): the most bytes any step can hold in
    each storage (the profiled bytes where the size is fixed; the largest recorded where no bound
    follows, ``data_dependent`` says why). None: every size is fixed, or the rerun could not run."""
    fixed_bound_bytes: float = 0.0
    """``fixed_bytes`` at the bounds."""
    data_dependent: str | None = None
    """Why some sizes that depend on the data have no bound (planned at the profiled step's sizes,
    or the largest recorded), or None."""

    # Derived ---------------------------------------------------------------------------------

    @property
    def num_values(self) -> int:
        return len(self.value_op)

    def value_name(self, v: int) -> str:
        return self.names[v] if self.names else str(v)

    def is_keepable(self, v: int) -> bool:
        return self.value_op[v] >= 0 and (self.keepable is None or self.keepable[v])

    def op_outputs(self) -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in self.op_time_s]
        for v, o in enumerate(self.value_op):
            if o >= 0:
                outs[o].append(v)
        return outs

    # The executor's cost model ----------------------------------------------------------------

    def closure(self, kept: Iterable[int]) -> set[int]:
        """Ops replay runs when ``kept`` values are held: the producer closure of the read values."""
        kept = set(kept)
        value_op = self.value_op
        return producer_ops(self.read, value_op.__getitem__, self.op_deps.__getitem__,
                            lambda v: v in kept or value_op[v] < 0)

    def recompute_time(self, kept: Iterable[int]) -> float:
        """What replaying costs with ``kept`` held: the closure's ops, plus TapeSAC's overheads
        unless nothing is replayed (then the block runs as plain autograd)."""
        ops = self.closure(kept)
        if not ops:
            return 0.0
        return sum(self.op_time_s[o] for o in ops) + len(ops) * self.op_overhead_s + self.record_overhead_s

    def kept_bytes(self, kept: Iterable[int]) -> float:
        return sum(self.storage_bytes[s] for s in {self.value_storage[v] for v in kept})

    def transient_bytes(self, kept: Iterable[int]) -> float:
        """Replay's transient: storages of the read values that are rebuilt. Replay caches each
        until backward unpacks it, and the first unpack of a block rebuilds nearly all of them,
        so they are alive together; other rebuilt values live only until their consumers run."""
        kept = set(kept)
        ops = self.closure(kept)
        return sum(self.storage_bytes[s] for s in
                   {self.value_storage[v] for v in self.read if v not in kept and self.value_op[v] in ops})

    def at_bounds(self) -> "BlockGraph":
        """This graph with every storage at its bound: what the planner costs kept and rebuilt
        values with, so that a step routed more heavily than the profiled one still fits."""
        if self.storage_bound_bytes is None:
            return self
        return dataclasses.replace(self, storage_bytes=list(self.storage_bound_bytes), fixed_bytes=self.fixed_bound_bytes)

    def growth_bytes(self) -> tuple[float, float]:
        """(all storages, fixed storages): how many bytes more than profiled the bounds allow."""
        if self.storage_bound_bytes is None:
            return 0.0, 0.0
        grow = sum(b - p for b, p in zip(self.storage_bound_bytes, self.storage_bytes))
        return grow, self.fixed_bound_bytes - self.fixed_bytes

    def block_replay_time(self) -> float:
        """Time of every op of the block: what full activation checkpointing reruns."""
        return sum(self.op_time_s)

    def replay_only_time(self) -> float:
        return self.recompute_time(())

    # JSON --------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BlockGraph":
        data = dict(data)
        if data.get("positions") is not None:
            data["positions"] = [tuple(p) for p in data["positions"]]
        return cls(**data)

    @classmethod
    def from_abstract(cls, data: dict[str, Any]) -> "BlockGraph":
        """The frontier tool's input: ``{"ops": {name: {"time", "bytes", "deps"}}, "read": [...]}``.

        Each entry is one value made by one op into its own storage.
        """
        from ..errors import PlanError

        ops = data.get("ops")
        if not isinstance(ops, dict) or not ops:
            raise PlanError("graph needs a non-empty 'ops' object")
        names = list(ops)
        index = {n: i for i, n in enumerate(names)}
        times, deps, sizes = [], [], []
        for n in names:
            spec = ops[n]
            try:
                t, b = float(spec["time"]), float(spec["bytes"])
                d = [index[x] for x in spec.get("deps", [])]
            except KeyError as e:
                raise PlanError(f"op {n!r}: missing field or unknown dependency {e}") from None
            except (TypeError, ValueError):
                raise PlanError(f"op {n!r}: time and bytes must be numbers") from None
            if t < 0 or b < 0:
                raise PlanError(f"op {n!r}: time and bytes must be non-negative")
            times.append(t)
            sizes.append(b)
            deps.append(d)
        try:
            read = sorted({index[r] for r in data.get("read", [])})
        except KeyError as e:
            raise PlanError(f"read names an unknown op {e}") from None
        _check_acyclic(deps, names)
        n = len(names)
        return cls(op_time_s=times, op_deps=deps, value_op=list(range(n)), value_storage=list(range(n)),
                   storage_bytes=sizes, read=read, names=names, op_names=names)


def _check_acyclic(deps: list[list[int]], names: list[str]) -> None:
    from ..errors import PlanError

    state = [0] * len(deps)  # 0 new, 1 on stack, 2 done
    for root in range(len(deps)):
        if state[root]:
            continue
        stack = [(root, iter(deps[root]))]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state[nxt] == 1:
                raise PlanError(f"graph has a cycle through {names[nxt]!r}")
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(deps[nxt])))
