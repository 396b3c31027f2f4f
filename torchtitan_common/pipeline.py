"""Pipeline parallelism, the same for both front doors: which schedules TapeSAC runs under, and
wrapping a rank's stages once torchtitan has split the model.

torchtitan (0.2.x and 0.3.x alike) splits the meta model into stages after the point where a
model's blocks are normally wrapped: each stage a deep copy of the whole model with the other
stages' modules removed, then parallelised (TP, FSDP2) stage by stage. TapeSAC wraps in between:
right after torchtitan's split function returns, still on the meta parts, all blocks of this
rank's stages under one handle. Stages hold different blocks, so each stage plans on its own
(``torchtitan_common.run.PipelineStage``).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any, Callable

from torch import nn

from tapesac.errors import ConfigError
from torchtitan_common.patches import until_first_call
from torchtitan_common.run import PipelineStage

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
"""Pipeline schedules TapeSAC runs under: each micro-batch's backward is one autograd pass."""


def check_schedule(parallelism: Any, fix: str) -> None:
    """Refuse a schedule outside :data:`SCHEDULES` (ConfigError naming the setting; ``fix`` says
    how the user turns TapeSAC off instead, in the front door's words)."""
    schedule = parallelism.pipeline_parallel_schedule
    csv = getattr(parallelism, "pipeline_parallel_schedule_csv", None)
    if csv or schedule.lower() not in {s.lower() for s in SCHEDULES}:
        what = f"pipeline_parallel_schedule_csv = {csv!r}" if csv else f"pipeline_parallel_schedule = {schedule!r}"
        raise ConfigError(
            f"TapeSAC supports the pipeline schedules {', '.join(SCHEDULES)}; parallelism.{what} "
            "is not one of them (zero-bubble schedules split backward into input and weight passes, "
            f"which TapeSAC does not replay): set parallelism.pipeline_parallel_schedule to one of those, {fix}"
        )


def check_split(split: Any, ours: tuple[Any, ...], model_name: str, fix: str) -> None:
    """Refuse a model whose ``pipelining_fn`` is not one of ``ours`` (torchtitan's functions that
    split with the patched split function): its stages would never be wrapped."""
    if split is not None and not any(split is fn for fn in ours):
        raise ConfigError(
            f"model {model_name} splits its pipeline stages with its own "
            f"{getattr(split, '__qualname__', split)}, and TapeSAC wraps the stages that torchtitan's "
            f"{' and '.join(fn.__name__ for fn in ours)} make: set parallelism.pipeline_parallel_degree = 1, {fix}"
        )


def wrap_after_split(module: ModuleType, name: str, owner: Any,
                     wrap: Callable[[Any, list[nn.Module], PipelineStage], None]) -> None:
    """At the next call of ``module.name`` (torchtitan's split function, returning ``(stages,
    parts)``), call ``wrap(owner, parts, stage)`` with this rank's stages as it returns them.

    The patch takes itself out at that call (one split per trainer:
    ``torchtitan_common.patches``) and holds ``owner`` weakly; an owner gone by then wraps nothing.
    """
    ref = weakref.ref(owner)

    def patch(original: Any) -> Any:
        def split(*args: Any, **kwargs: Any):
            stages, parts = original(*args, **kwargs)
            target = ref()
            if target is not None:
                wrap(target, parts, PipelineStage.of([s.stage_index for s in stages]))
            return stages, parts

        return split

    until_first_call([module], name, patch)
