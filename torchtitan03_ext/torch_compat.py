"""What torchtitan 0.3.0 calls that torch 2.13 does not have (it was written against a nightly).

Found by running torchtitan 0.3.0 on torch 2.13.0 (CPU, two gloo ranks):

1. ``torch.distributed.set_timeout(timeout, group)``, called once after the first step
   (``torchtitan.distributed.utils.set_pg_timeouts``): torch 2.13 has the same operation as the
   private ``torch.distributed.distributed_c10d._set_pg_timeout``. :func:`install` adds the
   public name, pointing at it, when torch lacks it.
2. FSDP2 that turns ``spmd_types`` annotations into DTensor parameters: with torchtitan's default
   ``parallelism.spmd_backend = "spmd_types"`` and more than one data-parallel rank, torch 2.13's
   ``fully_shard`` raises "When dp_mesh_dims is provided, all parameters must be DTensors on the
   full SPMD mesh" (torch 2.14.0's reads the annotations). Not patchable here: TapeSAC's configs
   use ``spmd_backend = "partial_dtensor"`` (DTensor only for model-parallel axes, as torchtitan
   0.2.x did; ``full_dtensor`` runs too), and a TapeSAC job with ``spmd_types`` is refused
   before training (``trainer.check_neighbours``).

3. Pipeline schedules that take a step's micro-batches as made: torchtitan 0.3's trainer builds
   them itself and calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=...,
   loss_kwargs=...)`` (``Trainer.pp_forward_backward_step``). torch 2.13's ``step`` takes the whole
   batch and splits it, so those keywords become model inputs and every pipelined step fails
   ("Expecting 4 arg_mbs but got 1"). :func:`install` gives ``PipelineScheduleSingle.step`` and
   ``PipelineScheduleMulti.step`` the micro-batch keywords when they lack them: given those, it
   does what torch 2.13's ``step`` does after its split (the same checks, the same per-step
   reset of each stage, ``_step_microbatches``, the last stage's merged outputs); without them
   it is torch's ``step``.

4. A pipeline stage's first step that leaves the model as it found it. torch 2.13's
   ``PipelineStage`` infers its inputs' and outputs' shapes by running the stage's forward once
   (``_forward_metadata_inference``) on the first micro-batch (first stage) or on uninitialized
   tensors of the received shapes (other stages). That forward is not a training forward, but it
   writes what a training forward writes: an MoE block adds its routed-token counts to
   ``tokens_per_expert_E``, from which the optimizer updates the expert bias. Counts routed from
   uninitialized memory then steer every later step, and the job without checkpointing gives
   other losses from run to run (measured on the 2-rank Qwen3.5 and qwen3 MoE debug jobs with
   PP 2: counts of tokens that do not exist, losses apart from step 2). :func:`install` makes
   that forward restore every buffer it changed, bit for bit.

torch 2.14.0 has 1 and 2 (checked in its wheel); TapeSAC is tested on 2.13 only. Still missing in
2.14.0: FlexAttention's backward on CPU (see ``cpu_shim``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist


def install() -> None:
    """Add what torchtitan 0.3.0 needs and this torch lacks. Safe to call more than once."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
    _pipeline_steps_take_microbatches()
    _shape_inference_keeps_buffers()


def _pipeline_steps_take_microbatches() -> None:
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" not in inspect.signature(cls.step).parameters and not getattr(cls.step, "__tapesac__", False):
            cls.step = _step_taking_microbatches(cls.step)


def _step_taking_microbatches(step: Callable) -> Callable:
    @functools.wraps(step)
    def step_with_microbatches(self, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                               target_mbs: list | None = None, **kwargs: Any) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, **kwargs)
        losses = kwargs.pop("losses", None)
        return_outputs = kwargs.pop("return_outputs", True)
        loss_kwargs = kwargs.pop("loss_kwargs", None)
        if args or kwargs:
            raise TypeError("step() takes a whole batch (args, kwargs, target) or its micro-batches "
                            "(arg_mbs, kwarg_mbs, target_mbs), not both")
        if (self._has_backward and getattr(self, "_backward_requires_autograd", True)
                and not torch.is_grad_enabled()):
            raise RuntimeError("step() requires gradients to be enabled for backward computation; "
                               "it should not be used under torch.no_grad() context. Please call eval() instead.")
        stages = self._stages if hasattr(self, "_stages") else [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    step_with_microbatches.__tapesac__ = True  # type: ignore[attr-defined]
    return step_with_microbatches


def _shape_inference_keeps_buffers() -> None:
    from torch.distributed.pipelining import stage

    infer = getattr(stage.PipelineStage, "_forward_metadata_inference", None)
    if infer is None or getattr(infer, "__tapesac__", False):
        return

    @functools.wraps(infer)
    def forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        saved = [(local, local.clone()) for local in map(_local, self.submod.buffers())]
        try:
            return infer(self, *args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, before in saved:
                    if not torch.equal(buffer, before):  # untouched buffers keep their version
                        buffer.copy_(before)

    forward_metadata_inference.__tapesac__ = True  # type: ignore[attr-defined]
    stage.PipelineStage._forward_metadata_inference = forward_metadata_inference


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (where its bytes are), else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
