"""Per-block state and the forward wrapper that records a block and installs the saved-tensor hooks.

A wrapped block's ``forward`` is replaced by an instance attribute, so module hooks (FSDP2's
unshard/reshard among them) still run around it: recording happens strictly inside them, with
the parameters unsharded, and replay later happens inside the block's own backward without
running any module hook again.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .errors import PolicyError, TapeSACError
from .follow import VerifiedTape
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


class BlockState:
    """Everything TapeSAC knows about one wrapped block. Holds the module weakly (no cycle)."""

    def __init__(self, index: int, module: nn.Module, debug: bool = False) -> None:
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
        self._follow: dict[tuple, VerifiedTape] = {}
        """(input shapes, keep set, expected signature) -> the verified forward later forwards
        follow instead of recording (:class:`~tapesac.follow.VerifiedTape`). Kept across policy
        changes: planned mode switches a block between its plan and replay-only as steps come."""
        self._last_key: dict[tuple, int] = {}
        """The same keys -> ``Tape.fast_key`` of the last recorded forward: a program recorded
        twice in a row (or matching the policy's signature) is followed from then on."""
        self.follow = True
        """Let forwards follow a verified tape (False: record every forward, e.g. to measure)."""
        self.pure_calls = True
        """Let followed forwards run pure module calls unobserved (tapesac.segments); False runs
        every op under the dispatch mode (to measure what it saves)."""
        self._passthrough_forwards = 0
        """Pass-through forwards so far (every PASSTHROUGH_CHECK_EVERY-th checks its program)."""
        self.recording_id = -1
        """Planned mode: id of the current recording (the step model follows recordings)."""
        self.timer = None
        """An OpTimer while profiling: the next forwards time every op."""
        self.controller = None
        """The AutoPlanner in planned mode (step boundaries, traces, policy mismatches)."""
        self.on_record: Callable[["BlockState", Recorder, tuple, dict], None] | None = None
        """Called after each recorded forward (profiling, planning hooks)."""
        self.stats: dict[str, Any] = {
            "ops_recorded": 0, "ops_replayed": 0, "ops_in_closure": 0, "values_read": 0,
            "kept_bytes": 0, "input_bytes": 0, "recomputed_bytes": 0, "signature": None, "passthrough": False,
            "compiled": False, "off_tape_bytes": 0, "unseen_bytes": 0, "kernel_launches": 0, "verified": False,
        }
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
        self.compiled = None
        """Compiled mode: the :class:`~tapesac.compiled.CompiledRunner` that runs this block under
        its plan (forwards without a plan, or profiled, still record eagerly); None: eager."""
        self.verify_every = 0
        """Also verify every this-many-th forward (0: only the forwards listed in
        :meth:`_verifies`); replay invariant R6."""
        self._forwards = 0
        """Forwards with grad so far (the sampling clock of ``verify_every``)."""
        self._verified: dict[tuple, int] = {}
        """Verified-tape keys -> ``Tape.fast_key`` of the program a verification forward recorded
        there; a recorded forward of another program makes the next one verify again."""
        self._pending_verdicts: list[tuple[tuple, int, list]] = []
        """Verification forwards whose backward had not run at the last forward: (key, program,
        the replayer's ``checks``)."""
        self.keep_only_ops: set[int] = set()
        """Op indices whose replay once gave other bytes than the forward's (replay invariant R6):
        kept, never rebuilt, from then on."""

    def _mismatch(self, what: str) -> None:
        """This forward's program is not the one the policy was made for: planned mode drops the
        plan (and re-profiles); a fixed policy is an error."""
        if self.controller is not None and self.controller.policy_mismatch(self, what):
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
        if self.controller is not None:
            self.controller.before_forward(self, args, kwargs)
        if self.compiled is not None:
            key = self.compiled.policy_for(self)
            if key is not None:  # compiled mode, under a plan whose program was recorded
                out = self.compiled.forward(self, key, args, kwargs)
                # Nothing recorded: the kept bytes are the plan's (what the compiled forward saves).
                self.stats.update(ops_recorded=0, ops_replayed=0, ops_in_closure=0,
                                  kept_bytes=self.compiled.kept_bytes(self, key), input_bytes=0,
                                  recomputed_bytes=0, compiled=True, passthrough=self.passthrough)
                if self.controller is not None:
                    self.controller.after_forward(self, None)
                return out
        # A pass-through block runs as plain autograd (its policy keeps everything backward reads,
        # so its gradients are exact whatever the program). Its program only decides its memory:
        # it is checked against the policy's (a hashing dispatch mode, O(ops)) in the steps whose
        # memory is measured and in every PASSTHROUGH_CHECK_EVERY-th forward, and runs unchecked
        # (nothing per op) in the others. The first forward under a policy without a known
        # program records instead, to learn it.
        if self.passthrough and self.timer is None and self.program_hash is not None:
            self.stats.update(ops_recorded=0, ops_replayed=0, ops_in_closure=0, kept_bytes=0,
                              input_bytes=0, recomputed_bytes=0, passthrough=True, unseen_bytes=0,
                              kernel_launches=0, verified=False)
            self._passthrough_forwards += 1
            measured = self.controller is not None and self.controller.measuring
            if measured or self._passthrough_forwards % PASSTHROUGH_CHECK_EVERY == 1:
                check = ProgramCheck()
                _local.active, self._recorder = self, check  # Triton launches are hashed too
                try:
                    with check:
                        out = self.original_forward(*args, **kwargs)
                finally:
                    _local.active, self._recorder = None, None
                if check.program_hash != self.program_hash:
                    self._mismatch("a different program (the ops it ran changed)")
            else:
                out = self.original_forward(*args, **kwargs)
            if self.controller is not None:
                self.controller.after_forward(self, None)
            return out
        def owned() -> set[int]:
            ids = {id(t) for t in module.parameters()}
            ids.update(id(t) for t in module.buffers())
            return ids

        key = (_shape_key(args, kwargs), self.keep, self.expected_signature)
        verify = not self.debug and self._verifies(key)  # debug mode compares every value itself
        rec = Recorder(self.index, keep=self.keep, debug=self.debug, owned=owned, timer=self.timer,
                       follow=self._follow.get(key),
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
        replayer = self._finish(rec, args, kwargs, key)
        if self.controller is not None:
            self.controller.after_forward(self, replayer)
        return out

    def _verifies(self, key: tuple) -> bool:
        """Whether this forward is a verification forward (replay invariant R6): the first of a
        new input shape or policy, the one after a recorded forward whose program differed from
        the last verified one there, profiled and measured steps, and every ``verify_every``-th
        forward. Decided from what every rank of an SPMD program shares (shapes, step kind, a
        count), so ranks verify the same forwards."""
        self._forwards += 1
        if self._pending_verdicts:
            # Decided at the next forward, from what the earlier backwards did (the same on every
            # rank), not when a replayer happens to be collected.
            still = []
            for pending in self._pending_verdicts:
                k, fast, (unpacked, differed) = pending
                if unpacked and not differed:
                    self._verified[k] = fast
                elif not unpacked and len(still) < _MAX_VERIFIED_TAPES:
                    still.append(pending)
            self._pending_verdicts = still
        return (key not in self._verified or self.timer is not None
                or (self.controller is not None and self.controller.measuring)
                or (self.verify_every > 0 and self._forwards % self.verify_every == 0))

    def _note_verified(self, rec: Recorder, tape: Any, key: tuple, replayer: Replayer) -> None:
        """Remember which program a recorded forward ran at ``key`` (see :meth:`_verifies`): a
        verification forward's counts once its backward ran without a difference (looked at
        from the next forward on); a backward that never reached it verified nothing."""
        if rec.followed or not rec.verify and key not in self._verified:
            return
        fast = tape.fast_key()  # computed once per tape (the policy check asks for it too)
        if not rec.verify:
            if self._verified.get(key) != fast:
                self._verified.pop(key, None)
            return
        if not replayer.fingerprints:  # nothing to rebuild-check: verified as recorded
            self._verified[key] = fast
            return
        self._pending_verdicts.append((key, fast, replayer.checks))

    def _replay_differed(self, op: int) -> None:
        """Replay invariant 13: op ``op``'s replay gave other bytes than its forward. Keep its
        outputs from the next forward on; tapes followed so far did not, so forget them; a plan
        made without it no longer fits (planned mode re-profiles)."""
        self.keep_only_ops.add(op)
        self._follow.clear()
        self._last_key.clear()
        self._verified.clear()
        self._pending_verdicts.clear()
        if self.controller is not None:
            self.controller.policy_mismatch(self, f"op {op}'s replay differed from its forward")

    def _finish(self, rec: Recorder, args: tuple, kwargs: dict, key: tuple) -> Replayer:
        recording = rec.finalize()  # the recorder is done: replay owns the recording
        tape = recording.tape
        program = None
        if not rec.followed:  # a followed forward ran the verified tape's program: nothing to check
            program = self._check_program(recording, key)
        if self.on_record is not None:
            self.on_record(self, rec, args, kwargs)
        replayer = Replayer(recording, program)
        replayer.stats = self.stats
        replayer.on_mismatch = weakref.WeakMethod(self._replay_differed)
        self._note_verified(rec, tape, key, replayer)
        s = self.stats
        s["passthrough"] = False
        s["compiled"] = False
        s["followed"] = rec.followed
        s["ops_unobserved"] = rec.unobserved_ops
        s["ops_recorded"] = len(tape.ops)
        s["ops_in_closure"] = len(replayer.closure_ops)
        s["values_read"] = len(replayer.program.reads)
        s["kept_bytes"] = replayer.kept_bytes()
        s["input_bytes"] = replayer.input_bytes()
        s["off_tape_bytes"] = rec.off_tape_bytes
        s["unseen_bytes"] = replayer.unseen_bytes()
        s["kernel_launches"] = rec.kernel_launches
        s["verified"] = rec.verify
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
            self.stats["signature"] = sig
            if sig != self.expected_signature:
                self._mismatch(f"signature {sig}, {len(tape.ops)} ops")
                _forget_keeps(recording)  # it runs replay-only: no memory the plan did not count
                return ReplayProgram(tape, recording.held)
            self._verified_key = fast
            if self.program_hash is None:
                self.program_hash = tape.program_hash()
        program = ReplayProgram(tape, recording.held)
        if self.debug or not self.follow or not VerifiedTape.eligible(tape, program):
            return program
        if self.expected_signature is None:  # replay-only: known good once seen twice in a row
            fast = tape.fast_key()
            known, self._last_key[key] = self._last_key.get(key) == fast, fast
            if not known:
                return program
        if len(self._follow) >= _MAX_VERIFIED_TAPES:
            self._follow.clear()
            self._last_key.clear()
        verified = self._follow[key] = VerifiedTape(tape, recording.held, recording.owned_vids, recording.segments)
        verified.program = program
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

_MAX_VERIFIED_TAPES = 8
"""Verified tapes (input shapes x policies) a block keeps at once (more: start again)."""


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
