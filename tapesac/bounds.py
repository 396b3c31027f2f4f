"""Upper bounds on the sizes that depend on the data: how large routing can make a block's values.

A tape records one forward's sizes. Where a size depends on the data (the rows a boolean mask
picks, the tokens expert parallelism's all-to-all delivers to this rank, everything computed on
them), another step holds other bytes under the same plan. The planner must fit the worst step
it can meet, so it plans with these bounds instead of the profiled sizes.

:func:`size_bounds` reruns the ops whose sizes may move on fake tensors with *unbacked* sizes
(``torch.fx.experimental.symbolic_shapes``), the way ``torch.compile`` traces data-dependent
code, and reads each storage's upper bound from the value ranges of its symbolic size:

- Sources. An op with a data-dependent output shape (boolean-mask ``index``, ``nonzero``,
  ``masked_select``) gets torch's own unbacked size, at most the mask's element count. An
  ``all_to_all_single`` with output split sizes receives a fresh size, at most the group size
  (the split list's length) times its input's rows: every rank sends at most what it has, and
  ranks run the same shapes. The all-to-all that sends back with the splits swapped (an MoE
  combine) receives exactly what the first one sent: its output has the first one's input rows.
- Propagation. Every later op that reads a value whose size is symbolic runs on fake tensors,
  so its output sizes follow from torch's own shape rules (a masked scatter into a fixed buffer
  is fixed again, a concatenation of pieces is their sum).
- Sizes the host computed. Python code reads a symbolic size as an int (``x.shape[0]``) and
  passes it on (``output_size=``, ``new_empty(shape)``); the tape holds the int. A size-typed
  argument equal to a symbolic size's profiled value is taken to be that size.

Where the rerun cannot follow (an opaque kernel or a DTensor op reading a value of symbolic size,
an op whose fake rule needs a concrete size), the tape is *unbounded*, with the reason: the
planner falls back to the profiled sizes and says so. A storage the block allocates whose size
differs between recordings of one block kind although no source above explains it (a size derived
on the host from counts it read with ``tolist``) makes the block unbounded too; that storage is
planned at its largest recorded size, the others at their bounds: see :func:`check_recordings`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Iterable

import torch

from .ops import COLLECTIVE_NAMESPACES

if TYPE_CHECKING:
    from .tape import Tape

_PASS_THROUGH = ("wait_tensor", "_wrap_tensor_autograd")
"""Functional-collective ops that hand their input on, as it is (waiting for it)."""

_SIZE_ARG = re.compile(r"(?:SymInt(?:\[\d*\])?\??|Scalar\??) (\w+)")
_MIN_MATCHED = 16
"""Symbolic sizes profiled below this are never matched to ints (too many fixed sizes coincide)."""
_SIZED: dict[Any, frozenset] = {}


def _sized_args(func: Any) -> frozenset:
    """Names of ``func``'s size-typed arguments (``SymInt``, ``SymInt[]``, ``Scalar``)."""
    names = _SIZED.get(func)
    if names is None:
        names = _SIZED[func] = frozenset(_SIZE_ARG.findall(str(func._schema)))
    return names


@dataclasses.dataclass
class SizeBounds:
    """Per storage of one tape, the largest bytes any step can hold there (only storages whose
    size depends on the data), or why no bound could be derived."""

    bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    unbounded: str | None = None

    def merge(self, other: "SizeBounds") -> "SizeBounds":
        merged = dict(self.bytes)
        for s, b in other.bytes.items():
            merged[s] = max(merged.get(s, 0), b)
        return SizeBounds(merged, self.unbounded or other.unbounded)


class _Unbounded(Exception):
    pass


