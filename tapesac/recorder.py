"""Record one block forward at the dispatcher, and decide what autograd's saved tensors become.

During a wrapped block's forward two things are active:

* :class:`Recorder`, a ``TorchDispatchMode`` that appends every ATen op (post-autocast, post
  decomposition) to a :class:`~tapesac.tape.Tape`;
* ``saved_tensors_hooks(recorder.pack, unpack_saved)``: a tensor the block produced is packed as
  a small :class:`Saved` handle instead of the tensor, so autograd does not keep it alive.

When the forward returns, :meth:`Recorder.finalize` hands a plain :class:`Recording` (the tape and
the few tensors backward needs) to a :class:`~tapesac.replay.Replayer`, which owns it from then
on.

*Follow mode*: given a :class:`FollowPlan` (a verified earlier forward of the same program), the
recorder builds no tape. It checks each op against the plan's next one and keeps the invariants
below with the plan's values (identities in ``_fids``, with this forward's versions, generator
states and differing constants kept beside the shared tape); at the first op that departs it
turns what it followed into a tape of its own (``_leave_follow``) and records from there. Data flows one way: the handles reach the replayer through a :class:`ReplayLink`, never back
into the recorder, which is dropped.

Invariants the recorder keeps (each is relied on by replay):

1. Tensors are mapped to values by identity (``id`` plus a weak reference), never by order.
2. Every value backward may need is either *held* (a detached tensor kept here: externals,
   outputs of keep-only ops, values the policy keeps, views of externals) or PRODUCED by a
   replayable op whose arguments satisfy the same rule.
3. A held tensor is never the target of a later in-place write: before an op writes a storage,
   held values in it are copied (externals, keep-only outputs) or dropped back to replay (the rest).
4. Each version of a mutated tensor is its own value; a tensor read after another alias of its
   storage was written becomes a new value aliasing the written storage.
5. Random ops carry their generator state, so replay draws the same numbers.
6. Nothing here references autograd nodes: held tensors are detached, so no reference cycle
   runs through the graph (pytorch#154642), and the tape holds no tensors at all. Handles point
   at a :class:`ReplayLink`, which points at the replayer and at nothing that points back.
7. Autograd skips its saved-tensor version check when saved-tensor hooks are active, so TapeSAC
   takes it over: every packed tensor carries the version it was saved at (checked at unpack with
   autograd's message), and every held value that aliases a tensor outside the recording gets a
   version carrier: a detach of the original made outside the dispatch mode (a detach made below
   autograd gets a counter of its own), so replay can check it before reading it (replay's
   invariant 11). A held value the block itself overwrites is copied or dropped (invariant 3)
   and needs no carrier.
8. A DTensor and its local shard are one storage (the shard's). What DTensor code makes outside
   the dispatcher (``to_local`` reads ``_local_tensor``; ``from_local`` and ``redistribute``
   wrap a local tensor in a new DTensor) goes on the tape as :func:`local_shard` and
   :func:`as_dtensor`, so those values are replayable and a write through either side invalidates
   the other (a DTensor's own version counter does not see writes to its shard: its value also
   goes stale when the shard's version moves).
9. A module inside the block that is an FSDP2 unit of its own (MoE experts under expert
   parallel) has its parameters freed after its forward and gathered again only in its
   backward, which runs after the nodes that read what the block computed from its outputs. So
   its outputs are held and their ops made keep-only (:meth:`Recorder.hold_outputs`): no replay
   reaches into it from outside; inside its own backward replay reads what FSDP gathered.
10. Replay never rebuilds bytes that no recorded op wrote. The outputs of allocations (``empty``
    and its kin: :attr:`~tapesac.ops.OpInfo.allocates`), views of them, and reads of a storage
    that such an allocation made and no recorded op has overwritten whole are *unwritten*: what
    is in them came from code the dispatcher never saw (a Triton or CUDA kernel, numpy, ctypes)
    or from nobody. The first time an unwritten value is read (by an op that reads its contents,
    not a view or an overwrite; or saved by autograd), it is held as it is then and its op made
    keep-only (:data:`UNSEEN`); what is computed from it replays from that hold. A Triton launch
    is an op like any other (:meth:`Recorder.launch_kernel`), so its outputs are written values.
11. A Triton launch writes its pointer arguments without moving their version counters, so
    every other alias of a storage it wrote is read as a new value of that storage
    (``_kernel_written``), as after a write through a view.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ReplayError, TapeSACError
from .replay import modified_error
from .kernels import KernelLaunch, fingerprint, launch_constants, written_by_analysis
from .ops import OpInfo, generator_for, keep_only_reason, op_info, written_tensors
from .tape import EXTERNAL, PRODUCED, SNAPSHOT, UNSEEN, Ref, Tape, TapeOp, _has_ref, flatten_outputs
from .segments import Segment, call_key, eligible as segment_eligible, module_tensors

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
    plan: "FollowPlan | None" = None
    """The plan this forward followed to its end (its tape is ``tape``), else None."""
    segments: list = dataclasses.field(default_factory=list)
    """Pure module calls of a recorded forward (:class:`~tapesac.segments.Segment`)."""
    fingerprints: dict = dataclasses.field(default_factory=dict)
    """Verification forwards: vid -> fingerprint of what autograd saved (replay invariant 13)."""
    handles: list = dataclasses.field(default_factory=list)
    """Verification forwards: weak references to the forward's :class:`Saved` handles, whose
    version checks explain a difference before a fingerprint does (replay invariant 13)."""



_NOTHING_WRITTEN: dict[int, int] = {}
"""What :meth:`Recorder._match_args` returns for an op that writes nothing (never filled)."""


class _FollowStep:
    """One tape op as a followed forward checks and maps it."""

    __slots__ = ("func", "info", "args", "kwargs", "outs", "n_returned", "holds", "rng", "view_of",
                 "after", "written", "next_vid", "may_differ", "single", "tensors", "lists", "kw_tensors",
                 "const_pos", "consts", "const_types", "kw_const_names", "kw_consts", "kw_const_types",
                 "call", "fast", "nargs")

    def __init__(self, op: TapeOp, held: set[int]) -> None:
        self.func = op.func
        self.info = op_info(op.func)
        self.args = op.args
        self.kwargs = op.kwargs
        self.outs = tuple(op.outs)
        self.n_returned = op.n_returned
        self.holds = tuple((slot, vid) for slot, vid in enumerate(op.outs) if vid is not None and vid in held)
        self.rng = op.rng is not None
        self.view_of = self.info.view_of
        self.after = dict(op.writes)
        """vid before -> vid after, of each argument the op writes."""
        self.written = frozenset(self.after.values())
        self.may_differ = not op.writes and not self.rng
        """Constants may differ from the tape's (nothing written, no generator): the outputs are
        checked after the op runs, and a different number of them departs from the tape."""
        self.single = len(op.outs) == 1 and op.n_returned == 1 and op.outs[0] is not None and not op.writes
        """One tensor returned, nothing written: mapped without the general output loop."""
        tensors, lists, const_pos = [], [], []
        for pos, a in enumerate(op.args):
            if type(a) is Ref:
                tensors.append((pos, -1, a.vid))
            elif type(a) is list and _has_ref(a):
                lists.append((pos, tuple(a)))
                tensors.extend((pos, sub, x.vid) for sub, x in enumerate(a) if type(x) is Ref)
            else:
                const_pos.append(pos)
        self.tensors = tuple(tensors)
        self.lists = tuple(lists)
        self.const_pos = tuple(const_pos)
        self.consts = tuple(op.args[p] for p in const_pos)
        self.const_types = tuple(map(type, self.consts))
        self.kw_tensors = tuple((k, a.vid) for k, a in op.kwargs.items() if type(a) is Ref)
        self.kw_const_names = tuple(k for k, a in op.kwargs.items() if not _has_ref(a))
        self.kw_consts = tuple(op.kwargs[k] for k in self.kw_const_names)
        self.kw_const_types = tuple(map(type, self.kw_consts))
        self.call = getattr(op.func, "_op", op.func)
        """The overload's C++ callable (an ``OpOverload`` call is one Python frame around it)."""
        self.nargs = len(op.args)
        self.fast = (self.single and not self.rng and not lists and not op.kwargs
                     and op.func not in _DTENSOR_STEPS)
        """The common op (one tensor out, nothing written, no generator, positional tensors and
        constants only): :meth:`Recorder._follow_op` checks it inline."""


