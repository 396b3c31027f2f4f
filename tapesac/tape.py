"""The tape of one block forward: the ATen ops that ran, the values they made, and graph queries.

A *value* is one tensor at one version: an op's output, or the new content of an argument the op
wrote in place. Values are numbered in the order they appear (``vid``); an op's values are
addressed stably from step to step by ``(op index, slot)``, which is what a policy stores.

The tape holds no tensors. The recorder keeps the few tensors backward needs alongside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable

import torch

from .kernels import KernelLaunch
from .ops import COLLECTIVE_NAMESPACES
from .walk import producer_ops

# Value kinds.
EXTERNAL = 0
"""Made outside the block (input, parameter, buffer, or by code the dispatcher never saw)."""
PRODUCED = 1
"""Made by a recorded op: an output, or the new version of an argument the op wrote."""
SNAPSHOT = 2
"""A copy of a held value, taken just before an in-place op overwrote it."""

UNSEEN = "written outside the dispatcher"
"""The ``keep_only`` reason of values whose bytes no recorded op wrote (recorder invariant 10),
and of producers whose replay once gave other bytes than the forward's (replay invariant R6)."""


_DETACH = torch.ops.aten.detach.default


class Ref:
    """Placeholder for a tensor argument in a recorded op: the value it was."""

    __slots__ = ("vid",)

    def __init__(self, vid: int) -> None:
        self.vid = vid

    def __repr__(self) -> str:
        return f"%{self.vid}"


class Value:
    """One tensor version on the tape: where it came from and what it costs to hold."""

    __slots__ = ("vid", "op", "slot", "kind", "version", "sid", "nbytes", "shape", "dtype", "reads", "free",
                 "wrapper")

    def __init__(self, vid: int, op: int, slot: int, kind: int, version: int, sid: int,
                 nbytes: int, shape: tuple, dtype: torch.dtype, free: bool) -> None:
        self.vid = vid
        self.op = op
        """Index of the producing op; -1 for externals and snapshots of externals (a snapshot of a
        produced value keeps its producer's index and slot)."""
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
        self.wrapper = False
        """A DTensor: it shares its shard's storage id but has a version counter of its own, which
        writes through the shard do not move (recorder invariant 8)."""


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
        self._fast_key: int | None = None
        """:meth:`fast_key`, once asked for (a tape is asked only after its forward returned)."""

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

    def last_versions(self, wrappers: bool = False) -> dict[int, int]:
        """sid -> version of the last value recorded in that storage, among plain tensors (or
        among DTensors, ``wrappers``): the two kinds keep separate version counters."""
        return {v.sid: v.version for v in self.values if v.wrapper == wrappers}

    def read_vids(self) -> list[int]:
        """Values autograd saved for backward."""
        return [v.vid for v in self.values if v.reads]

    def produced(self, vid: int) -> bool:
        """Made by an op of this tape, aliasing no external: autograd's copy of it may be a handle
        replay serves (kept or rebuilt)."""
        v = self.values[vid]
        return v.kind == PRODUCED and not v.free

    def rebuildable(self, vid: int) -> bool:
        """Replay can make this value again: :meth:`produced` by an op that is not keep-only."""
        v = self.values[vid]
        return v.kind == PRODUCED and not v.free and self.ops[v.op].keep_only is None

    def producer_closure(self, targets: Iterable[int], available: set[int] | dict) -> list[int]:
        """Indices of the ops to run to rebuild ``targets`` from ``available`` values, ascending.

        The walk stops at available values; every other value must be PRODUCED by a replayable op.
        """
        values = self.values

        def op_of(vid: int) -> int:
            v = values[vid]
            if v.kind != PRODUCED or v.op < 0:
                raise AssertionError(f"value %{vid} is neither available nor replayable")
            return v.op

        ops = self.ops
        return sorted(producer_ops(targets, op_of, lambda o: ops[o].deps, available.__contains__))

    def op_name(self, index: int) -> str:
        f = self.ops[index].func
        return str(f) if hasattr(f, "_schema") else getattr(f, "__name__", repr(f))

    def program_hash(self) -> int:
        """An in-process hash of the sequence of ATen overloads the forward dispatched, as
        :class:`~tapesac.modes.ProgramCheck` computes it while a block runs unrecorded."""
        h = 0
        for op in self.ops:
            # Not the recorder's own storage aliases, nor detach (autograd detaches the outputs
            # it saves: a plain-autograd run dispatches detaches a recorded one does not).
            if (hasattr(op.func, "_schema") and op.func is not _DETACH) or type(op.func) is KernelLaunch:
                h = hash((h, op.func))
        return h

    def fast_key(self) -> int:
        """An in-process key that changes whenever :meth:`signature` may.

        It hashes everything the signature encodes, with value ids in place of positions (the
        ids of every op's values fix the positions), the shapes of all non-produced values, and
        device indices and group names as they are (constant within a process): stricter than
        the signature, never looser. Cheap (built-in hashing of a flat list, no strings), so a
        block can check every step that its tape is still the one whose signature was verified;
        not stable across processes. Computed once per tape.
        """
        if self._fast_key is not None:
            return self._fast_key
        values = self.values
        key: list = []
        push = key.append
        for op in self.ops:
            push(op.func)
            _push_flat(op.args, push)
            if op.kwargs:
                push(_KWARGS)
                for k, a in sorted(op.kwargs.items()):
                    push(k)
                    _push_flat((a,), push)
            push(_OUTS)
            for o in op.outs:
                push(o)
                push(None if o is None else values[o].dtype)
        key.extend([(v.vid, v.kind, v.shape, v.dtype) for v in values if v.kind != PRODUCED])
        self._fast_key = hash(tuple(key))
        return self._fast_key

    def signature(self) -> str:
        """A stable hash of the program the block ran: which ops ran on what, and on which inputs.

        It identifies the program, not the rank or the moment (two ranks, or two steps, of one
        job give the same signature), so ranks can compare it and a saved policy still fits.

        In: op overloads, wiring (which value feeds which argument), output dtypes, the shapes
        and dtypes of the block's inputs and parameters, and the constants that select what an op
        computes (bools, None, strings such as ``approximate="tanh"`` or ``reduce_op``, dtypes,
        layouts, memory formats, and the *type* of a device).

        Out, encoded by type only:

        * integers: shapes of values made inside the block follow from the input shapes in a
          dense block and depend on the data in an MoE block (tokens per expert);
        * the sizes of integer and boolean externals (document offsets of a packed batch, as
          Qwen3.5's gated-DeltaNet layers take them): how many documents a batch holds depends on
          the data; their number of dimensions is in;
        * floats: a scale read with ``.item()`` changes every step, and no float constant
          changes which values exist or how they are wired;
        * device indices: ranks on one node use ``cuda:0``, ``cuda:1``, ...;
        * process-group names of collectives: they differ between TP or PP groups;
        * version counters of externals: a parameter before and after an optimizer step is the
          same input;
        * which of a tensor's equal pieces (``split``, ``chunk``, ``unbind``) an op reads: a rank
          keeps its own piece when a replicated tensor is sharded (sequence parallelism).

        Equal for two blocks of one architecture (externals are numbered by first use, not by
        identity) and identical across processes.
        """
        h = hashlib.sha256()
        for i, line in enumerate(self.signature_lines()):
            h.update(f"{i}:{line}\n".encode())
        return h.hexdigest()[:16]

    def signature_lines(self) -> list[str]:
        """What :meth:`signature` hashes, one readable line per op: ``name(args, kwargs)->dtypes``.

        Produced values (and snapshots of them) appear as ``%op.slot``, externals as
        ``$e<n>[shape]dtype`` numbered by first use; comparing two tapes' lines shows the first op
        where they part.
        """
        ext_index: dict[int, int] = {}
        values = self.values
        rank_pieces = {i for i, op in enumerate(self.ops) if _equal_pieces(op, values)}

        def ref(r: Ref) -> str:
            v = values[r.vid]
            if v.op >= 0:  # produced, or a snapshot of a produced value: where it was made
                if v.op in rank_pieces:
                    return f"%{v.op}.*"
                return f"%{v.op}.{v.slot}"
            n = ext_index.setdefault(r.vid, len(ext_index))
            return f"$e{n}{_external_shape(v)}{v.dtype}"

        lines = []
        for i, op in enumerate(self.ops):
            outs = ",".join("-" if o is None else str(values[o].dtype) for o in op.outs)
            lines.append(f"{self.op_name(i)}{_canonical_args(op, ref)!r}->{outs}")
        return lines


