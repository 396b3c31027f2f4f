"""What torchtitan needs to train on a machine without an accelerator, whatever its version.

torchtitan picks ``cuda`` when no accelerator is present and reads memory statistics from
``torch.cuda``; FSDP2 reduces gradients with ``PREMUL_SUM`` or ``AVG``, which gloo lacks.
:func:`install` points every imported torchtitan module at a CPU "device module" with the few
calls it makes, makes FSDP2 reduce CPU gradients with plain sums and a separate division (FSDP2's
own ``force_sum_reduction_for_comms`` path, applied to every FSDP module whose gradients live on
the CPU; the result is the same), fills an ATen CPU gap (:func:`patch_ops`), and ends a process
whose gloo process groups were destroyed cleanly without the interpreter's final teardown, where
gloo can abort an already finished job (see :func:`_exit_after_clean_teardown`).

The version-specific parts (torchtitan 0.2.x's MoE experts, torchtitan 0.3.x's FlexAttention)
live in each front door's ``cpu_shim``.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import resource
import sys
from types import SimpleNamespace

import torch

_installed = False
_patched_ops = False


def cpu_capacity_bytes(local_ranks: int | None = None) -> int:
    """Physical memory divided by the ranks on this node: the CPU "device capacity"."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return total // max(local, 1)


class CpuDeviceModule:
    """The part of ``torch.cuda``'s interface torchtitan uses, for the CPU.

    Memory statistics are the process's peak resident set size (the only allocator-level number
    the CPU offers); TapeSAC's own measurements count tensor storages instead.
    """

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    def get_device_properties(self, device=None):
        return SimpleNamespace(total_memory=cpu_capacity_bytes(), name=self.get_device_name())

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def memory_stats(self, device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}


def patch_ops() -> None:
    """CPU gaps in ATen that torchtitan's models hit.

    ``torch.histc`` has no CPU kernel for integer tensors, and torchtitan's MoE router counts
    tokens per expert with ``histc`` on int64 expert indices. Integer inputs are counted in
    float32 (exact for counts below 2**24) and cast back, as the CUDA kernel returns them.
    """
    global _patched_ops
    if _patched_ops:
        return
    original = torch.histc

    def histc(input, bins=100, min=0, max=0, *, out=None):
        if input.device.type == "cpu" and not input.is_floating_point() and out is None:
            return original(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        if out is None:
            return original(input, bins=bins, min=min, max=max)
        return original(input, bins=bins, min=min, max=max, out=out)

    histc.__doc__ = original.__doc__
    torch.histc = histc
    _patched_ops = True


def install() -> None:
    """Point torchtitan at the CPU. Safe to call more than once; no-op when CUDA is present.

    torchtitan binds ``device_type`` and ``device_module`` at import (``from
    torchtitan.tools.utils import device_module``): they are rebound in every torchtitan module
    imported so far, and in ``torchtitan.tools.utils`` for what is imported later.
    """
    global _installed
    if _installed or torch.cuda.is_available():
        return
    module = CpuDeviceModule()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is torch.cuda:
            mod.device_module = module
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", module
    patch_ops()
    _sum_reductions_on_cpu()
    _exit_after_clean_teardown()
    _installed = True


def _sum_reductions_on_cpu() -> None:
    """FSDP2 decides its reduce ops per reduction; on CPU, ask it for its all-SUM variant.

    torch 2.13 exposes the switch per module (``FSDPModule.set_force_sum_reduction_for_comms``)
    and reads it in one place, which is where this applies it for CPU gradients, so that jobs
    with and without TapeSAC reduce identically.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors
    if getattr(original, "__tapesac__", False):
        return

    def divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
                       factor=None, force_sum_reduction_for_comms=False):
        force = force_sum_reduction_for_comms or device_type == "cpu"
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, force)

    divide_factors.__tapesac__ = True  # type: ignore[attr-defined]
    collectives._get_gradient_divide_factors = divide_factors


_teardown = {"clean": False, "failed": False}


def _exit_after_clean_teardown() -> None:
    """When torchtitan's ``main`` has destroyed the process groups at the end of a finished job
    and nothing failed after, end the process at exit with status 0 before the interpreter's
    final teardown.

    On CPU, a gloo job that finished and destroyed its process groups can still abort in that
    teardown ("terminate called without an active exception", SIGABRT) while C++ objects are
    freed: seen about once in 50 two-rank torchtitan runs here, and a known class of gloo
    shutdown problem upstream (pytorch/pytorch#190489, the abandoned pytorch/pytorch#179291).
    torchrun then reports the finished job as failed and kills its other ranks. Every Python
    ``atexit`` handler registered after this one (all of torchtitan's, a test's probes) still
    runs first; handlers registered before it (logging's shutdown, which this calls itself, and
    multiprocessing's cleanup of daemon children) do not. Only ``destroy_process_group()`` called by
    ``torchtitan/train.py``'s ``main`` counts (after it that function only logs and returns);
    any other caller, one that raised, or an uncaught exception later leaves the normal exit
    path, and its status, untouched.
    """
    import torch.distributed as dist

    original = dist.destroy_process_group
    if getattr(original, "__tapesac__", False):
        return

    def destroy_process_group(group=None):
        caller = sys._getframe(1).f_code
        original(group)
        if group is None and caller.co_name == "main" and _is_torchtitan_train(caller.co_filename):
            _teardown["clean"] = True

    destroy_process_group.__tapesac__ = True  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = destroy_process_group

    previous_hook = sys.excepthook

    def excepthook(*args):
        _teardown["failed"] = True
        previous_hook(*args)

    sys.excepthook = excepthook
    atexit.register(_finish)


def _is_torchtitan_train(filename: str) -> bool:
    path = os.path.normpath(filename)
    return os.path.basename(path) == "train.py" and os.path.basename(os.path.dirname(path)) == "torchtitan"


def _finish() -> None:
    if not _teardown["clean"] or _teardown["failed"]:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
