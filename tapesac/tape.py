"""The tape of one block forward: the ATen ops that ran, the values they made, and graph queries.

A *value* is one tensor at one version: an op's output, or the new content of an argument the op
wrote in place. Values are numbered in the order they appear (``vid``); an op's values are
addressed stably from step to step by ``(op index, slot)``, which is what a policy stores.

The tape holds no tensors. The recorder keeps the few tensors backward needs alongside it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch

# Value kinds.
EXTERNAL = 0
"""Made outside the block (input, parameter, buffer, or by code the dispatcher never saw)."""
PRODUCED = 1
"""Made by a recorded op: an output, or the new version of an argument the op wrote."""
SNAPSHOT = 2
"""A copy of a held value, taken just before an in-place op overwrote it."""


class Ref:
    """Placeholder for a tensor argument in a recorded op: the value it was."""

    __slots__ = ("vid",)

    def __init__(self, vid: int) -> None:
        self.vid = vid

    def __repr__(self) -> str:
        return f"%{self.vid}"


class Value:
    """One tensor version on the tape: where it came from and what it costs to hold."""

    __slots__ = ("vid", "op", "slot", "kind", "version", "sid", "nbytes", "shape", "dtype", "reads", "free")

    def __init__(self, vid: int, op: int, slot: int, kind: int, version: int, sid: int,
                 nbytes: int, shape: tuple, dtype: torch.dtype, free: bool) -> None:
        self.vid = vid
        self.op = op
        """Index of the producing op, -1 for externals and snapshots."""
        self.slot = slot
        """Position among the op's values: flattened returns first, then written arguments."""
        self.kind = kind
        self.version = version
        """The tensor's ``_version`` while this value is its content."""
        self.sid = sid
        """Storage id within the tape: values that alias share it."""
        self.nbytes = nbytes
        """Bytes of the whole storage the value lives in."""
        self.shape = shape
        self.dtype = dtype
        self.reads = 0
        """How many times autograd saved this value for backward."""
        self.free = free
        """Aliases an external's storage (a view of a parameter): holding it costs no bytes."""


class TapeOp:
    """One recorded call: enough to run it again on other tensors of the same values."""

    __slots__ = ("func", "args", "kwargs", "deps", "outs", "n_returned", "writes", "rng", "keep_only",
                 "inplace_view", "time_s", "alloc_bytes")

    def __init__(self, func: Any, args: tuple, kwargs: dict, deps: tuple[int, ...]) -> None:
        self.func = func
        self.args = args
        """Positional arguments with tensors replaced by :class:`Ref`."""
        self.kwargs = kwargs
        self.deps = deps
        """Distinct vids the op reads, in argument order."""
        self.outs: list[int | None] = []
        """vid per slot (None where the op returned a non-tensor)."""
        self.n_returned = 0
        """How many of ``outs`` are flattened return positions; the rest are written arguments."""
        self.writes: tuple[tuple[int, int], ...] = ()
        """(vid before, vid after) for every argument the op writes."""
        self.rng: tuple[Any, torch.Tensor] | None = None
        """(generator, state before the op) for random ops."""
        self.keep_only: str | None = None
        """Why this op's values must never be recomputed, or None."""
        self.inplace_view = False
        self.time_s: float | None = None
        """Measured run time (profiling forwards only)."""
        self.alloc_bytes = 0
        """Bytes of the storages this op allocated (its outputs that alias nothing older)."""