_PIECE_OPS = frozenset({"aten::split", "aten::chunk", "aten::unbind", "aten::tensor_split"})


def _equal_pieces(op: TapeOp, values: list) -> bool:
    """Whether ``op`` cuts a tensor into pieces of one shape and dtype (``split``, ``chunk``,
    ``unbind``, ``tensor_split``). Which piece a program reads then enters the signature as
    ``%op.*``: sharding a replicated tensor (a DTensor redistributed to ``Shard``, as sequence
    parallelism does at a block's input) cuts it so and keeps the piece of this rank, so every
    rank reads another slot of one program. Pieces of one shape cost the same to keep and to
    rebuild, so the plan fits every rank."""
    name = getattr(getattr(op.func, "_schema", None), "name", None)
    if name not in _PIECE_OPS or len(op.outs) < 2 or any(o is None for o in op.outs):
        return False
    first = values[op.outs[0]]
    return all(values[o].shape == first.shape and values[o].dtype == first.dtype for o in op.outs[1:])


def _external_shape(v: Value) -> str:
    """An external's shape as the signature writes it: its sizes, or for an integer or boolean
    tensor (indices, offsets: their sizes follow the data) only its number of dimensions."""
    if isinstance(v.dtype, torch.dtype) and not (v.dtype.is_floating_point or v.dtype.is_complex):
        return "[" + ",".join("?" * len(v.shape)) + "]"
    return str(list(v.shape))


# Canonical form of recorded arguments, shared by Tape.signature and Tape.fast_key ------------------

