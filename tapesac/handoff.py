"""What a recorded forward hands to replay: the :class:`Recording`, the handles autograd stores
instead of saved tensors (:class:`Saved`, :class:`AsIs`) and the unpack hook that serves them.

The recorder (:mod:`tapesac.recorder`) makes these; replay (:mod:`tapesac.replay`) owns them from
the end of the forward. Data flows one way: a handle reaches its replayer through a
:class:`ReplayLink`, never back into the recorder. Invariant numbers are the recorder's.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from .errors import ReplayError, modified_error
from .tape import Tape

Tensor = torch.Tensor


def storage_alias(src: Tensor, dtype: torch.dtype, size: tuple, stride: tuple, offset: int) -> Tensor:
    """A tensor with the given view metadata over ``src``'s storage (replays rule 4 above); a
    DTensor's storage is its shard's (invariant 8)."""
    parts = _dtensor_parts(src)
    storage = (src if parts is None else parts[0]).untyped_storage()
    return torch.empty((0,), dtype=dtype, device=src.device).set_(storage, offset, size, stride)


def local_shard(dtensor: Tensor) -> Tensor:
    """The local tensor of a DTensor, as ``to_local`` and ``redistribute`` read it (invariant 8)."""
    return dtensor._local_tensor


def as_dtensor(local: Tensor, spec: Any, placements: str) -> Tensor:
    """A DTensor over ``local`` with ``spec``, as ``from_local`` and ``redistribute`` build it
    (invariant 8). ``placements`` (``str(spec.placements)``) puts the layout into the signature."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


_DTENSOR_STEPS = (local_shard, as_dtensor)


def _dtensor_parts(t: Tensor) -> tuple[Tensor, Any] | None:
    """(local shard, spec) of a DTensor, None for any other tensor."""
    if type(t) in _PLAIN:
        return None
    local, spec = getattr(t, "_local_tensor", None), getattr(t, "_spec", None)
    return None if local is None or spec is None else (local, spec)


class ReplayLink:
    """What a forward's saved handles point at: its block, and its replayer once forward returned."""

    __slots__ = ("block", "replayer")

    def __init__(self, block: int) -> None:
        self.block = block
        self.replayer = None


class Saved:
    """What autograd stores instead of a block-produced tensor: the value, and what autograd's
    version check needs (invariant 7)."""

    __slots__ = ("link", "vid", "family", "version", "final", "ref", "__weakref__")

    def __init__(self, link: ReplayLink, vid: int, t: Tensor) -> None:
        self.link = link
        self.vid = vid
        self.ref: Any = weakref.ref(t)
        """The saved tensor, weakly, while the forward runs: a Triton launch that writes its
        storage later re-points the handle to the written bytes (invariant 11)."""
        base = t._base
        self.family: Any = weakref.ref(t if base is None else base)
        """During the forward, a weak reference to the saved tensor's view family (views share
        their base's version counter and keep it alive); afterwards a storage-free tensor sharing
        that counter, or None once nothing can write the family any more."""
        self.version = t._version
        self.final: int | None = None
        """The family's version when it became unreachable (family is None)."""

    def settle(self, tape: Tape, last_versions: dict[int, int]) -> None:
        """Forward is done: keep the family's version counter, not its memory (invariant 7).

        ``last_versions``: sid -> the version of the last value recorded in that storage.
        """
        self.ref = None
        family = self.family()
        if family is not None:
            self.family = version_carrier(family)
        else:  # unreachable since before the forward returned: only the block could write it
            self.family = None
            self.final = last_versions[tape.values[self.vid].sid]


def version_carrier(t: Tensor) -> Tensor:
    """An empty tensor sharing ``t``'s version counter (call it outside the dispatch mode)."""
    carrier = t.detach()
    version = carrier._version
    if hasattr(carrier, "_local_tensor"):  # a DTensor (no ``set_``): drop its shard instead
        carrier._local_tensor = carrier._local_tensor.new_empty(0)
        return carrier
    carrier.set_()  # drops the storage, and bumps the shared counter: put it back
    torch._C._autograd._unsafe_set_version_counter((carrier,), (version,))
    return carrier


