"""Per-block state and the forward wrapper that records a block and installs the saved-tensor hooks.

A wrapped block's ``forward`` is replaced by an instance attribute, so module hooks (FSDP2's
unshard/reshard among them) still run around it: recording happens strictly inside them, with
the parameters unsharded, and replay later happens inside the block's own backward without
running any module hook again.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .errors import PolicyError, TapeSACError
from .programs import KnownPrograms
from .handoff import unpack_saved
from .modes import ProgramCheck
from .recorder import Recorder
from .replay import ReplayProgram, Replayer
from .segments import PURE_MODULES

_local = threading.local()


def _active_block() -> "BlockState | None":
    return getattr(_local, "active", None)


def current_recorder() -> "Recorder | None":
    """The recorder of the wrapped block forward running on this thread, if any (Triton
    launches are routed to it, :mod:`tapesac.kernels`)."""
    state = getattr(_local, "active", None)
    return None if state is None else state._recorder


class Controller(Protocol):
    """What drives a block's policy from outside, forward by forward (planned mode's
    :class:`~tapesac.autoplan.AutoPlanner`). The block calls it; it answers through the block's
    methods (:meth:`BlockState.use_policy`, :meth:`BlockState.time_ops`), never by assigning
    into the block's state."""

    measuring: bool
    """This step's memory is measured (pass-through blocks check their program then, and
    recorded forwards verify)."""

    def before_forward(self, state: "BlockState", args: tuple, kwargs: dict) -> Any:
        """A forward of ``state``'s block begins: choose its policy. Returns a token (the
        recording's id) handed back to :meth:`after_forward` of the same forward."""

    def after_forward(self, state: "BlockState", token: Any,
                      replayer: "Replayer | None") -> "Callable[[int], None] | None":
        """The forward that :meth:`before_forward` returned ``token`` for ended; ``replayer`` is
        None for a forward that recorded nothing (compiled or pass-through). Returns what the
        replayer calls with each value's id at every unpack, or None."""

    def policy_mismatch(self, state: "BlockState", what: str) -> bool:
        """``state``'s forward ran another program than its policy's (``what`` says how). True:
        handled (the forward runs replay-only); False: the block raises a PolicyError."""


class Runner(Protocol):
    """What compiled mode does for a block (:class:`~tapesac.compiled.CompiledRunner`)."""

    def policy_for(self, state: "BlockState") -> Any:
        """The key of the compiled code the block's next forward runs, or None: run eagerly."""

    def forward(self, state: "BlockState", key: Any, args: tuple, kwargs: dict) -> Any:
        """Run the block's forward compiled under ``key``."""

    def kept_bytes(self, state: "BlockState", key: Any) -> int:
        """Bytes the compiled forward under ``key`` keeps for backward."""

    def clear(self) -> None:
        """Drop every compiled function (they hold the blocks' forwards)."""