@dataclasses.dataclass(frozen=True, repr=False)
class Token:
    """What the signature keeps of a constant it does not encode by value.

    Its ``repr`` is ``<name>``, which no recorded string's ``repr`` (always quoted) can equal.
    """

    name: str

    def __repr__(self) -> str:
        return f"<{self.name}>"


INT = Token("int")
"""An int constant (shape, index, split size): its value is data, not program."""
FLOAT = Token("float")
"""A float constant (a scale, possibly read from a tensor with ``.item()``)."""
GROUP = Token("group")
"""A process-group argument of a collective: its name differs between groups."""

# Collective arguments that say what is computed (the same on every rank); every other string
# argument of a collective names a process group or a tag, which differ between groups.
_COLLECTIVE_PROGRAM_ARGS = frozenset({"reduce_op", "op_list"})
_GROUP_ARG_NAMES = frozenset({"group_name", "group", "process_group", "pg", "tag"})
_group_args_cache: dict[Any, tuple[frozenset[int], frozenset[str]]] = {}


def _group_args(func: Any) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and names of ``func``'s arguments that name a process group (cached per overload)."""
    found = _group_args_cache.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        collective = getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES
        names = frozenset(
            a.name for a in (schema.arguments if schema is not None else ())
            if a.name in _GROUP_ARG_NAMES or (
                collective and a.name not in _COLLECTIVE_PROGRAM_ARGS
                and a.type.kind() in ("StringType", "AnyType"))
        )
        positions = frozenset(i for i, a in enumerate(schema.arguments) if a.name in names) if names else frozenset()
        found = _group_args_cache[func] = (positions, names)
    return found


def _canonical_args(op: TapeOp, ref) -> tuple:
    """``(args, kwargs)`` of ``op`` as a hashable tuple with stable ``repr``: tensors through
    ``ref``, constants that are data or rank-specific replaced by markers (see
    :meth:`Tape.signature` for what stays and why)."""
    positions, names = _group_args(op.func)
    args = op.args
    if positions:
        canon_args = tuple(_canonical(a, ref) if i not in positions or _has_ref(a) else GROUP
                           for i, a in enumerate(args))
    else:
        canon_args = tuple([_canonical(a, ref) for a in args])
    if not op.kwargs:
        return canon_args, ()
    return canon_args, tuple(
        (k, GROUP if k in names and not _has_ref(a) else _canonical(a, ref)) for k, a in sorted(op.kwargs.items())
    )


def _has_ref(a: Any) -> bool:
    return isinstance(a, Ref) or (isinstance(a, (list, tuple)) and any(_has_ref(x) for x in a))


_PASS_THROUGH = (str, torch.dtype, torch.layout, torch.memory_format)

# fast_key's flat form: sentinels delimit structure, so no constant can be mistaken for them.
_OPEN, _CLOSE, _INTS, _KWARGS, _OUTS, _INT, _FLOAT = (object() for _ in range(7))
_FAST_LEAVES = frozenset({str, bool, type(None), torch.dtype, torch.layout, torch.memory_format, torch.device})
_ONLY_INT = {int}


def _push_flat(seq: Any, push) -> None:
    """Append ``seq``'s canonical form to a key, flat: the hot path of :meth:`Tape.fast_key`.

    Stricter than :func:`_canonical` where that is cheaper (device index and group names kept:
    they do not change within a process), never looser.
    """
    for a in seq:
        t = type(a)
        if t is Ref:
            push(~a.vid)  # negative: never equal to a length or a bool
        elif t is int:
            push(_INT)
        elif t is list or t is tuple:
            if a and set(map(type, a)) == _ONLY_INT:  # a shape or a dim list
                push(_INTS)
                push(len(a))
            else:
                push(_OPEN)
                _push_flat(a, push)
                push(_CLOSE)
        elif t is float:
            push(_FLOAT)
        elif t in _FAST_LEAVES:
            push(a)
        else:
            push(_canonical(a, _fast_ref))


def _fast_ref(r: Ref) -> int:
    return ~r.vid


def _canonical(a: Any, ref) -> Any:
    t = type(a)
    if t is Ref:
        return ref(a)
    if t is int:
        return INT
    if t is list or t is tuple:
        return tuple([_canonical(x, ref) for x in a])
    if a is None or t is bool or isinstance(a, _PASS_THROUGH):
        return a
    if t is float:
        return FLOAT
    if isinstance(a, torch.device):
        return Token(f"device {a.type}")
    if isinstance(a, bool):
        return bool(a)
    if isinstance(a, int):  # int subclasses (IntEnum), numpy ints
        return INT
    if isinstance(a, (float, complex)):
        return FLOAT
    if isinstance(a, (list, tuple)):
        return tuple([_canonical(x, ref) for x in a])
    if isinstance(a, dict):
        return tuple((str(k), _canonical(x, ref)) for k, x in sorted(a.items(), key=lambda kv: str(kv[0])))
    # Generators, process-group objects, SymInts and other opaque objects: by type only. Their
    # repr names an address or a rank, never the program.
    return Token(t.__name__)