class FollowPlan:
    """A verified block forward prepared for later forwards of the same program to *follow*.

    A forward that follows runs under the recorder as usual, but instead of building a tape it
    checks each op against the plan's (same overload, the same values as arguments, by identity
    and version, the same constants) and only does what backward needs: it maps outputs to the
    tape's values, holds what the verified forward held, keeps generator states, and turns saved
    tensors into handles. The tape (no tensors) is shared by every forward that follows it.

    What a followed forward guarantees is what a recorded one does: its replay runs exactly the
    ops it dispatched, on the values they read. Every op is checked before it runs; at the first
    one that departs (another overload, another argument, another constant where the op's output
    could change shape or number, a tensor written through an alias, a saved tensor the tape did
    not save, fewer ops) the forward hands what it followed over to a recording of its own and
    records the rest, so a program that changes with its input is recorded, never replayed from a
    stale tape. Constants of ops that write nothing and draw no random numbers may differ (sizes
    that depend on the data, such as MoE split sizes, or a scale read with ``.item()``): replay
    uses this forward's, and an op whose outputs then differ in number or kind departs.

    Calls of pure modules (``nn.Linear``, ``nn.RMSNorm``, ``nn.LayerNorm``) that the verified
    forward made are run with the dispatch mode off where their guard holds (:mod:`tapesac.segments`,
    :meth:`Recorder.run_module`): their ops are taken as followed, checked by what they saved.

    Not eligible (recorded every time): tapes where replay needs a snapshot (a held value that was
    written in place), with storage aliases (a tensor written through another alias) or with
    tensor lists passed by keyword; debug mode; profiling. The recorder's DTensor steps
    (:func:`local_shard`, :func:`as_dtensor`) are followed: a tensor the forward has not seen is
    the next such step's output when it is that step's shard or DTensor, checked by identity,
    version, placements and shape (:meth:`Recorder._follow_derive`). A snapshot replay does not need (a
    buffer updated in place, such as MoE load statistics) is not taken when following.
    """

    def __init__(self, tape: Tape, held: Any, owned_vids: Any = (), segments: Any = ()) -> None:
        self.tape = tape
        values = tape.values
        held = set(held)
        steps = []
        next_vid = 0
        for op in tape.ops:
            step = _FollowStep(op, held)
            for vid in (*op.deps, *(o for o in op.outs if o is not None)):
                next_vid = max(next_vid, vid + 1)
            step.next_vid = next_vid
            steps.append(step)
        self.steps = steps
        self.replayable = frozenset(v.vid for v in values if v.kind == PRODUCED and not v.free)
        """Values a saved tensor is packed as a :class:`Saved` handle of (the rest as they are)."""
        self.reads = {v.vid: v.reads for v in values if v.reads}
        """vid -> times autograd saved it: a followed forward must save the same."""
        self.last_versions = tape.last_versions()
        self.wrapper_versions = tape.last_versions(wrappers=True)
        """sid -> version of the last value in that storage (see :meth:`Saved.settle`)."""
        self.program = None
        """The replay program of forwards that follow this plan (made by the first one)."""
        self.owned_vids = frozenset(owned_vids)
        """Externals that were the block's own parameters and buffers."""
        self.segments = {seg.start: seg for seg in segments
                         if segment_eligible(seg, tape, steps, self.replayable)}
        """First op index -> a pure module call later forwards run unobserved
        (:mod:`~tapesac.segments`)."""

    @staticmethod
    def eligible(tape: Tape, program: Any) -> bool:
        """Whether forwards may follow ``tape`` (``program``: its :class:`ReplayProgram`)."""
        values = tape.values
        # A snapshot replay needs is a copy the recorder made before a write: record every time.
        # One it does not need (a buffer updated in place, e.g. MoE load statistics) costs nothing.
        return not any(values[vid].kind == SNAPSHOT for vid in (*program.pinned, *program.kept)) and all(
            (hasattr(op.func, "_schema") or op.func in _DTENSOR_STEPS or type(op.func) is KernelLaunch)
            and not any(type(a) is not Ref and _has_ref(a) for a in op.kwargs.values())
            for op in tape.ops)

def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    return None


def _version_of(args: tuple, pos: int, default: Tensor) -> int:
    base = args[pos] if pos < len(args) else None
    return base._version if isinstance(base, Tensor) else default._version


def _copy(t: Tensor) -> Tensor:
    return t.clone(memory_format=torch.preserve_format)


def _covers_storage(t: Tensor) -> bool:
    """Whether writing every element of ``t`` writes every byte of its storage."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    if t.storage_offset() != 0 or t.numel() * t.element_size() != nbytes:
        return False
    expected = 1  # non-overlapping and dense: the strides, sorted, are running products of sizes
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


_KERNEL_INFO = OpInfo(name="triton kernel", write_args=(), write_if_training=False, inplace_view=False,
                      random=False, keep_only=None)
"""What :meth:`Recorder._commit` needs to know of a Triton launch: it writes what it is told to."""


def kernel_arg_names(kernel: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``(name, value)`` of each argument of a launch (positional ones named by the kernel's
    signature)."""
    from .kernels import _signature_of

    names = _signature_of(kernel)[0]
    out = [(names[i] if i < len(names) else str(i), a) for i, a in enumerate(args)]
    out.extend(kwargs.items())
    return out


_DETACH = torch.ops.aten.detach.default

_SKIP_RECURSIVELY = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
"""Dynamo's frame strategy for a code object it must neither trace nor enter below."""