def size_bounds(tape: "Tape") -> SizeBounds:
    """Upper bounds of ``tape``'s storages whose size depends on the data (see the module)."""
    from torch.utils._python_dispatch import _disable_current_modes

    # Outside every mode in force (a step's storage counter, a recorder): the rerun allocates nothing.
    with _disable_current_modes():
        try:
            return _Rerun(tape).run()
        except _Unbounded as e:
            return SizeBounds({}, f"{e}; planned at the profiled step's sizes")
        except Exception as e:  # noqa: BLE001 - a bound that fails leaves the block planned as profiled
            return SizeBounds({}, f"the rerun failed ({type(e).__name__}: {str(e)[:200]}); planned at the "
                                  "profiled step's sizes")


def storage_map(src: "Tape", dst: "Tape") -> dict[int, int]:
    """``src``'s storage ids -> ``dst``'s, through the values the same ops produced. Tapes of one
    block kind run one program, but each numbers its storages itself: under tensor parallelism,
    the first block's tape numbers them otherwise than the next ones'."""
    where = {(v.op, v.slot): v.sid for v in dst.values if v.op >= 0}
    out: dict[int, int] = {}
    for v in src.values:
        if v.op >= 0 and (v.op, v.slot) in where:
            out.setdefault(v.sid, where[(v.op, v.slot)])
    return out


def moved(bounds: SizeBounds, src: "Tape", dst: "Tape") -> SizeBounds:
    """``bounds`` of ``src``'s storages, as ``dst``'s storage ids."""
    m = storage_map(src, dst)
    return SizeBounds({m[s]: n for s, n in bounds.bytes.items() if s in m}, bounds.unbounded)


def check_recordings(tapes: Iterable["Tape"], bounds: SizeBounds) -> SizeBounds:
    """``bounds`` (of tapes of one block kind), unbounded where a storage the block allocates
    differs in size between the recordings but the rerun found it fixed: a size the bound does
    not follow. Such storages are planned at the largest size recorded, and the other storages'
    bounds stand. A block's inputs and parameters are the caller's bytes, never the plan's: their
    sizes may differ (Qwen3.5's document boundaries, one per packed document)."""
    tapes = list(tapes)
    if bounds.unbounded or len(tapes) < 2:
        return bounds
    first = tapes[0]
    largest: dict[int, int] = {}
    sizes: dict[int, set[int]] = {}
    for t in tapes[1:]:
        for s, theirs in storage_map(first, t).items():
            nbytes, other = first.storage_nbytes[s], t.storage_nbytes[theirs]
            if other != nbytes and s not in bounds.bytes and s not in first.external_sids:
                largest[s] = max(largest.get(s, nbytes), nbytes, other)
                sizes.setdefault(s, {nbytes}).add(other)
    if not largest:
        return bounds
    s = next(iter(largest))
    v = next((v for v in first.values if v.sid == s), None)
    where = f"op {v.op} ({first.op_name(v.op)})" if v is not None and v.op >= 0 else f"storage {s}"
    lo, hi = min(sizes[s]), max(sizes[s])
    more = f" (and {len(largest) - 1} more storage(s))" if len(largest) > 1 else ""
    return SizeBounds({**bounds.bytes, **largest},
                      f"the output of {where}{more} changes size between recordings ({lo} to {hi} "
                      "bytes) but comes from no size the bound follows (a size computed on the host, e.g. from "
                      "counts read with tolist); planned at the largest size recorded")