class AsIs:
    """A saved tensor TapeSAC leaves as it is (inputs, parameters), with its version when saved."""

    __slots__ = ("link", "tensor", "version", "__weakref__")

    def __init__(self, link: ReplayLink, t: Tensor) -> None:
        self.link = link
        self.tensor = _detach(t)  # made at autograd level: shares t's version counter
        self.version = t._version


_PLAIN = (Tensor, torch.nn.Parameter)


def _detach(t: Tensor) -> Tensor:
    """``t.detach()`` from the pack hook, where the recorder's mode is active: plain tensors skip
    the round trip through Python dispatch (a detach is the same alias either way); subclasses
    (DTensor) need their own dispatch."""
    if type(t) in _PLAIN:
        with torch._C._DisableTorchDispatch():
            return t.detach()
    return t.detach()


def unpack_saved(obj: Any) -> Any:
    """The unpack hook: check the version as autograd would, then rebuild or fetch the value."""
    kind = type(obj)
    if kind is Saved:
        if obj.vid < 0:
            raise ReplayError(
                f"TapeSAC block {obj.link.block}: a Triton kernel wrote in place the storage of a tensor "
                "autograd had saved, after saving it, and that tensor was gone by then, so TapeSAC cannot "
                "rebuild the bytes autograd reads. Keep the tensor alive until the kernel has run, or "
                "register the kernel as a torch.library custom op with mutates_args")
        replayer = obj.link.replayer
        if replayer is None:
            raise ReplayError(
                f"TapeSAC block {obj.link.block}: backward asked for a saved value before the "
                "block's forward returned (autograd.grad inside the block's forward is not supported); "
                "unwrap this block or move the inner backward out of it"
            )
        family = obj.family
        current = obj.final if family is None else family._version
        if current is not None and current != obj.version:
            v = replayer.tape.values[obj.vid]
            raise modified_error(v.dtype, replayer.device, v.shape, current, obj.version, obj.link.block)
        return replayer.unpack(obj.vid)
    if kind is AsIs:
        t = obj.tensor
        if t._version != obj.version:
            raise modified_error(t.dtype, t.device, t.shape, t._version, obj.version, obj.link.block)
        return t
    return obj


@dataclasses.dataclass(eq=False)
class Recording:
    """One recorded block forward, handed from the recorder to replay, which then owns it."""

    block: int
    tape: Tape
    held: dict[int, Tensor]
    """vid -> detached tensor kept for backward (invariant 2)."""
    versions: dict[int, tuple[Tensor, int]]
    """vid -> (version carrier, version) for held values that alias tensors outside the recording
    (invariant 7): replay checks the carrier's ``_version`` before it reads the value."""
    owned_vids: set[int]
    """Externals that are the block's own parameters and buffers (not counted as inputs)."""
    debug_refs: dict[int, Tensor] | None
    """Debug mode: vid -> the forward's tensor, to compare the replayed value with."""
    link: ReplayLink
    """What the forward's :class:`Saved` handles point at; the replayer binds itself to it."""
    rng: dict[int, tuple] = dataclasses.field(default_factory=dict)
    """op index -> (generator, state) where this forward's differs from the tape's ``rng`` (a
    followed tape is another forward's: every random op is here)."""
    args: dict[int, tuple[tuple, dict]] = dataclasses.field(default_factory=dict)
    """op index -> (args, kwargs) where this forward's constants differ from the tape's."""
    verified: Any = None
    """The :class:`~tapesac.follow.VerifiedTape` this forward followed to its end (its tape is ``tape``), else None."""
    segments: list = dataclasses.field(default_factory=list)
    """Pure module calls of a recorded forward (:class:`~tapesac.segments.Segment`)."""
    fingerprints: dict = dataclasses.field(default_factory=dict)
    """Verification forwards: vid -> fingerprint of what autograd saved (replay invariant R6)."""
    handles: list = dataclasses.field(default_factory=list)
    """Verification forwards: weak references to the forward's :class:`Saved` handles, whose
    version checks explain a difference before a fingerprint does (replay invariant R6)."""
