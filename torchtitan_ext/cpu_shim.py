"""What torchtitan 0.2.x needs to train on a machine without an accelerator.

The version-independent part (a CPU device module, gloo-friendly FSDP2 reductions, an ATen CPU
gap, a clean exit after gloo's teardown) is ``torchtitan_common.cpu``; this adds torchtitan
0.2.x's MoE experts on CPU and expert parallelism's token permutation in torch
(``torchtitan_ext.permutation``; torchtitan's is a Triton kernel). :func:`install` is applied by
``import torchtitan_ext`` when no CUDA device exists.
"""

from __future__ import annotations

import torch

from torchtitan_common.cpu import CpuDeviceModule, cpu_capacity_bytes, patch_ops
from torchtitan_common.cpu import install as install_common

from . import permutation

__all__ = ["CpuDeviceModule", "cpu_capacity_bytes", "install", "patch_ops"]


def install() -> None:
    """Point torchtitan 0.2.x at the CPU. Safe to call more than once; no-op when CUDA is present."""
    if torch.cuda.is_available():
        return
    install_common()
    _experts_loop_on_cpu()
    permutation.install()


def _experts_loop_on_cpu() -> None:
    """torchtitan's grouped-mm MoE path pads token groups with a Triton kernel; on CPU the
    experts run as a loop of matmuls instead (torchtitan's own ``use_grouped_mm=False`` path)."""
    from torchtitan.models.moe.moe import GroupedExperts

    original = GroupedExperts.forward
    if getattr(original, "__tapesac__", False):
        return

    def forward(self, x, num_tokens_per_expert):
        if self.use_grouped_mm and x.device.type == "cpu":
            self.use_grouped_mm = False
        return original(self, x, num_tokens_per_expert)

    forward.__tapesac__ = True  # type: ignore[attr-defined]
    GroupedExperts.forward = forward