class _Rerun:
    def __init__(self, tape: "Tape") -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.tape = tape
        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env)
        self.fakes: dict[int, torch.Tensor] = {}
        """vid -> fake tensor, for the values whose size is symbolic."""
        self.static: dict[int, torch.Tensor] = {}
        self.by_value: dict[int, Any] = {}
        """A symbolic size's profiled value -> the size (the first one seen with that value)."""
        self.exchanges: list[tuple[list, list, Any]] = []
        """(output splits, input splits, input rows) of each all-to-all so far."""
        self.bounds: dict[int, int] = {}

    def run(self) -> SizeBounds:
        from .tape import flatten_outputs

        tape = self.tape
        with self.mode:
            for i, op in enumerate(tape.ops):
                dd = op.keep_only is not None and op.keep_only.startswith("data-dependent")
                name = tape.op_name(i)
                exchange = "all_to_all_single" in name
                touched = any(d in self.fakes for d in op.deps)
                if not (touched or dd or (exchange and self._splits(op)[0] is not None) or self._matches(op)):
                    continue
                if not isinstance(op.func, torch._ops.OpOverload):
                    raise _Unbounded(f"op {i} ({name}) reads a value whose size depends on the data and is "
                                     "not an ATen op (a kernel the bound cannot run on fake tensors)")
                if any(tape.values[d].wrapper for d in op.deps):
                    raise _Unbounded(f"op {i} ({name}): a DTensor op on a size that depends on the data")
                if exchange:
                    outs = [self._exchange(op)]
                elif name.split(".")[1] in _PASS_THROUGH:
                    outs = [self._arg(op.args[0])]
                elif op.func.namespace in COLLECTIVE_NAMESPACES:
                    raise _Unbounded(f"op {i} ({name}): a collective on a size that depends on the data")
                else:
                    try:
                        outs = flatten_outputs(self._call(i, name, op))
                    except _Unbounded:
                        if touched or dd:
                            raise
                        continue  # only an int matched: its sizes stay as recorded (check_recordings)
                self._take(i, op, outs)
        return SizeBounds(self.bounds)

    def _call(self, i: int, name: str, op: Any) -> Any:
        """Run ``op`` on fake tensors, its size arguments taken for the symbolic sizes they equal;
        where that fails (an int that only happened to equal one), with the sizes as recorded."""
        try:
            return op.func(*self._args(op, op.args, True), **self._kwargs(op, True))
        except Exception as e:  # noqa: BLE001 - any failure means: try as recorded, else cannot follow
            first = e
        try:
            return op.func(*self._args(op, op.args, False), **self._kwargs(op, False))
        except Exception:  # noqa: BLE001
            text = str(first).splitlines()[0][:200] if str(first) else ""
            raise _Unbounded(f"op {i} ({name}) cannot run on a size that depends on the data "
                             f"({type(first).__name__}: {text})") from None

    # Arguments -------------------------------------------------------------------------------

    def _fake(self, vid: int) -> torch.Tensor:
        t = self.fakes.get(vid)
        if t is not None:
            return t
        t = self.static.get(vid)
        if t is None:
            v = self.tape.values[vid]
            t = self.static[vid] = torch.empty(v.shape, dtype=v.dtype)
        return t

    def _arg(self, a: Any) -> Any:
        from .tape import Ref

        if type(a) is Ref:
            return self._fake(a.vid)
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        return a

    def _symbolic(self, a: Any) -> bool:
        return (type(a) is int and a in self.by_value) or (
            isinstance(a, (list, tuple)) and any(type(x) is int and x in self.by_value for x in a))

    def _size(self, a: Any) -> Any:
        if type(a) is int and a in self.by_value:
            return self.by_value[a]
        if isinstance(a, (list, tuple)) and self._symbolic(a):
            return type(a)(self._size(x) for x in a)
        return a

    def _sized(self, op: Any, sizes: bool) -> tuple[list[bool], frozenset]:
        if not sizes:
            return [], frozenset()
        names = _sized_args(op.func)
        return [arg.name in names for arg in op.func._schema.arguments], names

    def _args(self, op: Any, args: tuple, sizes: bool) -> list:
        sized, _names = self._sized(op, sizes)
        return [self._size(self._arg(a)) if i < len(sized) and sized[i] else self._arg(a) for i, a in enumerate(args)]

    def _kwargs(self, op: Any, sizes: bool) -> dict:
        _sized, names = self._sized(op, sizes)
        # Every fake tensor lives on the CPU: the rerun needs sizes only.
        return {k: torch.device("cpu") if k == "device" and a is not None else
                self._size(self._arg(a)) if k in names else self._arg(a) for k, a in op.kwargs.items()}

    def _matches(self, op: Any) -> bool:
        """A size-typed argument equals a symbolic size's profiled value."""
        if not self.by_value or not isinstance(op.func, torch._ops.OpOverload):
            return False
        sized, names = self._sized(op, True)
        return (any(self._symbolic(a) for a, s in zip(op.args, sized) if s)
                or any(self._symbolic(a) for k, a in op.kwargs.items() if k in names))

    def _register(self, profiled: int, size: Any) -> None:
        if profiled >= _MIN_MATCHED:
            self.by_value.setdefault(profiled, size)

    # Sources ---------------------------------------------------------------------------------

    def _splits(self, op: Any) -> tuple[list | None, list | None]:
        args = list(op.args) + [None] * 3
        out = op.kwargs.get("output_split_sizes", args[1])
        inp = op.kwargs.get("input_split_sizes", args[2])
        return (list(out) if out is not None else None), (list(inp) if inp is not None else None)

    def _fresh(self, upper: Any, profiled: int) -> Any:
        from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

        if isinstance(upper, torch.SymInt):
            upper = self._upper(upper.node.expr)
        s = self.env.create_unbacked_symint()
        _constrain_range_for_size(s, min=0, max=int(upper))
        self._register(profiled, s)
        return s

    def _exchange(self, op: Any) -> torch.Tensor:
        """The output of an all-to-all: what this rank receives."""
        x = self._arg(op.args[0])
        out_splits, in_splits = self._splits(op)
        rows = x.shape[0]
        if out_splits is not None:
            back = next((r for o, i, r in self.exchanges if o == in_splits and i == out_splits), None)
            if back is not None:
                rows = back  # sends back what an earlier exchange with these splits swapped received
            else:
                rows = self._fresh(len(out_splits) * (self._upper(rows.node.expr) if isinstance(rows, torch.SymInt)
                                                      else rows), sum(out_splits))
            self.exchanges.append((out_splits, in_splits, x.shape[0]))
        return torch.empty((rows, *x.shape[1:]), dtype=x.dtype)

    # Results ---------------------------------------------------------------------------------

    def _upper(self, expr: Any) -> int:
        import sympy

        hi = self.env.bound_sympy(expr).upper
        from torch.utils._sympy.numbers import int_oo

        if not hi.is_number or hi in (int_oo, sympy.oo) or hi.is_finite is False:
            raise _Unbounded(f"no finite bound for the size {expr}")
        return int(hi)

    def _take(self, i: int, op: Any, outs: list) -> None:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        values = self.tape.values
        pairs = [(vid, t) for vid, t in zip(op.outs[:op.n_returned], outs) if vid is not None]
        for _before, after in op.writes:  # a write keeps its argument's (fake) tensor
            pos = next((k for k, a in enumerate(op.args) if getattr(a, "vid", None) == _before), None)
            if pos is not None:
                pairs.append((after, self._arg(op.args[pos])))
        for vid, t in pairs:
            if not isinstance(t, torch.Tensor):
                continue
            v = values[vid]
            nbytes = t.untyped_storage().nbytes()
            if isinstance(nbytes, torch.SymInt) and free_unbacked_symbols(nbytes):
                self.fakes[vid] = t
                for dim, size in zip(t.shape, v.shape):
                    if isinstance(size, int) and isinstance(dim, torch.SymInt) and dim.node.expr.is_symbol:
                        self._register(size, dim)
                self.bounds[v.sid] = max(self.bounds.get(v.sid, 0), self._upper(nbytes.node.expr), v.nbytes)
            else:
                self.fakes.pop(vid, None)
                if tuple(t.shape) != tuple(v.shape):
                    raise _Unbounded(f"op {i} ({self.tape.op_name(i)}): the rerun gave shape {tuple(t.shape)}, "
                                     f"the forward {tuple(v.shape)}")
