"""What the recorder needs to know about an ATen overload, read once from its schema and tags.

The answers are cached per overload, so the recorder's hot path pays one dict lookup per op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# Namespaces whose ops talk to other ranks or to the outside world.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "c10d", "_c10d_functional_autograd", "_dtensor"}
)
# Functional collectives (a fresh output, nothing written): replayable like any op. Replay runs
# them on every rank of the group in the same order, because every rank replays the same values
# (the same program under a broadcast policy). In-place collectives (``c10d`` ops, ``all_reduce_``)
# and ``_dtensor`` ops stay keep-only.
REPLAYABLE_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})

# Ops that write an argument without saying so in their schema (the schema predates mutation
# annotations): the running statistics of batch norm, written only when ``training`` (arg 5).
# Their writes do not bump version counters.
_UNANNOTATED_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}
_TRAINING_ARG = 5

_TAGS_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """Facts about one overload that decide how it is recorded and replayed."""

    name: str
    write_args: tuple[tuple[int, str, bool], ...]
    """(position, name, bumps_version) of every argument the op writes: schema ``a!`` (bumps the
    version counter) plus known unannotated writes (do not)."""
    write_if_training: bool
    """The unannotated writes happen only when the ``training`` argument is true."""
    inplace_view: bool
    """The op changes a tensor's view metadata in place (``t_``, ``as_strided_``)."""
    random: bool
    """Tagged ``nondeterministic_seeded``: replay must restore the generator state."""
    keep_only: str | None
    """Why the op's outputs may never be recomputed (collective, data-dependent), or None."""
    index_like: bool = False
    """Advanced indexing: data-dependent only when an index is a boolean mask (see
    :func:`keep_only_reason`)."""
    returns_tensor: bool = True
    """The schema can return a tensor (``Tensor``, ``Tensor?``, ``Tensor[]``, ...); an op that
    cannot and writes nothing never reaches a tape (``.item()``, ``equal``)."""
    view_of: int | None = None
    """For a view op (every return aliases one argument without writing it): that argument's
    position. Autograd gives the views it returns that argument's version counter, after the
    dispatcher has returned them."""
    collective: bool = False
    """The op's namespace is one of :data:`COLLECTIVE_NAMESPACES`: it talks to other ranks."""
    allocates: bool = False
    """The op's outputs start as uninitialised memory (``empty`` and its kin, ``set_`` onto a
    storage, ``resize_``): whatever is in them was written by later ops, seen or unseen."""
    unread: frozenset = frozenset()
    """Positions and names of tensor arguments whose *contents* the op does not read: every
    argument of a view op, an allocation or a ``*_like``/``new_*`` factory (they read only
    shape and dtype), and arguments an op overwrites whole (``copy_``'s and ``fill_``'s
    ``self``, an ``out=`` argument). Reads decide when a value written outside the dispatcher
    must be held (recorder invariant 10)."""


_CACHE: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """The cached :class:`OpInfo` of ``func`` (an ``OpOverload`` or any dispatched callable)."""
    info = _CACHE.get(func)
    if info is None:
        info = _CACHE[func] = _analyse(func)
    return info


def _analyse(func: Any) -> OpInfo:
    schema = getattr(func, "_schema", None)
    name = str(func)
    if schema is None:
        return OpInfo(name, (), False, False, False, "not an ATen overload: cannot be replayed",
                      collective=getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES)
    writes = [
        (i, a.name, True)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    extra = _UNANNOTATED_WRITES.get(schema.name, ())
    writes += [(i, schema.arguments[i].name, False) for i in extra]
    tags = getattr(func, "tags", ())
    view_of = _view_of(schema)
    base = schema.name.split("::")[-1]
    allocates = base in _ALLOCATING or schema.name == "aten::set_" and "source_Tensor" not in name
    if view_of is not None or allocates or base.endswith("_like") or base.startswith("new_"):
        unread = frozenset(a.name for a in schema.arguments) | frozenset(range(len(schema.arguments)))
    else:
        over = [(i, a.name) for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
                and (a.kwarg_only or (i == 0 and base in _OVERWRITING))]
        unread = frozenset(n for _, n in over) | frozenset(i for i, _ in over)
    keep_only = None
    namespace = getattr(func, "namespace", "aten")
    if namespace in COLLECTIVE_NAMESPACES and (namespace not in REPLAYABLE_COLLECTIVE_NAMESPACES or writes):
        keep_only = f"collective {name} writes its argument or is not a functional collective: replay would write it again"
    elif any(t in tags for t in _TAGS_DATA_DEPENDENT):
        keep_only = f"data-dependent {name}: replay would synchronise with the host"
    return OpInfo(
        name=name,
        write_args=tuple(writes),
        write_if_training=bool(extra),
        inplace_view=torch.Tag.inplace_view in tags,
        random=torch.Tag.nondeterministic_seeded in tags,
        keep_only=keep_only,
        index_like=schema.name in _INDEX_OPS,
        returns_tensor=any("Tensor" in str(r.type) for r in schema.returns),
        view_of=view_of,
        collective=namespace in COLLECTIVE_NAMESPACES,
        allocates=allocates,
        unread=unread,
    )


_ALLOCATING = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                         "empty_permuted", "empty_quantized", "_empty_affine_quantized",
                         "_empty_per_channel_affine_quantized", "resize_", "resize_as_"})
