"""What torchtitan 0.2.2 needs to train on a machine without an accelerator.

Applied automatically by the integration when no CUDA device is present; importable on its
own (tests use :func:`patch_ops` to run torchtitan's MoE on CPU).
"""

from __future__ import annotations

import torch

_patched = False


def patch_ops() -> None:
    """CPU gaps in ATen that torchtitan's models hit.

    ``torch.histc`` has no CPU kernel for integer tensors, and torchtitan's MoE router counts
    tokens per expert with ``histc`` on int64 expert indices. Integer inputs are counted in
    float32 (exact for counts below 2**24) and cast back, as the CUDA kernel returns them.
    """
    global _patched
    if _patched:
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
    _patched = True
