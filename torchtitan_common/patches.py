"""Every change TapeSAC makes to torch, torchtitan or the interpreter, and how long it lasts.

The eager engine (``tapesac``) patches only while the call that needs it runs:

* ``torch.UntypedStorage.resize_`` (``tapesac.meter``): while a ``StorageCounter`` is active (the
  first counter entered installs it, the last one left removes it), so that the CPU meter sees
  FSDP2's unshards and reshards, which the dispatcher never sees.
* ``run`` of Triton's kernel classes (``tapesac.kernels``): from ``tapesac.wrap`` to the
  handle's ``remove()``, reference-counted across handles, so that a recorded block sees its
  Triton launches.

A torchtitan job's trainer is built once per process; these last until it is built:

* ``torchtitan.train.build_metrics_processor`` (and ``__main__``'s, under ``python -m
  torchtitan.train``) (``torchtitan_ext.converter``): from the ``tapesac`` converter's creation
  until the trainer's one call (:func:`until_first_call`), which adds TapeSAC's numbers to the
  step's metrics and log line through that processor's ``log`` (``torchtitan_common.run``).
* ``torchtitan.distributed.pipeline_parallel.pipeline_module_split`` (``torchtitan_ext.converter``,
  under pipeline parallelism): from the converter's ``convert`` until the trainer's one split,
  whose stages are then wrapped (``torchtitan_common.pipeline``). On 0.3.x the same for
  ``_pipeline_module_split``, from the start of the trainer's ``__init__`` (``torchtitan03_ext.trainer``).
* The policy applied in torchtitan 0.3's ``parallelize_fn`` waits on the model part it was applied
  to until its trainer takes it, right after (``torchtitan03_ext.activation_checkpoint``):
  torchtitan drops the policy once applied.

These last for the process: they make the job itself run (on a CPU, with this torch), and are
installed when the front door is imported (``torchtitan_ext``, ``torchtitan03_ext``) or the job
asks for what needs them, each once:

* ``sys.excepthook`` (``torchtitan_common.errors.install``): a TapeSAC error ends the job with
  one message instead of a traceback per rank.
* Without CUDA (``torchtitan_common.cpu.install``): ``device_type`` and ``device_module`` of
  every torchtitan module imported so far and of ``torchtitan.tools.utils``; ``torch.histc``
  (integer inputs on CPU); torchtitan's ``_get_gradient_divide_factors`` (sums on gloo);
  ``torch.distributed.destroy_process_group``, ``sys.excepthook`` and an ``atexit`` handler (a
  finished gloo job exits cleanly).
* Without CUDA, torchtitan 0.2.x (``torchtitan_ext.cpu_shim``): ``GroupedExperts.forward`` (the
  experts' loop of matmuls), and the MoE token permutation below.
* torchtitan 0.2.x's ``generate_permute_indices`` (``torchtitan_ext.permutation``): on CPU, and
  under expert parallelism from the converter's creation; its Triton kernel writes what the
  recorder cannot see.
* Without CUDA, torchtitan 0.3.x (``torchtitan03_ext.cpu_shim``): FlexAttention's compiled
  attention (by SDPA and a dense mask: no FlexAttention backward on CPU) and its block masks
  (made eagerly); for CPU tensors, flash-linear-attention's ``causal_conv1d`` (in
  ``fla.modules.conv.causal_conv1d``) and the ``chunk_gated_delta_rule`` torchtitan's qwen3_5
  model calls (``torchtitan03_ext.fla_cpu``: stand-ins whose forwards write unseen, as the
  Triton kernels do).
* torchtitan 0.3.x with torch 2.13 (``torchtitan03_ext.torch_compat``):
  ``torch.distributed.set_timeout``, and the ``step`` of ``PipelineScheduleSingle`` and
  ``PipelineScheduleMulti`` (torchtitan hands them a step's micro-batches as made).
* Compiled mode: ``torch._dynamo.config.capture_scalar_outputs`` (both front doors) and
  ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (0.3.x), as torchtitan's ``apply_compile``
  sets them; torchtitan 0.3's ``_maybe_check_max_pos`` in every torchtitan module that holds it
  (``torchtitan03_ext.activation_checkpoint``), so that eager forwards record what compiles.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Iterable


def until_first_call(modules: Iterable[ModuleType], name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the function ``name`` of each of ``modules`` with ``wrap(original)`` until the
    first call of any of them, which puts every original back before it runs. A replacement
    still waiting for its call is replaced (the newest caller is the one that needs it)."""
    originals: dict[ModuleType, Callable] = {}

    def restore() -> None:
        for module, original in originals.items():
            setattr(module, name, original)
        originals.clear()

    for module in modules:
        original = getattr(module, name, None)
        if original is None:
            continue
        while getattr(original, "__tapesac__", False):
            original = original.__wrapped__
        wrapped = wrap(original)

        def once(*args: Any, _wrapped: Callable = wrapped, **kwargs: Any) -> Any:
            restore()
            return _wrapped(*args, **kwargs)

        once.__tapesac__ = True  # type: ignore[attr-defined]
        once.__wrapped__ = original  # type: ignore[attr-defined]
        once.__name__ = getattr(original, "__name__", name)
        once.__doc__ = original.__doc__
        originals[module] = original
        setattr(module, name, once)