def flatten_outputs(out: Any) -> list:
    """Returns of an ATen op as a flat list: tuples and tensor lists are spliced in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        flat: list = []
        for o in out:
            if isinstance(o, (tuple, list)):
                flat.extend(o)
            else:
                flat.append(o)
        return flat
    return [out]


class Tape:
    """Ops and values of one block forward, with the graph queries replay and planning need."""

    def __init__(self) -> None:
        self.ops: list[TapeOp] = []
        self.values: list[Value] = []
        self.storage_nbytes: dict[int, int] = {}
        """sid -> bytes of that storage."""
        self.external_sids: set[int] = set()
        """Storages that belong to externals (parameters, inputs): never counted as kept bytes."""

    # Construction -------------------------------------------------------------------------

    def add_value(self, op: int, slot: int, kind: int, t: torch.Tensor, version: int, sid: int) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, op, slot, kind, version, sid, self.storage_nbytes[sid], tuple(t.shape),
                                 t.dtype, kind == PRODUCED and sid in self.external_sids))
        return vid

    # Queries ------------------------------------------------------------------------------

    def position(self, vid: int) -> tuple[int, int]:
        v = self.values[vid]
        return (v.op, v.slot)

    def read_vids(self) -> list[int]:
        """Values autograd saved for backward."""
        return [v.vid for v in self.values if v.reads]

    def producer_closure(self, targets: Iterable[int], available: set[int] | dict) -> list[int]:
        """Indices of the ops to run to rebuild ``targets`` from ``available`` values, ascending.

        The walk stops at available values; every other value must be PRODUCED by a replayable op.
        """
        ops = self.ops
        values = self.values
        needed: set[int] = set()
        seen: set[int] = set()
        stack = [t for t in targets if t not in available]
        while stack:
            vid = stack.pop()
            if vid in seen:
                continue
            seen.add(vid)
            v = values[vid]
            if v.kind != PRODUCED or v.op < 0:
                raise AssertionError(f"value %{vid} is neither available nor replayable")
            if v.op in needed:
                continue
            needed.add(v.op)
            for d in ops[v.op].deps:
                if d not in available and d not in seen:
                    stack.append(d)
        return sorted(needed)

    def op_name(self, index: int) -> str:
        f = self.ops[index].func
        return str(f) if hasattr(f, "_schema") else getattr(f, "__name__", repr(f))

    def fast_key(self) -> int:
        """An in-process key that changes whenever :meth:`signature` may: ops, wiring, inputs.

        Cheap (built-in hashing, no strings), so a block can check every step that its tape is
        still the one whose signature was verified; not stable across processes.
        """
        return hash((
            tuple((op.func, op.deps, len(op.outs)) for op in self.ops),
            tuple((v.vid, v.shape, v.dtype) for v in self.values if v.kind != PRODUCED),
        ))

    def signature(self) -> str:
        """A stable hash of the tape's structure: which ops ran on what, and on which inputs.

        It covers op overloads, argument wiring, dtypes, non-integer constants, and the shapes of
        the block's inputs and parameters; not integer constants or the shapes of values made
        inside the block. Those follow from the input shapes in a dense block, and depend on the
        data in an MoE block (tokens per expert), whose tape must still match from step to step
        and rank to rank. Equal for two blocks of one architecture (externals are numbered by
        first use, not by identity) and identical across processes, so ranks can compare them.
        """
        h = hashlib.sha256()
        ext_index: dict[int, int] = {}
        values = self.values

        def enc(a: Any) -> str:
            if isinstance(a, Ref):
                v = values[a.vid]
                if v.kind == PRODUCED:
                    return f"%{v.op}.{v.slot}"
                n = ext_index.setdefault(a.vid, len(ext_index))
                return f"$e{n}{list(v.shape)}{v.dtype}"
            if isinstance(a, (list, tuple)):
                return "[" + ",".join(enc(x) for x in a) + "]"
            if isinstance(a, dict):
                return "{" + ",".join(f"{k}={enc(x)}" for k, x in sorted(a.items())) + "}"
            if isinstance(a, torch.Generator):
                return "<gen>"
            if isinstance(a, int) and not isinstance(a, bool):
                return "#"
            if isinstance(a, (bool, float, str, type(None), torch.dtype, torch.device,
                              torch.layout, torch.memory_format)):
                return repr(a)
            return type(a).__name__

        for i, op in enumerate(self.ops):
            outs = ",".join("-" if o is None else str(values[o].dtype) for o in op.outs)
            h.update(f"{i}:{self.op_name(i)}({enc(op.args)};{enc(op.kwargs)})->{outs}\n".encode())
        return h.hexdigest()[:16]