@dataclasses.dataclass
class BlockStats:
    """What a block's last forward (and backward) did; :meth:`as_dict` is the block's entry of
    ``handle.stats()``. Written only by the block's forward paths, and the replay counts by the
    block's replayers."""

    ops_recorded: int = 0
    ops_in_closure: int = 0
    values_read: int = 0
    kept_bytes: int = 0
    input_bytes: int = 0
    signature: str | None = None
    """The tape signature last checked against a policy."""
    passthrough: bool = False
    compiled: bool = False
    off_tape_bytes: int = 0
    unseen_bytes: int = 0
    kernel_launches: int = 0
    verified: bool = False
    fingerprint_bytes: int = 0
    """Bytes of the fingerprints the last forward holds for backward (verification forwards)."""
    followed: bool | None = None
    """None until the block's first recorded forward (``handle.stats()`` has no such key then)."""
    ops_unobserved: int | None = None
    """None until the block's first recorded forward, like ``followed``."""
    replay: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"ops_replayed": 0, "recomputed_bytes": 0})
    """The last backward's ``ops_replayed`` and ``recomputed_bytes``. A dict, one object for the
    block's lifetime: every replayer of the block adds to it on replay's per-op path."""

    def ran_compiled(self, kept_bytes: int, passthrough: bool) -> None:
        """A forward ran compiled: nothing recorded, kept what the plan keeps."""
        self.ops_recorded = self.ops_in_closure = self.input_bytes = 0
        self.replay["ops_replayed"] = self.replay["recomputed_bytes"] = 0
        self.kept_bytes, self.compiled, self.passthrough = kept_bytes, True, passthrough

    def ran_passthrough(self) -> None:
        """A forward ran as plain autograd: nothing recorded, nothing to replay."""
        self.ops_recorded = self.ops_in_closure = self.kept_bytes = self.input_bytes = 0
        self.unseen_bytes = self.kernel_launches = 0
        self.replay["ops_replayed"] = self.replay["recomputed_bytes"] = 0
        self.passthrough, self.verified, self.fingerprint_bytes = True, False, 0

    def recorded(self, rec: Recorder, tape: Any, replayer: Replayer) -> None:
        """A forward recorded (or followed) ``tape``; ``replayer`` will replay it."""
        self.passthrough = self.compiled = False
        self.followed = rec.followed
        self.ops_unobserved = rec.unobserved_ops
        self.ops_recorded = len(tape.ops)
        self.ops_in_closure = len(replayer.closure_ops)
        self.values_read = len(replayer.program.reads)
        self.kept_bytes = replayer.kept_bytes()
        self.input_bytes = replayer.input_bytes()
        self.off_tape_bytes = rec.off_tape_bytes
        self.unseen_bytes = replayer.unseen_bytes()
        self.kernel_launches = rec.kernel_launches
        self.verified = rec.verify
        self.fingerprint_bytes = replayer.fingerprint_bytes()

    def as_dict(self) -> dict[str, Any]:
        """The public form (keys in the order ``handle.stats()`` has always listed them)."""
        out = {"ops_recorded": self.ops_recorded, "ops_replayed": self.replay["ops_replayed"],
               "ops_in_closure": self.ops_in_closure, "values_read": self.values_read,
               "kept_bytes": self.kept_bytes, "input_bytes": self.input_bytes,
               "recomputed_bytes": self.replay["recomputed_bytes"], "signature": self.signature,
               "passthrough": self.passthrough, "compiled": self.compiled,
               "off_tape_bytes": self.off_tape_bytes, "unseen_bytes": self.unseen_bytes,
               "kernel_launches": self.kernel_launches, "verified": self.verified,
               "fingerprint_bytes": self.fingerprint_bytes}
        if self.followed is not None:
            out["followed"] = self.followed
            out["ops_unobserved"] = self.ops_unobserved
        return out