class _Mode(TorchDispatchMode):
    """A dispatch mode that dynamo never traces into, at no cost per op.

    ``TorchDispatchMode`` wraps a subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
    so that a compiled region never traces into the mode (a block can call compiled code while
    it records: flex attention, a compiled submodule). That wrapper is two Python frames and a
    stance lookup per op: 1.8 us of the 10.5 us a do-nothing mode cost per op on the benchmark
    machine. Instead, each subclass's ``__torch_dispatch__`` code object is marked for dynamo's
    frame evaluator to skip, with everything it calls (what ``torch._dynamo.disable`` does,
    recursively): checked in C only while a compiled region runs, free otherwise."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("__torch_dispatch__")
        if fn is not None:
            _set_code_exec_strategy(fn.__code__, _SKIP_RECURSIVELY)


class ProgramCheck(_Mode):
    """Runs a block unrecorded (pass-through) and hashes the ATen overloads it dispatches, with
    the recorder's rule for what reaches a tape (an op that returns no tensor and writes nothing
    does not): equal to :meth:`Tape.program_hash` of the same program, at a fraction of the cost
    of recording (one hash per op, nothing held)."""

    def __init__(self) -> None:
        super().__init__()
        self.program_hash = 0
        self._bypass = False

    def run_module(self, module: nn.Module, fn: Any, args: tuple, kwargs: dict) -> Any:
        """A pure module call inside the block: its ops are hashed like any others."""
        return fn(*args, **kwargs)

    def hold_outputs(self, out: Any, reason: str) -> None:
        """A nested FSDP2 unit's outputs: nothing is held in a pass-through block."""

    def launch_kernel(self, kernel: Any, run: Any, args: tuple, kwargs: dict) -> Any:
        """A Triton launch (routed here by :mod:`tapesac.kernels`): one step, as on the tape."""
        if self._bypass:
            return run(kernel, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        launch = KernelLaunch(kernel, kwargs.get("grid"), launch_constants(kernel, args, rest))
        self._bypass = True
        try:
            out = run(kernel, *args, **kwargs)
        finally:
            self._bypass = False
        self.program_hash = hash((self.program_hash, launch))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _DETACH or self._bypass:  # see Tape.program_hash
            return out
        info = op_info(func)
        if (info.write_args and written_tensors(info, args, kwargs)) or any(
                isinstance(o, Tensor) for o in flatten_outputs(out)):
            self.program_hash = hash((self.program_hash, func))
        return out


class Recorder(_Mode):
    """Builds the tape of one block forward; ``pack`` is the matching saved-tensor pack hook."""

    def __init__(self, block: int, keep: frozenset | None = None, debug: bool = False,
                 owned: set[int] | None = None, timer=None, follow: "FollowPlan | None" = None,
                 learn_segments: bool = False, verify: bool = False,
                 keep_only_ops: frozenset | set = frozenset()) -> None:
        super().__init__()
        self.block = block
        self.verify = verify
        """A verification forward: saved handles carry fingerprints (replay invariant 13)."""
        self._keep_only_ops = keep_only_ops
        """Op indices whose replay gave other bytes than their forward: keep-only (:data:`UNSEEN`)."""
        self._unwritten: set[int] = set()
        """Values no recorded op wrote, not held yet (invariant 10)."""
        self._unwritten_sids: set[int] = set()
        """Storages an allocation made that no recorded op has overwritten whole (invariant 10)."""
        self._kernel_written: dict[int, int] = {}
        """sid -> the value a Triton launch last wrote there (invariant 11)."""
        self.kernel_launches = 0
        """Triton launches recorded as tape steps in this forward."""
        self._kept_as_is: list[weakref.ref] = []
        """Verification forwards: weak references to the :class:`AsIs` handles made."""
        self.fingerprints: dict[int, Tensor] = {}
        """Verification forwards: vid -> fingerprint of the tensor autograd saved (replay
        invariant 13)."""
        self.timer = timer
        """An :class:`~tapesac.profile.OpTimer` in profiling forwards, else None."""
        self.tape = Tape()
        self.link = ReplayLink(block)
        self.held: dict[int, Tensor] = {}
        """vid -> detached tensor kept for backward (see invariant 2)."""
        self._saved: list[Saved] = []
        self._fresh: list[tuple[int, weakref.ref]] = []
        """Held values of the op being recorded: (vid, weak ref to the original tensor)."""
        self._originals: dict[int, Tensor] = {}
        """vid -> the tensor a held value was detached from, until the forward returns: its
        version carrier is made from it then (invariant 7)."""
        self.debug_refs: dict[int, Tensor] | None = {} if debug else None
        self._keep = keep or frozenset()
        self._owned_of = owned
        self._owned_ids: set[int] | None = None
        """ids of the block's own parameters and buffers (not counted as inputs), from ``owned``
        (a callable) at the first external."""
        self.owned_vids: set[int] = set()
        self._ids: dict[int, tuple[weakref.ref, int]] = {}
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._held_by_sid: dict[int, set[int]] = {}
        self._last_write: dict[int, int] = {}
        self._shards: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        """id(local shard) -> (weak ref to it, weak ref to its DTensor), for DTensors on the tape."""
        self._shard_versions: dict[int, int] = {}
        """vid of a DTensor value -> its shard's version then (invariant 8)."""
        self._bypass = False
        # Follow mode (see FollowPlan): the tape of a verified earlier forward stands in for this
        # one's, op by op, until the program departs from it.
        self._plan = None if (debug or timer is not None) else follow
        self._learn = not debug and timer is None and learn_segments
        """Recording: note pure module calls (:meth:`run_module`) for forwards that follow."""
        self.segments: list[Segment] = []
        self._seg_learn: list | None = None
        """While recording a pure module call: what each pack inside it returned."""
        self._seg: Segment | None = None
        self.unobserved_ops = 0
        """Tape ops this forward ran with the dispatch mode off (pure module calls)."""
        self._seg_run: list | None = None
        """While a followed forward runs a pure module call unobserved: (tensor, handle) per pack."""
        self.followed = False
        """The forward ran to its end on ``follow``'s tape: ``tape`` is that (shared) tape."""
        self._i = 0
        """Follow mode: index of the next tape op."""
        self._n = 0
        """Follow mode: id of the next value."""
        self._fids: dict[int, tuple[weakref.ref, int, int]] = {}
        """Follow mode: id(tensor) -> (weak ref, vid, version): the identity map, with each
        value's version kept here because the shared tape's are another forward's."""
        self._reads: dict[int, int] = {}
        """Follow mode: vid -> times saved for backward so far."""
        self._rng: dict[int, tuple] = {}
        """Follow mode: op index -> (generator, state) of this forward's random ops."""
        self._args: dict[int, tuple[tuple, dict]] = {}
        """Follow mode: op index -> (args, kwargs) where this forward's constants differ."""
        self._held_versions: dict[int, int] = {}
        """Follow mode: vid -> version of the held values (the shared tape's are another forward's)."""
        self.off_tape_bytes = 0
        """Bytes of distinct storages autograd saved that are on no tape value (held as they are,
        never replayable): what TapeSAC could not see being made."""
        self._off_tape_storages: set[int] = set()
        self._off_tape_later: list[tuple[int, weakref.ref, Tensor]] = []
        """Follow mode: saved tensors on no value yet, counted or not at the end (_flush_off_tape)."""
        self._dtensors: dict[int, tuple[weakref.ref, int]] = {}
        """Follow mode: vid -> (this forward's DTensor of that value, its shard's version then):
        for :func:`local_shard` steps, and to see a write through the shard (invariant 8)."""
        ref = weakref.ref(self)

        def pack(t: Tensor) -> Any:
            rec = ref()
            if rec._seg_run is not None:
                return rec._segment_pack(t)
            plan = rec._plan
            if plan is not None and type(t) in _PLAIN:
                # Following, the common case inline (:meth:`_follow_pack` has the rest): a value
                # of the tape, unwritten since it was made, that replay can make again.
                ent = rec._fids.get(id(t))
                if ent is not None and ent[1] in plan.replayable and ent[0]() is t and t._version == ent[2]:
                    vid = ent[1]
                    reads = rec._reads
                    reads[vid] = reads.get(vid, 0) + 1
                    handle = Saved(rec.link, vid, t)
                    if rec.verify:
                        rec._fingerprint(vid, t)
                    rec._saved.append(handle)
                    return handle
            return rec._pack(t)

        self.pack = pack
        """The pack hook. Autograd keeps it in every saved variable, so it refers to the recorder
        weakly: the graph must not keep the recorder alive (invariant 6)."""

    # Identity maps --------------------------------------------------------------------------

    def _sid(self, t: Tensor) -> int:
        parts = _dtensor_parts(t) if type(t) not in _PLAIN else None
        if parts is not None:
            t = parts[0]  # invariant 8: a DTensor lives in its shard's storage
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
            sid = len(self.tape.storage_nbytes)
            self.tape.storage_nbytes[sid] = t.numel() * t.element_size()
            return sid
        ent = self._storages.get(id(st))
        if ent is not None and ent[0]() is st:
            return ent[1]
        sid = len(self.tape.storage_nbytes)
        self.tape.storage_nbytes[sid] = st.nbytes()
        self._storages[id(st)] = (weakref.ref(st), sid)
        return sid

    def _lookup(self, t: Tensor) -> int | None:
        ent = self._ids.get(id(t))
        if ent is None or ent[0]() is not t:
            return self._derived(t) if self._shards or type(t) not in _PLAIN else None
        vid = ent[1]
        if t._version != self.tape.values[vid].version or (
                self._shard_versions and vid in self._shard_versions
                and t._local_tensor._version != self._shard_versions[vid]) or (
                self._kernel_written and vid < self._kernel_written.get(self.tape.values[vid].sid, -1)):
            vid = self._refresh(t)
        return vid

    def _note_dtensor(self, vid: int, t: Tensor, shard_version: int | None = None) -> None:
        """Register a DTensor value's shard, so a later read of the shard maps to it, with the
        shard's version while the value is current (now, unless given) (invariant 8)."""
        parts = _dtensor_parts(t)
        if parts is not None:
            local = parts[0]
            self._shards[id(local)] = (weakref.ref(local), weakref.ref(t))
            self._shard_versions[vid] = local._version if shard_version is None else shard_version
            self.tape.values[vid].wrapper = True

    def _derived(self, t: Tensor) -> int | None:
        """A tensor no recorded op returned that is the shard of a DTensor on the tape, or a
        DTensor over a local tensor on the tape, becomes a value of a :func:`local_shard` or
        :func:`as_dtensor` step (invariant 8); None for anything else."""
        if type(t) in _PLAIN:
            if not self._shards:
                return None
            ent = self._shards.get(id(t))
            if ent is None or ent[0]() is not t:
                return None
            owner = ent[1]()
            dvid = None if owner is None else self._lookup(owner)
            return None if dvid is None else self._step(local_shard, (Ref(dvid),), dvid, t)
        parts = _dtensor_parts(t)
        if parts is None:
            return None
        lvid = self._lookup(parts[0])
        if lvid is None:
            return None
        return self._step(as_dtensor, (Ref(lvid), parts[1], str(parts[1].placements)), lvid, t)

    def _step(self, func: Any, args: tuple, dep: int, t: Tensor) -> int:
        """Put a step of the recorder's own (not a dispatched op) on the tape, producing ``t``."""
        idx = len(self.tape.ops)
        op = TapeOp(func, args, {}, (dep,))
        self.tape.ops.append(op)
        vid = self._produced(idx, 0, t, t._version, self._sid(t))
        op.outs = [vid]
        op.n_returned = 1
        op.time_s = 0.0
        if idx in self._keep_only_ops:  # its replay once differed (replay invariant 13)
            op.keep_only = UNSEEN
        if (idx, 0) in self._keep or op.keep_only is not None:
            self._bypass, bypass = True, self._bypass
            try:
                self._hold(vid, t)
            finally:
                self._bypass = bypass
        return vid

    def _hold(self, vid: int, t: Tensor) -> None:
        self.held[vid] = t.detach()
        self._fresh.append((vid, weakref.ref(t)))
        self._held_by_sid.setdefault(self.tape.values[vid].sid, set()).add(vid)

    def _external(self, t: Tensor) -> int:
        sid = self._sid(t)
        self.tape.external_sids.add(sid)
        vid = self.tape.add_value(-1, -1, EXTERNAL, t, t._version, sid)
        self._ids[id(t)] = (weakref.ref(t), vid)
        if type(t) not in _PLAIN:
            self._note_dtensor(vid, t)
        self._hold(vid, t)
        if id(t) in self._owned:
            self.owned_vids.add(vid)
        return vid

    @property
    def _owned(self) -> set[int]:
        if self._owned_ids is None:
            owned = self._owned_of
            self._owned_ids = set() if owned is None else owned() if callable(owned) else owned
        return self._owned_ids

    def _produced(self, op: int, slot: int, t: Tensor, version: int, sid: int) -> int:
        vid = self.tape.add_value(op, slot, PRODUCED, t, version, sid)
        self._ids[id(t)] = (weakref.ref(t), vid)
        if type(t) not in _PLAIN:
            self._note_dtensor(vid, t)
        return vid

    def _refresh(self, t: Tensor) -> int:
        """``t`` was written through another alias of its storage: make its new content a value."""
        parts = _dtensor_parts(t)
        if parts is not None:  # invariant 8: the DTensor over its shard's current value
            ent = self._ids.get(id(parts[0]))
            lvid = self._lookup(parts[0]) if ent is not None and ent[0]() is parts[0] else None
            if lvid is None:
                return self._external(t)
            return self._step(as_dtensor, (Ref(lvid), parts[1], str(parts[1].placements)), lvid, t)
        sid = self._sid(t)
        src = self._last_write.get(sid)
        if src is None:
            # Written by code the dispatcher never saw: all we can do is hold it as it is now.
            return self._external(t)
        vid = self._step(storage_alias, (Ref(src), t.dtype, tuple(t.shape), tuple(t.stride()),
                                         t.storage_offset()), src, t)
        if sid in self._unwritten_sids:  # invariant 10: parts of it no recorded op wrote
            self._unwritten.add(vid)
        return vid

    # Recording ------------------------------------------------------------------------------

    def _encode(self, a: Any, deps: list[int]) -> Any:
        if isinstance(a, Tensor):
            vid = self._lookup(a)
            if vid is None:
                vid = self._external(a)
            deps.append(vid)
            return Ref(vid)
        if isinstance(a, (list, tuple)):
            if any(isinstance(x, Tensor) for x in a):
                return [self._encode(x, deps) for x in a]
            return list(a) if isinstance(a, list) else a
        return a

    def _before_write(self, t: Tensor, copies: dict[int, Tensor] | None = None) -> None:
        """Invariant 3: nothing held may be clobbered by the write about to happen to ``t``.

        ``copies``: vid -> a copy of a held value taken before a write that has already happened
        (a Triton launch whose written arguments are known only afterwards)."""
        sid = self._sid(t)
        vids = self._held_by_sid.pop(sid, None)
        if not vids:
            return
        values = self.tape.values
        for vid in vids:
            v = values[vid]
            # Either way the held value no longer aliases the tensor the caller sees: nothing to
            # check its version against (invariant 7).
            self._originals.pop(vid, None)
            if v.kind == PRODUCED and self.tape.ops[v.op].keep_only is None:
                del self.held[vid]  # replayable: drop the hold, replay rebuilds this version
                continue
            copy = copies[vid] if copies is not None and vid in copies else _copy(self.held[vid])
            new_sid = len(self.tape.storage_nbytes)
            self.tape.storage_nbytes[new_sid] = copy.untyped_storage().nbytes()
            v.kind, v.sid, v.nbytes, v.free = SNAPSHOT, new_sid, self.tape.storage_nbytes[new_sid], False
            self.held[vid] = copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._bypass:
            return func(*args, **kwargs)
        if self._fresh:
            self._settle()
        if self._plan is not None:
            return self._follow_op(func, args, kwargs)
        return self._record(func, args, kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = op_info(func)
        eargs, ekwargs, deps = self._encode_all(args, kwargs)
        if self._unwritten:
            self._read_unwritten(info, args, kwargs)
        written = written_tensors(info, args, kwargs) if info.write_args else ()
        before = []
        if written:
            for t, _ in written:
                before.append(self._lookup(t))
                if not info.inplace_view:
                    self._before_write(t)
        rng = None
        if info.random:
            gen = generator_for(func, args, kwargs, _device_of(args, kwargs))
            if gen is not None:
                rng = (gen, gen.get_state())

        if self.timer is None:
            out = func(*args, **kwargs)
            elapsed = None
        else:
            out, elapsed = self.timer.call(func, args, kwargs, can_repeat=not written, rng=rng)
        self._commit(func, info, args, eargs, ekwargs, deps, written, before, rng, elapsed, out)
        return out

    def _commit(self, func: Any, info: Any, args: tuple, eargs: tuple, ekwargs: dict, deps: list[int],
                written: Any, before: list, rng: Any, elapsed: float | None, out: Any) -> None:
        """Put an op that has run on the tape: its values, and what is held of them."""
        flat = flatten_outputs(out)
        # A launch stays on the tape even when it wrote nothing: ProgramCheck hashes every launch.
        if not written and type(func) is not KernelLaunch and not any(isinstance(o, Tensor) for o in flat):
            return
        tape = self.tape
        idx = len(tape.ops)
        op = TapeOp(func, eargs, ekwargs, tuple(deps) if len(deps) < 2 else tuple(dict.fromkeys(deps)))
        op.rng = rng
        op.time_s = elapsed
        op.inplace_view = info.inplace_view
        op.keep_only = (keep_only_reason(info, args) if info.keep_only else None) or (
            "random op on a device without a known generator" if info.random and rng is None else None) or (
            UNSEEN if idx in self._keep_only_ops else None)
        view_unwritten = (info.view_of is not None and self._unwritten and info.view_of < len(args)
                          and self._vid_now(args[info.view_of]) in self._unwritten)
        tape.ops.append(op)
        pending = {id(t): (t, bumps, b) for (t, bumps), b in zip(written, before)} if written else {}
        first_new_sid = len(tape.storage_nbytes)
        writes = []
        outs: list[int | None] = []
        tensors: list[Tensor | None] = []
        for o in flat:
            if not isinstance(o, Tensor):
                outs.append(None)
                tensors.append(None)
                continue
            w = pending.pop(id(o), None)
            if w is not None:
                vid = self._write_value(idx, len(outs), o, w[1] and not info.inplace_view)
                writes.append((w[2], vid))
            else:
                # A view's own counter still reads 0 here; autograd then shares its base's.
                version = o._version if info.view_of is None else _version_of(args, info.view_of, o)
                vid = self._produced(idx, len(outs), o, version, self._sid(o))
            outs.append(vid)
            tensors.append(o)
        op.n_returned = len(outs)
        for t, bumps, b in pending.values():
            vid = self._write_value(idx, len(outs), t, bumps and not info.inplace_view)
            writes.append((b, vid))
            outs.append(vid)
            tensors.append(t)
        op.outs = outs
        op.writes = tuple(writes)
        if info.allocates or view_unwritten or writes and self._unwritten_sids:
            self._note_unwritten(op, info, tensors, view_unwritten)
        nbytes = tape.storage_nbytes
        if len(nbytes) > first_new_sid:
            op.alloc_bytes = sum([nbytes[s] for s in range(first_new_sid, len(nbytes))])

        keep_all = op.keep_only is not None
        keep = self._keep
        values = tape.values
        for slot, vid in enumerate(outs):
            if vid is not None and (keep_all or values[vid].free or (idx, slot) in keep):
                self._hold(vid, tensors[slot])

    # Bytes the dispatcher did not see written (invariants 10 and 11) -------------------------

    def _vid_now(self, t: Any) -> int | None:
        """The value ``t`` is mapped to now, without refreshing it (None: not on the tape)."""
        ent = self._ids.get(id(t)) if isinstance(t, Tensor) else None
        return ent[1] if ent is not None and ent[0]() is t else None

    def _read_unwritten(self, info: OpInfo, args: tuple, kwargs: dict) -> None:
        """Hold every unwritten value whose contents this op reads (invariant 10)."""
        unread = info.unread
        for where, a in (*enumerate(args), *kwargs.items()):
            if where in unread:
                continue
            for t in (a if type(a) in (list, tuple) else (a,)):
                vid = self._vid_now(t)
                if vid is not None and vid in self._unwritten:
                    self._hold_unseen(vid, t)

    def _note_unwritten(self, op: TapeOp, info: OpInfo, tensors: list, view_unwritten: bool) -> None:
        """After an op: which of its values are unwritten, and which storages it wrote whole."""
        values = self.tape.values
        written = {after for _, after in op.writes}
        for before, _after in op.writes:  # superseded: a later read is of the new version
            self._unwritten.discard(before)
        for vid, t in zip(op.outs, tensors):
            if vid is None:
                continue
            v = values[vid]
            if info.allocates or (view_unwritten and vid not in written):
                self._unwritten.add(vid)
                if info.allocates:
                    self._unwritten_sids.add(v.sid)
            elif vid in written and v.sid in self._unwritten_sids and _covers_storage(t):
                self._unwritten_sids.discard(v.sid)

    def _hold_unseen(self, vid: int, t: Tensor) -> None:
        """Hold an unwritten value as it is now and make its op keep-only (invariant 10): replay
        cannot make bytes that no recorded op wrote. Other outputs of that op still alive are
        held with it (it is keep-only as a whole)."""
        tape = self.tape
        root, root_t = self._unwritten_root(vid)
        if root_t is not None and root != vid:
            vid, t = root, root_t  # hold the allocation itself: the views of it replay from it
        op = tape.ops[tape.values[vid].op]
        if op.keep_only is None:
            op.keep_only = UNSEEN
        bypass, self._bypass = self._bypass, True
        try:
            pending = [(vid, t)]
            if len(op.outs) > 1:
                alive = {v: r for r, v in self._ids.values()}
                for o in op.outs:
                    r = alive.get(o) if o is not None and o != vid else None
                    t_o = None if r is None else r()
                    if t_o is not None and t_o._version == tape.values[o].version:
                        pending.append((o, t_o))
            for o, t_o in pending:
                self._unwritten.discard(o)
                if o not in self.held:
                    self._hold(o, t_o)
        finally:
            self._bypass = bypass
        if op_info(op.func).allocates:  # the whole storage is held now: its views replay from it
            values = tape.values
            sid = values[vid].sid
            self._unwritten_sids.discard(sid)
            self._unwritten = {u for u in self._unwritten if values[u].sid != sid}

    def _as_is(self, t: Tensor) -> "AsIs":
        """A saved tensor left as it is; on verification forwards also remembered (weakly), since
        its version check explains a replayed difference first (replay invariant 13)."""
        handle = AsIs(self.link, t)
        if self.verify:
            self._kept_as_is.append(weakref.ref(handle))
        return handle

    def _unwritten_root(self, vid: int) -> tuple[int, Tensor | None]:
        """The allocation an unwritten view was taken from (through view ops), and its tensor if
        it is still alive; ``(vid, None)`` when there is none to hold instead."""
        tape = self.tape
        values, ops = tape.values, tape.ops
        root = vid
        while True:
            v = values[root]
            if v.op < 0:
                break
            op = ops[v.op]
            info = op_info(op.func)
            if info.allocates or info.view_of is None or not op.deps or op.deps[0] not in self._unwritten:
                break
            root = op.deps[0]
        if root == vid or not op_info(ops[values[root].op].func).allocates:
            return vid, None
        for r, bound in self._ids.values():
            if bound == root:
                t = r()
                if t is not None and t._version == values[root].version:
                    return root, t
        return vid, None

    def _fingerprint(self, vid: int, t: Tensor) -> None:
        """Verification forwards: what replay must rebuild of a saved value, bit for bit (replay
        invariant 13)."""
        if vid not in self.fingerprints:
            with torch._C._DisableTorchDispatch():  # TapeSAC's own check: no op of the block, no meter
                fp = fingerprint(t)
            if fp is not None:
                self.fingerprints[vid] = fp

    def launch_kernel(self, kernel: Any, run: Any, args: tuple, kwargs: dict) -> Any:
        """A Triton launch inside the block's forward (:mod:`tapesac.kernels` routes it here):
        run it and put it on the tape as a :class:`~tapesac.kernels.KernelLaunch` step whose
        values are the arguments it wrote (invariants 10 and 11); following, check it against
        the tape's next step instead."""
        if self._bypass or self._seg_run is not None or "grid" not in kwargs:
            # Inside another launch or a pure call; or a launcher that is not Triton's own
            # (invariants 10 and 13 cover what it writes).
            return run(kernel, *args, **kwargs)
        if self._fresh:
            self._settle()
        self._bypass = True  # what runs here (the launch, copies, fingerprints) is not the block's
        try:
            return self._launch(kernel, args, kwargs)
        finally:
            self._bypass = False

    def _launch(self, kernel: Any, args: tuple, kwargs: dict) -> Any:
        kwargs = dict(kwargs)
        grid = kwargs.pop("grid")
        kwargs.pop("warmup", None)
        launch = KernelLaunch(kernel, grid, launch_constants(kernel, args, kwargs))
        tensors: dict[int, Tensor] = {}
        for a in (*args, *kwargs.values()):
            for t in (a if type(a) in (list, tuple) else (a,)):
                if isinstance(t, Tensor):
                    tensors.setdefault(id(t), t)
        static = written_by_analysis(kernel, args, kwargs)
        if static is not None:
            maybe = list({id(t): t for n, t in kernel_arg_names(kernel, args, kwargs)
                          if n in static and isinstance(t, Tensor)}.values())
        else:
            maybe = list(tensors.values())
        self.kernel_launches += 1
        plan = self._plan
        if plan is not None:
            i = self._i
            step = plan.steps[i] if i < len(plan.steps) else None
            seen = (self._match_args(step, args, kwargs)
                    if step is not None and step.func == launch and step.func.same_grid(launch) else None)
            if seen is None:
                self._leave_follow()
            else:
                # Held values a write would clobber, should the launch write other arguments than
                # the tape's (then it is recorded after all, and invariant 3 needs them).
                values = plan.tape.values
                sids = {values[seen[id(t)]].sid for t in maybe if id(t) in seen}
                copies = {vid: _copy(h) for vid, h in self.held.items()
                          if values[vid].sid in sids and not (values[vid].kind == PRODUCED
                                                             and plan.tape.ops[values[vid].op].keep_only is None)}
                out, written_ts, _ = self._run_launch(launch, args, kwargs, maybe, static)
                if {seen.get(id(t)) for t in written_ts} == set(step.after):
                    return self._follow_out(step, i, launch, args, kwargs, [(t, False) for t in written_ts], seen, out)
                self._leave_follow()  # it wrote other arguments than when it was recorded
                return self._commit_launch(launch, args, kwargs, tensors, written_ts, copies, None, out)
        eargs_deps = self._encode_all(args, kwargs)
        # What the written arguments were before the launch (its own ATen ops, an autotuner's
        # pre-hook zeroing an output, may move their version counters).
        before = {id(t): self._lookup(t) for t in maybe}
        # Held values in the storages the launch may write, as they are before it (invariant 3).
        copies = {}
        for t in maybe:
            for hv in self._held_by_sid.get(self._sid(t), ()):
                v = self.tape.values[hv]
                if hv not in copies and not (v.kind == PRODUCED and self.tape.ops[v.op].keep_only is None):
                    copies[hv] = _copy(self.held[hv])
        out, written_ts, elapsed = self._run_launch(launch, args, kwargs, maybe, static, timed=True)
        return self._commit_launch(launch, args, kwargs, tensors, written_ts, copies, elapsed, out, eargs_deps,
                                   before)

    def _run_launch(self, launch: KernelLaunch, args: tuple, kwargs: dict, maybe: list, static: Any,
                    timed: bool = False) -> tuple[Any, list, float | None]:
        """Run a launch (the mode bypassed); (its result, the tensors it wrote, its measured time
        when profiling). Without PyTorch's analysis of the kernel, the tensors it wrote are those
        whose bytes it changed."""
        before = [fingerprint(t) for t in maybe] if static is None else None
        if before is not None and any(fp is None for fp in before):
            before = None  # a tensor subclass: take every argument as written
        if timed and self.timer is not None:
            out, elapsed = self.timer.call(launch, args, kwargs, can_repeat=False, rng=None)
        else:
            out, elapsed = launch(*args, **kwargs), None
        if before is None:
            return out, maybe, elapsed
        return out, [t for t, fp in zip(maybe, before) if not torch.equal(fingerprint(t), fp)], elapsed

    def _commit_launch(self, launch: KernelLaunch, args: tuple, kwargs: dict, tensors: dict, written_ts: list,
                       copies: dict, elapsed: float | None, out: Any, encoded: Any = None,
                       looked_up: dict | None = None) -> Any:
        """Put a launch that has run on the tape (recording mode)."""
        eargs, ekwargs, deps = encoded if encoded is not None else self._encode_all(args, kwargs)
        if self._unwritten:  # what the launch read but did not write
            written_ids = {id(t) for t in written_ts}
            for t in tensors.values():
                vid = self._vid_now(t)
                if id(t) not in written_ids and vid is not None and vid in self._unwritten:
                    self._hold_unseen(vid, t)
        before = [looked_up[id(t)] if looked_up is not None and id(t) in looked_up else self._lookup(t)
                  for t in written_ts]
        for t in written_ts:
            self._before_write(t, copies)
        self._commit(launch, _KERNEL_INFO, args, eargs, ekwargs, deps, [(t, False) for t in written_ts], before,
                     None, elapsed, out)
        op = self.tape.ops[-1] if self.tape.ops else None
        if op is not None and op.func is launch:
            for b, after in op.writes:
                self._kernel_written[self.tape.values[after].sid] = after
                self._unwritten.discard(after)
                self._unwritten.discard(b)
            for t in written_ts:  # a launch writes what it writes: taken as whole (see README)
                if _covers_storage(t):
                    self._unwritten_sids.discard(self._sid(t))
            if op.writes and self._saved:
                self._repoint_saved(op)
        return out

    def _repoint_saved(self, op: TapeOp) -> None:
        """Invariant 11: autograd reads a saved tensor's storage as it is in backward, and a
        launch moves no version counter, so a tensor saved before a launch wrote its storage is
        read with the launch's bytes. Point its handle at a value of the written storage with the
        saved tensor's view (it replays from the launch's output)."""
        values = self.tape.values
        written = {values[after].sid: after for _, after in op.writes}
        afters = set(written.values())
        for h in self._saved:
            v = values[h.vid]
            if v.sid not in written or h.vid in afters:
                continue
            t = h.ref() if h.ref is not None else None
            if t is None:
                v.reads -= 1
                h.vid = -1  # the saved view is gone: its unpack explains (unpack_saved)
                continue
            src = written[v.sid]
            new = self._step(storage_alias, (Ref(src), t.dtype, tuple(t.shape), tuple(t.stride()),
                                             t.storage_offset()), src, t)
            v.reads -= 1
            values[new].reads += 1
            h.vid = new
            if self.verify:
                self._fingerprint(new, t)

    # Follow mode ----------------------------------------------------------------------------

    def _follow_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one op of a followed forward: check it is the tape's next op on the same values,
        then do only what backward needs of it (map its outputs, hold what the tape held)."""
        plan = self._plan
        i = self._i
        step = plan.steps[i] if i < len(plan.steps) else None
        if step is not None and step.func in _DTENSOR_STEPS:
            step = self._follow_dtensor_steps(args, kwargs)
            i = self._i
        if step is not None and step.fast and func is step.func and not kwargs and len(args) == step.nargs:
            # The common op, checked inline: each tensor argument is the tape's value (identity,
            # version; plain tensors), the constants are the tape's. Anything else, including a
            # tensor this forward has not seen yet, goes the general way below.
            fids = self._fids
            for pos, _sub, vid in step.tensors:
                a = args[pos]
                ent = fids.get(id(a))
                if ent is None or ent[1] != vid or ent[0]() is not a or a._version != ent[2] or type(a) not in _PLAIN:
                    break
            else:
                consts = tuple([args[p] for p in step.const_pos]) if step.const_pos else ()
                if tuple(map(type, consts)) == step.const_types and consts == step.consts:
                    return self._follow_out(step, i, func, args, kwargs, (), _NOTHING_WRITTEN, step.call(*args))
        if step is None or func is not step.func:
            if not op_info(func).returns_tensor and not op_info(func).write_args:
                return func(*args, **kwargs)  # never on a tape (``.item()``): nothing to follow
            self._leave_follow()
            return self._record(func, args, kwargs)
        seen = self._match_args(step, args, kwargs)
        if seen is None:
            self._leave_follow()
            return self._record(func, args, kwargs)
        written = written_tensors(step.info, args, kwargs) if step.info.write_args else ()
        if step.rng:
            gen = generator_for(func, args, kwargs, _device_of(args, kwargs))
            self._rng[i] = (gen, gen.get_state())
        out = func(*args, **kwargs)
        return self._follow_out(step, i, func, args, kwargs, written, seen, out)

    def _follow_out(self, step: "_FollowStep", i: int, func: Any, args: tuple, kwargs: dict, written: Any,
                    seen: dict[int, int], out: Any) -> Any:
        """Map the outputs of a followed op that has run (and hold what the tape held)."""
        if step.single and isinstance(out, Tensor):  # one tensor out, no writes
            vid = step.outs[0]
            view_of = step.view_of
            # A view's own counter still reads 0 here; autograd then shares its base's.
            version = out._version if view_of is None else _version_of(args, view_of, out)
            self._fids[id(out)] = (weakref.ref(out), vid, version)
            if type(out) not in _PLAIN:
                self._follow_dtensor(vid, out)
            if step.holds:
                self._follow_hold(vid, out)
                self._held_versions[vid] = version
            self._n = step.next_vid
            self._i = i + 1
            return out
        flat = flatten_outputs(out)
        outs = step.outs
        n = step.n_returned
        if len(flat) != n or any((vid is None) != (not isinstance(o, Tensor)) for o, vid in zip(flat, outs)):
            # Same op on the same values, other returns (a data-dependent count): record it.
            if written:
                raise TapeSACError(
                    f"TapeSAC block {self.block}: in-place op {func} returned other values than when "
                    "the block was recorded; please report this with the block")
            rng = self._rng.get(i)
            self._leave_follow()
            self._commit(func, step.info, args, *self._encode_all(args, kwargs), (), [], rng, None, out)
            return out
        fids = self._fids
        ref = weakref.ref
        tensors: list[Tensor | None] = list(flat)
        view_of = step.view_of
        for slot in range(n):
            vid = outs[slot]
            if vid is None or vid in step.written:
                continue
            o = flat[slot]
            # A view's own counter still reads 0 here; autograd then shares its base's.
            fids[id(o)] = (ref(o), vid, o._version if view_of is None else _version_of(args, view_of, o))
            if type(o) not in _PLAIN:
                self._follow_dtensor(vid, o)
        for t, bumps in written:
            after = step.after[seen[id(t)]]
            fids[id(t)] = (ref(t), after, t._version + (1 if bumps and not step.info.inplace_view else 0))
            if outs.index(after) >= n:
                tensors.append(t)
        for slot, vid in step.holds:
            self._follow_hold(vid, tensors[slot])
            self._held_versions[vid] = fids[id(tensors[slot])][2]
        self._n = step.next_vid
        self._i = i + 1
        return out

    def _match_args(self, step: "_FollowStep", args: tuple, kwargs: dict) -> dict[int, int] | None:
        """id(tensor) -> vid for the op's tensor arguments if they are the tape's (and its
        constants match, or may differ here); None if the program departs from the tape."""
        if len(args) != len(step.args) or (kwargs or step.kwargs) and kwargs.keys() != step.kwargs.keys():
            return None
        for pos, expected in step.lists:  # tensor lists: same length, same non-tensor entries
            a = args[pos]
            if type(a) not in (list, tuple) or len(a) != len(expected):
                return None
            for x, y in zip(a, expected):
                if type(y) is not Ref and (type(x) is not type(y) or x != y):
                    return None
        seen: dict[int, int] | None = {} if step.after else None
        match = self._match_tensor
        for pos, sub, vid in step.tensors:  # in the order the recorder met them
            if not match(args[pos] if sub < 0 else args[pos][sub], vid, seen):
                return None
        for name, vid in step.kw_tensors:
            if not match(kwargs[name], vid, seen):
                return None
        consts = tuple([args[p] for p in step.const_pos])
        kw_consts = tuple([kwargs[k] for k in step.kw_const_names]) if step.kw_const_names else ()
        # Same overload, so the schema fixes each position's kind; a type can still differ where
        # the schema allows several (``Tensor?``, ``Scalar``): compare types first, then values.
        if (tuple(map(type, consts)) != step.const_types or consts != step.consts
                or kw_consts and (tuple(map(type, kw_consts)) != step.kw_const_types or kw_consts != step.kw_consts)):
            if not step.may_differ or any(isinstance(x, Tensor) or type(x) in (list, tuple) and any(
                    isinstance(y, Tensor) for y in x) for x in (*consts, *kw_consts)):
                return None
            # Integers and floats are data (sizes, scales): replay must use this forward's.
            self._args[self._i] = self._encode_follow(step, args, kwargs)
        return _NOTHING_WRITTEN if seen is None else seen

    def _match_tensor(self, a: Any, vid: int, seen: dict[int, int] | None) -> bool:
        """``a`` is value ``vid`` (binding it if it is where the tape met a new external);
        ``seen`` (ops that write) collects id -> vid."""
        ent = self._fids.get(id(a))
        if ent is not None and ent[0]() is a:
            if ent[1] != vid or a._version != ent[2] or type(a) not in _PLAIN and self._stale_dtensor(a, vid):
                return False
            if seen is not None:
                seen[id(a)] = vid
            return True
        if not isinstance(a, Tensor):
            return False
        # A tensor this forward has not seen: it must be where the tape met a new external (or
        # the snapshot the recorder later made of one, which it was until then).
        v = self._plan.tape.values[vid]
        if v.op >= 0 or vid != self._n or a.shape != v.shape or a.dtype != v.dtype:
            return False
        self._fids[id(a)] = (weakref.ref(a), vid, a._version)
        if type(a) not in _PLAIN:
            self._follow_dtensor(vid, a)
        self._n = vid + 1
        self._follow_hold(vid, a)
        self._held_versions[vid] = a._version
        if vid in self._plan.owned_vids:  # the same program: the same parameters
            self.owned_vids.add(vid)
        if seen is not None:
            seen[id(a)] = vid
        return True

    def _follow_dtensor_steps(self, args: tuple, kwargs: dict) -> "_FollowStep | None":
        """The tape's next steps are DTensor steps the recorder met at this op's arguments: map
        them to the arguments they made (in order) and return the step after them, or None when
        one of them matches no argument (the program departs)."""
        steps = self._plan.steps
        # Unseen tensors, and DTensors read again after a write through their shard.
        candidates = [t for a in (*args, *kwargs.values()) for t in (a if type(a) in (list, tuple) else (a,))
                      if isinstance(t, Tensor)]
        while self._i < len(steps) and steps[self._i].func in _DTENSOR_STEPS:
            if not any(self._follow_derive(t) is not None for t in candidates):
                return None
        return steps[self._i] if self._i < len(steps) else None

    def _follow_dtensor(self, vid: int, t: Tensor) -> None:
        parts = _dtensor_parts(t)
        if parts is not None:
            self._dtensors[vid] = (weakref.ref(t), parts[0]._version)

    def _stale_dtensor(self, t: Tensor, vid: int) -> bool:
        """Follow mode: DTensor ``t`` (value ``vid``) was read after a write through its shard."""
        ent = self._dtensors.get(vid)
        return ent is not None and ent[0]() is t and t._local_tensor._version != ent[1]

    def _follow_derive(self, t: Tensor) -> int | None:
        """If the tape's next step is a DTensor step whose output ``t`` is (the shard of the
        DTensor it read, or a DTensor over the shard it read, with the recorded placements and
        shape), map ``t`` to its value and move past the step (recorder invariant 8)."""
        steps = self._plan.steps
        i = self._i
        step = steps[i] if i < len(steps) else None
        if step is None or step.func not in _DTENSOR_STEPS:
            return None
        src = step.args[0].vid
        out = step.outs[0]
        if step.func is local_shard:
            owner = self._dtensors.get(src)
            owner = None if owner is None else owner[0]()
            if owner is None or type(t) not in _PLAIN or owner._local_tensor is not t:
                return None
        else:
            parts = _dtensor_parts(t)
            if parts is None:
                return None
            ent = self._fids.get(id(parts[0]))
            v = self._plan.tape.values[out]
            if (ent is None or ent[0]() is not parts[0] or ent[1] != src or parts[0]._version != ent[2]
                    or str(parts[1].placements) != step.args[2] or tuple(t.shape) != v.shape or t.dtype != v.dtype):
                return None
            self._follow_dtensor(out, t)
        self._fids[id(t)] = (weakref.ref(t), out, t._version)
        if step.holds:
            self._follow_hold(out, t)
            self._held_versions[out] = t._version
        self._n = step.next_vid
        self._i = i + 1
        return out

    def _follow_hold(self, vid: int, t: Tensor) -> None:
        """:meth:`_hold` while following (storages are tracked again if the forward departs)."""
        self.held[vid] = t.detach()
        self._fresh.append((vid, weakref.ref(t)))

    def _encode_follow(self, step: "_FollowStep", args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This forward's arguments in tape form: the tape's Refs, this forward's constants."""
        eargs = tuple(e if type(e) is Ref or (type(e) is list and _has_ref(e)) else a
                      for a, e in zip(args, step.args))
        ekwargs = {k: e if _has_ref(e) else kwargs[k] for k, e in step.kwargs.items()}
        return eargs, ekwargs

    def _encode_all(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[int]]:
        """An op's arguments in tape form, and the values they read (recording mode)."""
        deps: list[int] = []
        eargs = tuple([self._encode(a, deps) for a in args])
        ekwargs = {k: self._encode(v, deps) for k, v in kwargs.items()} if kwargs else kwargs
        return eargs, ekwargs, deps

    def _follow_pack(self, t: Tensor) -> Any:
        """The pack hook while following; None to fall back to recording mode's answer."""
        ent = self._fids.get(id(t))
        if ent is None or ent[0]() is not t:
            if self._follow_derive(t) is None:
                handle = self._as_is(t)
                self._note_off_tape(t, handle.tensor)
                return handle
            ent = self._fids[id(t)]
        vid = ent[1]
        if type(t) not in _PLAIN and self._stale_dtensor(t, vid):  # its shard was written
            if self._follow_derive(t) is None:
                self._leave_follow()
                return None
            vid = self._fids[id(t)][1]
        elif t._version != ent[2]:  # written through another alias: recording mode makes a new value
            self._leave_follow()
            return None
        v = self._plan.tape.values[vid]
        if v.kind != PRODUCED or v.free:
            return self._as_is(t)
        self._reads[vid] = self._reads.get(vid, 0) + 1
        handle = Saved(self.link, vid, t)
        if self.verify:
            self._fingerprint(vid, t)
        self._saved.append(handle)
        return handle

    def _leave_follow(self) -> None:
        """The program departs from the followed tape: turn what was followed into a recording
        of its own (the tape's ops and values so far, with this forward's versions, constants,
        generator states and reads) and record the rest of the forward."""
        self._flush_off_tape()
        plan = self._plan
        self._plan = None
        ref = plan.tape
        tape = self.tape
        n = self._n
        snapshot_sids = set()
        for rv in ref.values[:n]:
            v = copy.copy(rv)
            v.reads = self._reads.get(v.vid, 0)
            if v.kind == SNAPSHOT:  # here the live external, not a copy (FollowPlan.eligible)
                v.kind = EXTERNAL
                snapshot_sids.add(v.sid)
            tape.values.append(v)
        for i in range(self._i):
            op = copy.copy(ref.ops[i])
            if i in self._args:
                op.args, op.kwargs = self._args[i]
            if op.rng is not None:
                op.rng = self._rng[i]
            op.time_s = None
            tape.ops.append(op)
        n_sids = 1 + max((v.sid for v in tape.values), default=-1)
        tape.storage_nbytes = {s: ref.storage_nbytes[s] for s in range(n_sids)}
        tape.external_sids = {s for s in ref.external_sids if s < n_sids} | snapshot_sids
        values = tape.values
        for r, vid, version in self._fids.values():
            t = r()
            if t is None:
                continue
            values[vid].version = version
            self._ids[id(t)] = (r, vid)
            parts = _dtensor_parts(t)
            if parts is not None:
                known = self._dtensors.get(vid)
                self._note_dtensor(vid, t, known[1] if known is not None and known[0]() is t else None)
            try:
                st = (t if parts is None else parts[0]).untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            self._storages[id(st)] = (weakref.ref(st), values[vid].sid)
        for vid in self.held:
            self._held_by_sid.setdefault(values[vid].sid, set()).add(vid)
        for op in tape.ops:
            for _, after in op.writes:
                self._last_write[values[after].sid] = after
            if type(op.func) is KernelLaunch:  # invariant 11 from here on
                for _, after in op.writes:
                    self._kernel_written[values[after].sid] = after
                continue
            info = op_info(op.func)
            if info.allocates or info.view_of is not None and any(d in self._unwritten for d in op.deps):
                # Invariant 10 from here on: what the followed part allocated and did not hold.
                # Whole overwrites are not known without the tensors: those storages stay unwritten.
                for o in op.outs:
                    if o is not None and o not in self.held:
                        self._unwritten.add(o)
                        if info.allocates:
                            self._unwritten_sids.add(values[o].sid)
        self._fids, self._reads, self._rng, self._args, self._held_versions = {}, {}, {}, {}, {}
        self._dtensors = {}

    def _settle(self) -> None:
        """Reference the originals of the last op's held values strongly, now that autograd has
        finished making them (invariant 7).

        A strong reference taken while the op is still being dispatched would make autograd wrap
        a shallow copy instead of the tensor itself (``make_variable`` reuses a tensor only while
        nothing else references it), and the caller would see an object the recorder never saw.
        An original already gone is unreachable: no later write can change the held value.
        """
        originals, held = self._originals, self.held
        for vid, ref in self._fresh:
            t = ref()
            if t is not None and vid in held:
                originals[vid] = t
        self._fresh = []

    def _write_value(self, idx: int, slot: int, t: Tensor, bumps: bool) -> int:
        sid = self._sid(t)
        vid = self._produced(idx, slot, t, t._version + (1 if bumps else 0), sid)
        self._last_write[sid] = vid
        return vid

    def hold_outputs(self, out: Any, reason: str) -> None:
        """Make the ops that produced ``out`` keep-only and hold their outputs (invariant 9).

        Called from a forward hook of a module inside the block whose parameters FSDP2 frees
        after that module's forward and gathers again only in that module's backward: replay
        that reaches into the module from a node that runs earlier would read freed storage.
        A followed forward holds what the verified forward held: nothing to do."""
        if self._plan is not None:
            return
        bypass, self._bypass = self._bypass, True
        try:
            tape = self.tape
            alive = None
            for t in flatten_outputs(out):
                if not isinstance(t, Tensor):
                    continue
                vid = self._lookup(t)
                v = None if vid is None else tape.values[vid]
                if v is None or v.kind != PRODUCED or v.free:
                    continue
                op = tape.ops[v.op]
                if op.keep_only is None:
                    op.keep_only = reason
                if alive is None:
                    alive = {vid: ref for ref, vid in self._ids.values()}
                for o in op.outs:
                    ref = alive.get(o)
                    t_o = None if ref is None else ref()
                    if t_o is not None and o not in self.held and t_o._version == tape.values[o].version:
                        self._hold(o, t_o)
        finally:
            self._bypass = bypass

    # Saved-tensor hook ----------------------------------------------------------------------

    def _pack(self, t: Tensor) -> Any:
        """Pack hook: block-produced values become handles; everything else is kept as is."""
        self._bypass = True
        try:
            if self._plan is not None:
                handle = self._follow_pack(t)
                if handle is not None:
                    return handle
            vid = self._lookup(t)
            if self._seg_learn is not None:
                v = None if vid is None else self.tape.values[vid]
                self._seg_learn.append((vid, v is not None and v.kind == PRODUCED and not v.free,
                                        None if vid is not None else (id(t), weakref.ref(t))))
            if vid is None:
                self._note_off_tape(t)
                return self._as_is(t)
            if self._unwritten and vid in self._unwritten:
                self._hold_unseen(vid, t)  # invariant 10: autograd reads it in backward
            v = self.tape.values[vid]
            if v.kind != PRODUCED or v.free:
                return self._as_is(t)
            v.reads += 1
            if self.debug_refs is not None:
                self.debug_refs[vid] = t.detach()
            handle = Saved(self.link, vid, t)
            if self.verify:
                self._fingerprint(vid, t)
            self._saved.append(handle)
            return handle
        finally:
            self._bypass = False

    def _note_off_tape(self, t: Tensor, alias: Tensor | None = None) -> None:
        if self._plan is not None and alias is not None:
            # Following: autograd saves an op's inputs before the op reaches the dispatcher, so a
            # parameter is saved before its first op binds it. Decide at the end, when the
            # forward's bindings tell whether it was the block's own (:meth:`_flush_off_tape`),
            # instead of listing the block's parameters every forward.
            self._off_tape_later.append((id(t), weakref.ref(t), alias))
            return
        if id(t) in self._owned:  # the block's own parameter, saved before an op read it
            return
        self._count_off_tape(t)

    def _count_off_tape(self, t: Tensor) -> None:
        parts = _dtensor_parts(t)
        try:
            st = (t if parts is None else parts[0]).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(st) not in self._off_tape_storages:
            self._off_tape_storages.add(id(st))
            self.off_tape_bytes += st.nbytes()

    # Pure module calls (segments.py) ------------------------------------------------------------

    def run_module(self, module: nn.Module, fn: Any, args: tuple, kwargs: dict) -> Any:
        """A call of a :data:`~tapesac.segments.PURE_MODULES` module inside the block: learn it
        (recording), run it unobserved (following, where the plan has it), or just run it."""
        if kwargs or self._seg_run is not None or self._seg_learn is not None or self._bypass:
            return fn(*args, **kwargs)
        plan = self._plan
        if plan is not None:
            # A verification forward fingerprints every saved tensor: no call runs unobserved.
            seg = None if self.verify else plan.segments.get(self._i)
            if seg is not None:
                out = self._run_segment(plan, seg, module, fn, args)
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
        if self._plan is not None or type(out) is not Tensor:
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

    def _run_segment(self, plan: FollowPlan, seg: Segment, module: nn.Module, fn: Any, args: tuple) -> Any:
        """Run a pure module call unobserved where the plan has one (see :mod:`~tapesac.segments`);
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
            values = plan.tape.values
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
                    if vid in plan.owned_vids:
                        self.owned_vids.add(vid)
            reads = self._reads
            for (t, handle), (vid, saved) in zip(run, seg.packs):
                if vid in seg.first_met and vid not in plan.owned_vids:
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

    def _flush_off_tape(self) -> None:
        """Count the saved tensors a followed forward put off (:meth:`_note_off_tape`), but the
        ones the forward bound to a value that was the block's own parameter or buffer."""
        later, self._off_tape_later = self._off_tape_later, []
        fids = self._fids
        for key, r, alias in later:
            t = r()
            ent = fids.get(key)
            if t is not None and ent is not None and ent[0]() is t:
                # Bound: the block's own when the value was in the verified forward (the same
                # program reads the same parameters at the same place); else an input.
                if ent[1] not in self.owned_vids:
                    self._count_off_tape(t)
                continue
            self._note_off_tape(alias if t is None else t)

    # End of forward -------------------------------------------------------------------------

    def finalize(self) -> Recording:
        """Forward is done (call it outside the dispatch mode): hand over what backward needs."""
        self._settle()
        plan = self._plan
        if plan is not None and (self._i != len(plan.steps) or self._reads != plan.reads):
            self._leave_follow()  # it stopped short, or autograd saved other values
            plan = None
        if plan is not None:
            self._flush_off_tape()
            self.tape = plan.tape
        values = self.tape.values
        if plan is not None:
            self.followed = True
            last_versions, wrapper_versions = plan.last_versions, plan.wrapper_versions
        else:
            last_versions, wrapper_versions = self.tape.last_versions(), self.tape.last_versions(wrappers=True)
        if self.fingerprints:
            # Verification: what autograd will read is the saved tensors' bytes as the forward
            # leaves them; a write after the save that no op made (numpy, a kernel) shows here.
            done: set[int] = set()
            with torch._C._DisableTorchDispatch():
                for handle in self._saved:
                    t = handle.ref() if handle.ref is not None else None
                    if t is not None and handle.vid in self.fingerprints and handle.vid not in done:
                        done.add(handle.vid)
                        fp = fingerprint(t)
                        if fp is not None:
                            self.fingerprints[handle.vid] = fp
        for handle in self._saved:
            if handle.vid < 0:  # re-pointing found its view gone (invariant 11)
                handle.ref = None
                continue
            handle.settle(self.tape, wrapper_versions if values[handle.vid].wrapper else last_versions)
        handles = [weakref.ref(h) for h in self._saved] + self._kept_as_is if self.fingerprints else []
        self._saved = []
        # Outside the mode a detach shares the original's version counter (invariant 7).
        seen = self._held_versions if plan is not None else None
        versions = {vid: (t.detach(), values[vid].version if seen is None else seen[vid])
                    for vid, t in self._originals.items()}
        recording = Recording(self.block, self.tape, self.held, versions, self.owned_vids,
                              self.debug_refs, self.link, self._rng, self._args, plan,
                              self.segments if plan is None else [], self.fingerprints, handles)
        self.held, self.debug_refs, self._originals = {}, None, {}
        self._ids, self._storages, self._held_by_sid, self._last_write = {}, {}, {}, {}
        self._fids, self._plan = {}, None
        return recording
