"""Dispatch modes TapeSAC runs a block under: the base (dynamo never traces into it), and
:class:`ProgramCheck` for blocks that run unrecorded. The recorder is :mod:`tapesac.recorder`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
from torch.utils._python_dispatch import TorchDispatchMode

from .kernels import KernelLaunch, launch_constants
from .ops import op_info, written_tensors
from .tape import flatten_outputs

Tensor = torch.Tensor

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