class BlockState:
    """Everything TapeSAC knows about one wrapped block. Holds the module weakly (no cycle).

    The block's state has this one owner: planned mode (a :class:`Controller`) and compiled
    mode (a :class:`Runner`) ask through its methods and read-only properties."""

    def __init__(self, index: int, module: nn.Module, debug: bool = False, verify_every: int = 0,
                 compiled: Runner | None = None) -> None:
        self.index = index
        self._module = weakref.ref(module)
        self._had_forward_attr = "forward" in module.__dict__
        self._saved_forward_attr = module.__dict__.get("forward")
        self.original_forward: Callable = module.forward
        self.debug = debug
        self.keep: frozenset | None = None
        """Positions ``(op index, slot)`` to keep; None keeps nothing the block produced."""
        self.expected_signature: str | None = None
        """Tape signature the keep set was made for; a different tape is an error."""
        self.policy_predicted_peak: float | None = None
        """The step peak the applied policy was predicted to reach."""
        self.passthrough = False
        """The policy keeps everything this block's backward reads: plain autograd, no recording."""
        self._verified_key: int | None = None
        """``Tape.fast_key`` of a tape whose signature matched ``expected_signature``."""
        self._policy_entry: Any = None
        """The BlockPolicy in use (its keep set, signature and pass-through flag are copied above)."""
        self.program_hash: int | None = None
        """``Tape.program_hash`` of the program the policy in use was made for (pass-through
        blocks check it now and then); None until known."""
        self.programs = KnownPrograms(verify_every)
        """The tapes later forwards follow, and what verification forwards checked."""
        self.follow = True
        """Let forwards follow a verified tape (False: record every forward, e.g. to measure)."""
        self.pure_calls = True
        """Let followed forwards run pure module calls unobserved (tapesac.segments); False runs
        every op under the dispatch mode (to measure what it saves)."""
        self._passthrough_forwards = 0
        """Pass-through forwards so far (every PASSTHROUGH_CHECK_EVERY-th checks its program)."""
        self._timer: Any = None
        """An OpTimer while profiling (:meth:`time_ops`): the next forwards time every op."""
        self._controller: Controller | None = None
        """Planned mode's driver (:meth:`attach`): step boundaries, traces, policy mismatches."""
        self.on_record: Callable[["BlockState", Recorder, tuple, dict], None] | None = None
        """Called after each recorded forward (profiling, planning hooks)."""
        self.stats = BlockStats()
        self.last_replayer: weakref.ref | None = None
        """The Replayer of the last recorded forward, weakly (it lives as long as its graph)."""
        self.last_tape = None
        """The Tape of the last recorded forward (plain data, no tensors)."""
        self._recorder: Recorder | None = None
        """The recorder of the forward running now, for the hooks on nested FSDP2 units."""
        self._unit_hooks: list | None = None
        """Forward hooks on the FSDP2 units nested inside the block (recorder invariant 9);
        None until the first recorded forward (FSDP2 may be applied after wrapping)."""
        self._pure_calls: list[weakref.ref] = []
        """Modules inside the block whose ``forward`` routes through the recorder (segments.py)."""
        self.compiled = compiled
        """Compiled mode: the :class:`~tapesac.compiled.CompiledRunner` that runs this block under
        its plan (forwards without a plan, or profiled, still record eagerly); None: eager."""

    # What planned and compiled mode ask of the block --------------------------------------------

    def attach(self, controller: Controller | None) -> None:
        """Let ``controller`` choose this block's policy at every forward (planned mode)."""
        self._controller = controller

    def time_ops(self, timer: Any) -> None:
        """Time every op of the next forwards with ``timer`` (an :class:`~tapesac.profile.OpTimer`;
        None: stop). A timed forward records, never follows, runs compiled or passes through."""
        self._timer = timer

    @property
    def timing(self) -> bool:
        """Forwards time every op now (a profiled step)."""
        return self._timer is not None

    @property
    def keep_only_ops(self) -> set[int]:
        """Op indices whose replay once differed from the forward (kept from then on)."""
        return self.programs.keep_only_ops

    @property
    def policy(self) -> Any:
        """The :class:`~tapesac.policy.BlockPolicy` in use, or None (replay-only)."""
        return self._policy_entry

    def drop_compiled(self) -> None:
        """Forget the compiled runner (``handle.remove()``): its functions hold the forwards."""
        if self.compiled is not None:
            self.compiled.clear()
            self.compiled = None

    def _mismatch(self, what: str) -> None:
        """This forward's program is not the one the policy was made for: planned mode drops the
        plan (and re-profiles); a fixed policy is an error."""
        if self._controller is not None and self._controller.policy_mismatch(self, what):
            return
        raise PolicyError(
            f"TapeSAC block {self.index}: the recorded tape ({what}) is not the one the policy was "
            f"made for (signature {self.expected_signature}). Input shapes or the model changed: "
            "re-plan, or remove the policy to fall back to replay-only"
        )

    def use_policy(self, entry: Any, predicted_peak: float | None = None, program_hash: int | None = None) -> None:
        """Keep what ``entry`` (a :class:`~tapesac.policy.BlockPolicy`, or None for replay-only)
        says from the next forward on. Cheap when the entry is the one in use."""
        if entry is self._policy_entry:
            return
        self._policy_entry = entry
        self._verified_key = None
        self.program_hash = program_hash
        if entry is None:
            self.keep, self.expected_signature, self.passthrough = None, None, False
        else:
            self.keep = frozenset(entry.keep)
            self.expected_signature = entry.signature
            self.passthrough = entry.passthrough
        self.policy_predicted_peak = predicted_peak

    @property
    def module(self) -> nn.Module:
        m = self._module()
        if m is None:
            raise TapeSACError(f"TapeSAC block {self.index}: the module was garbage-collected")
        return m

    def install(self) -> None:
        self.module.forward = _BlockForward(self)

    def _hook_nested_units(self, module: nn.Module) -> None:
        """Hold the outputs of every FSDP2 unit nested inside the block (recorder invariant 9)."""
        self._unit_hooks = []
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            return
        state = self
        for name, sub in module.named_modules():
            if sub is module or not isinstance(sub, FSDPModule):
                continue
            reason = (f"output of '{name}', an FSDP2 unit inside the block: its parameters are freed "
                      "until its own backward")

            def hook(_mod: nn.Module, _args: Any, out: Any, reason: str = reason) -> None:
                rec = state._recorder
                if rec is not None:
                    rec.hold_outputs(out, reason)

            self._unit_hooks.append(sub.register_forward_hook(hook))

    def _wrap_pure_calls(self, module: nn.Module) -> None:
        """Route the calls of pure modules inside the block (:mod:`~tapesac.segments`) through
        the recorder, which may run them unobserved in forwards that follow."""
        for sub in module.modules():
            if sub is module or type(sub) not in PURE_MODULES or "forward" in sub.__dict__:
                continue
            sub.forward = _PureForward(sub)
            self._pure_calls.append(weakref.ref(sub))

    def uninstall(self) -> None:
        for ref in self._pure_calls:
            sub = ref()
            if sub is not None:
                sub.__dict__.pop("forward", None)
        self._pure_calls = []
        for h in self._unit_hooks or ():
            h.remove()
        self._unit_hooks = None
        m = self._module()
        if m is None:
            return
        if self._had_forward_attr:
            m.forward = self._saved_forward_attr
        else:
            m.__dict__.pop("forward", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped forward: checks where it runs, lets planned mode choose the policy, then
        takes one of three paths: compiled, pass-through, or recorded (which may follow a
        verified tape)."""
        module = self.module
        if not (torch.is_grad_enabled() and module.training):
            return self.original_forward(*args, **kwargs)
        outer = _active_block()
        if outer is not None:
            raise TapeSACError(
                f"TapeSAC block {self.index} ran inside the forward of wrapped block {outer.index}; "
                "wrap only the outermost blocks"
            )
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            raise TapeSACError(
                f"TapeSAC block {self.index} ran under another saved-tensor hook (torch.utils.checkpoint, "
                "save_on_cpu, or torchtitan activation checkpointing). TapeSAC replaces activation "
                "checkpointing: remove the other one (torchtitan: activation_checkpoint.mode = 'none')"
            )
        controller = self._controller
        token = controller.before_forward(self, args, kwargs) if controller is not None else None
        if self.compiled is not None:
            key = self.compiled.policy_for(self)
            if key is not None:  # compiled mode, under a plan whose program was recorded
                out = self._forward_compiled(key, args, kwargs)
                if controller is not None:
                    controller.after_forward(self, token, None)
                return out
        # The first forward under a policy without a known program records instead, to learn it.
        if self.passthrough and self._timer is None and self.program_hash is not None:
            out = self._forward_passthrough(args, kwargs)
            if controller is not None:
                controller.after_forward(self, token, None)
            return out
        out, replayer = self._forward_recorded(module, args, kwargs)
        if controller is not None:
            on_unpack = controller.after_forward(self, token, replayer)
            if on_unpack is not None:
                replayer.on_unpack = on_unpack
        return out

    def _forward_compiled(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """Compiled mode, under a plan whose program was recorded: ``torch.compile`` runs it."""
        out = self.compiled.forward(self, key, args, kwargs)
        # Nothing recorded: the kept bytes are the plan's (what the compiled forward saves).
        self.stats.ran_compiled(self.compiled.kept_bytes(self, key), self.passthrough)
        return out

    def _forward_passthrough(self, args: tuple, kwargs: dict) -> Any:
        """A pass-through block runs as plain autograd (its policy keeps everything backward reads,
        so its gradients are exact whatever the program). Its program only decides its memory:
        it is checked against the policy's (a hashing dispatch mode, O(ops)) in the steps whose
        memory is measured and in every PASSTHROUGH_CHECK_EVERY-th forward, and runs unchecked
        (nothing per op) in the others."""
        self.stats.ran_passthrough()
        self._passthrough_forwards += 1
        measured = self._controller is not None and self._controller.measuring
        if not (measured or self._passthrough_forwards % PASSTHROUGH_CHECK_EVERY == 1):
            return self.original_forward(*args, **kwargs)
        check = ProgramCheck()
        _local.active, self._recorder = self, check  # Triton launches are hashed too
        try:
            with check:
                out = self.original_forward(*args, **kwargs)
        finally:
            _local.active, self._recorder = None, None
        if check.program_hash != self.program_hash:
            self._mismatch("a different program (the ops it ran changed)")
        return out

    def _forward_recorded(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Replayer]:
        """Record the forward as a tape (or follow a verified one); returns its output and the
        replayer its backward unpacks through."""
        def owned() -> set[int]:
            ids = {id(t) for t in module.parameters()}
            ids.update(id(t) for t in module.buffers())
            return ids

        key = (_shape_key(args, kwargs), self.keep, self.expected_signature)
        # Debug mode compares every value itself; profiled and measured steps always verify.
        verify = not self.debug and self.programs.verifies(key, self._timer is not None or (
            self._controller is not None and self._controller.measuring))
        rec = Recorder(self.index, keep=self.keep, debug=self.debug, owned=owned, timer=self._timer,
                       follow=self.programs.verified_tapes.get(key),
                       learn_segments=self.follow and self.pure_calls and self.compiled is None,
                       verify=verify, keep_only_ops=self.keep_only_ops)
        if self._unit_hooks is None:
            self._hook_nested_units(module)
            if self.compiled is None:
                self._wrap_pure_calls(module)
        _local.active = self
        self._recorder = rec
        # Recording makes a few small objects per op; automatic collections triggered by them in
        # the middle of a forward cost more than the recording itself. Pause them for the block
        # (torchtitan runs with gc disabled anyway); the next allocation afterwards catches up.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, unpack_saved), rec:
                out = self.original_forward(*args, **kwargs)
        finally:
            _local.active = None
            self._recorder = None
            if collecting:
                gc.enable()
        return out, self._finish(rec, args, kwargs, key)

    def _replay_differed(self, op: int) -> None:
        """Replay invariant 13: op ``op``'s replay gave other bytes than its forward. Keep its
        outputs from the next forward on; tapes followed so far did not, so forget them; a plan
        made without it no longer fits (planned mode re-profiles)."""
        self.programs.replay_differed(op)
        if self._controller is not None:
            self._controller.policy_mismatch(self, f"op {op}'s replay differed from its forward")

    def _finish(self, rec: Recorder, args: tuple, kwargs: dict, key: tuple) -> Replayer:
        recording = rec.finalize()  # the recorder is done: replay owns the recording
        tape = recording.tape
        program = None
        if not rec.followed:  # a followed forward ran the verified tape's program: nothing to check
            program = self._check_program(recording, key)
        if self.on_record is not None:
            self.on_record(self, rec, args, kwargs)
        replayer = Replayer(recording, program)
        replayer.stats = self.stats.replay  # the replay counts: replay adds to them per op
        replayer.on_mismatch = weakref.WeakMethod(self._replay_differed)
        self.programs.note_verified(rec, tape, key, replayer)
        self.stats.recorded(rec, tape, replayer)
        self.last_replayer = weakref.ref(replayer)
        self.last_tape = tape
        if self.compiled is not None:
            # The plan's program is known now: the next forward under this plan runs compiled,
            # also when forwards of other shapes (other plans) run in between.
            self.compiled.policy_for(self)
        return replayer

    def _check_program(self, recording: Any, key: tuple) -> ReplayProgram:
        """A recorded forward: check its program against the policy's, and let the next forwards
        follow it once it is known good (seen twice in a row, or matching the policy). Returns
        its replay program."""
        tape = recording.tape
        if self.expected_signature is not None:
            fast = tape.fast_key()
            sig = self.expected_signature if fast == self._verified_key else tape.signature()
            self.stats.signature = sig
            if sig != self.expected_signature:
                self._mismatch(f"signature {sig}, {len(tape.ops)} ops")
                _forget_keeps(recording)  # it runs replay-only: no memory the plan did not count
                return ReplayProgram(tape, recording.held)
            self._verified_key = fast
            if self.program_hash is None:
                self.program_hash = tape.program_hash()
        program = ReplayProgram(tape, recording.held)
        if not self.debug and self.follow:
            self.programs.learn(key, recording, program, checked=self.expected_signature is not None)
        return program


@torch.compiler.disable
def _run_block(state: BlockState, args: tuple, kwargs: dict) -> Any:
    return state.forward(*args, **kwargs)


class _BlockForward:
    """A wrapped block's ``forward``. A deep copy of the block is not wrapped: it gets its own
    forward (never one that runs the original module, whose parameters are not the copy's)."""

    __slots__ = ("__tapesac_state__",)

    def __init__(self, state: BlockState) -> None:
        self.__tapesac_state__ = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run_block(self.__tapesac_state__, args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        state = self.__tapesac_state__
        if state._had_forward_attr:
            return copy.deepcopy(state._saved_forward_attr, memo)
        return _copied_forward(state._module(), memo)


class _PureForward:
    """The ``forward`` of a pure module inside a wrapped block: the recorder's while it records
    or follows the block, the class's otherwise. Refers to the module weakly (no cycle)."""

    __slots__ = ("ref",)

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        cls_forward = type(module).forward  # now: a class patched later is the class
        state = _active_block()
        rec = None if state is None else state._recorder
        if rec is None or type(module) not in PURE_MODULES or torch.compiler.is_compiling():
            return cls_forward(module, *args, **kwargs)
        return rec.run_module(module, cls_forward.__get__(module), args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return _copied_forward(self.ref(), memo)


class _ClassForward:
    """What a deep copy of a module TapeSAC wrapped has as ``forward``: its own class's."""

    __slots__ = ("ref",)

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.ref()
        return type(module).forward(module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return _copied_forward(self.ref(), memo)


def _copied_forward(original: nn.Module | None, memo: dict) -> _ClassForward:
    copied = None if original is None else memo.get(id(original))
    if copied is None:
        raise TapeSACError(
            "a module's forward that TapeSAC replaced was deep-copied without the module; remove "
            "TapeSAC first (handle.remove()) and wrap again afterwards")
    return _ClassForward(copied)


PASSTHROUGH_CHECK_EVERY = 16
"""A pass-through block checks its program in measured steps and in every this many forwards."""


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    """Which verified tape a forward tries: its tensor arguments' shapes, dtypes and grad flags.
    Only a guess (a followed forward checks everything it reads), so it may be coarse."""
    return tuple((a.shape, a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else type(a)
                 for a in (*args, *kwargs.values()))


def _forget_keeps(recording: Any) -> None:
    """Drop the holds a keep set added, before the replayer is built: what is left is exactly
    what replay-only holds (externals, snapshots, outputs of keep-only ops, free views)."""
    for vid in [v for v in recording.held if recording.tape.rebuildable(v)]:
        del recording.held[vid]