"""Ops whose outputs (or whose written ``self``) hold uninitialised bytes: what ends up there is
written by later ops, and replay may rebuild it only from ops it saw (recorder invariant 10)."""

_OVERWRITING = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_",
                          "geometric_", "log_normal_", "cauchy_", "bernoulli_", "_copy_from"})
"""In-place ops that write every element of ``self`` without reading it."""


def _view_of(schema: Any) -> int | None:
    """The argument every return of a view op aliases (``Tensor(a) self -> Tensor(a)``), or None."""
    if not schema.returns:
        return None
    sets = []
    for r in schema.returns:
        if r.alias_info is None or r.alias_info.is_write:
            return None
        sets.append(set(r.alias_info.before_set))
    if sets == [set()]:  # ``Tensor(a)[]``: the alias set sits on the list's elements, unseen here;
        # such views (unbind, split, chunk) mark their argument ``Tensor(a -> *)``.
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and not a.alias_info.is_write and "*" in a.alias_info.after_set:
                return i
        return None
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and not a.alias_info.is_write and all(
                s & set(a.alias_info.before_set) for s in sets):
            return i
    return None


# Advanced indexing is tagged dynamic-shape because a boolean mask makes the output size depend
# on the data; with integer indices (MoE token routing) the shape is static and replay is safe.
_INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
                        "aten::_unsafe_index", "aten::_unsafe_index_put"})


def keep_only_reason(info: OpInfo, args: tuple) -> str | None:
    """Why this call's outputs must be kept, or None when replaying it is safe."""
    if info.keep_only is None or not info.index_like:
        return info.keep_only
    indices = args[1] if len(args) > 1 else ()
    if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
        return info.keep_only
    return None


def may_communicate(info: OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether running this call may talk to other ranks: a collective, or an op on a tensor
    subclass (a DTensor redistributes inside its own dispatch, below any mode that records it;
    an ``AsyncCollectiveTensor`` waits on a collective). Decided from the op and the argument
    types alone, which are the same on every rank of an SPMD program."""
    if info.collective:
        return True
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            if any(_is_subclass(x) for x in a):
                return True
        elif _is_subclass(a):
            return True
    return False


def _is_subclass(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) and (
        torch._C._dispatch_keys(a).has(torch._C.DispatchKey.Python))


def written_tensors(info: OpInfo, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, bumps_version) for each tensor ``func(*args, **kwargs)`` writes, in schema order."""
    if info.write_if_training:
        training = args[_TRAINING_ARG] if len(args) > _TRAINING_ARG else kwargs.get("training")
        if not training:
            return []
    out: list[tuple[torch.Tensor, bool]] = []
    for pos, name, bumps in info.write_args:
        a = args[pos] if pos < len(args) else kwargs.get(name)
        if isinstance(a, torch.Tensor):
            out.append((a, bumps))
        elif isinstance(a, (list, tuple)):
            out.extend((x, bumps) for x in a if isinstance(x, torch.Tensor))
    return out


def generator_for(func: Any, args: tuple, kwargs: dict, device: torch.device | None):
    """The generator a random op draws from: its ``generator`` argument or the device default."""
    gen = kwargs.get("generator")
    if gen is None:
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.name == "generator" and i < len(args):
                gen = args[i]
                break
    if gen is not None:
        return gen
    if device is None or device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


def device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The device an op runs on: its ``device`` argument, else its first tensor's."""
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def base_version(args: tuple, pos: int, default: torch.Tensor) -> int:
    """The version of a view op's input at ``pos`` (a fresh view's own counter still reads 0)."""
    base = args[pos] if pos < len(args) else None
    return base._version if isinstance(base, torch.Tensor) else default._version


def clone_as_is(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (a held value's snapshot before a write)."""
    return t.clone(memory_format=torch.preserve_format)
