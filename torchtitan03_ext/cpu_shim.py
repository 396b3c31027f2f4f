"""What torchtitan 0.3.x needs to train on a machine without an accelerator.

The version-independent part (a CPU device module for ``torch.cuda``'s calls, gloo-friendly
FSDP2 reductions, an ATen CPU gap, a clean exit after gloo's teardown) is
``torchtitan_common.cpu``. torchtitan 0.3's language models attend with FlexAttention (or
varlen flash attention, CUDA only), and FlexAttention has no backward on CPU in torch 2.13
("FlexAttention does not support backward on CPU"): on CPU, :func:`_flex_attention_on_cpu`
computes the same masked attention with ``scaled_dot_product_attention`` and the dense boolean
mask of the block mask's ``mask_mod``, and block masks for CPU tensors are made eagerly
(:func:`_block_masks_eagerly_on_cpu`). Qwen3.5's flash-linear-attention kernels (Triton, which
needs a driver) run on CPU tensors as stand-ins that are as opaque to the dispatcher
(:mod:`.fla_cpu`). Applied by ``import torchtitan03_ext`` when no CUDA device exists.
"""

from __future__ import annotations

import torch

from torchtitan_common.cpu import install as install_common

from . import fla_cpu


def install() -> None:
    """Point torchtitan 0.3.x at the CPU. Safe to call more than once; no-op when CUDA is present."""
    if torch.cuda.is_available():
        return
    install_common()
    _flex_attention_on_cpu()
    _block_masks_eagerly_on_cpu()
    fla_cpu.install()


def _block_masks_eagerly_on_cpu() -> None:
    """torchtitan makes FlexAttention's block masks with ``torch.compile(create_block_mask)``;
    on CPU that compiles C++ with inductor (a compiler on the machine, about a minute cold) for
    a mask that :func:`_flex_attention_on_cpu` only reads ``mask_mod`` from. CPU masks are made
    by the same ``create_block_mask``, eagerly; others still by the compiled one."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    compiled = attention._compiled_create_block_mask
    if getattr(compiled, "__tapesac__", False):
        return

    def create_block_mask_eagerly_on_cpu(*args, device=None, **kwargs):
        make = create_block_mask if device is not None and torch.device(device).type == "cpu" else compiled
        return make(*args, device=device, **kwargs)

    create_block_mask_eagerly_on_cpu.__tapesac__ = True  # type: ignore[attr-defined]
    attention._compiled_create_block_mask = create_block_mask_eagerly_on_cpu


def _flex_attention_on_cpu() -> None:
    """FlexAttention's compiled kernel, replaced on CPU tensors by SDPA under the dense mask.

    Exact in the sense the tests need: a job with and without TapeSAC runs the same attention.
    Score modifiers and auxiliary outputs (the LSE) have no CPU path here: they are refused
    with a clear error rather than approximated.
    """
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    original = FlexAttention.compiled_flex_attn
    if getattr(original, "__tapesac__", False):
        return

    def compiled_flex_attn(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if q.device.type != "cpu":
            return original(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=enable_gqa, return_aux=return_aux, kernel_options=kernel_options)
        if score_mod is not None or any(return_aux):
            raise NotImplementedError(
                "TapeSAC's CPU FlexAttention covers mask_mod attention only (no score_mod, no "
                "auxiliary outputs): run this model on a GPU")
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, AuxOutput()

    compiled_flex_attn.__tapesac__ = True  # type: ignore[attr-defined]
    FlexAttention.compiled_flex_attn = staticmethod(compiled_flex_attn)
