"""Planned mode: profile real steps, plan under a memory limit, apply the plan, check it.

A *step* is one optimizer step (``step``): everything between two step boundaries belongs to
it: any number of micro-batches, forwards first or interleaved, blocks applied twice, a retained
graph's second backward (see ``tapesac.stepmodel``). The files read like the phases:

- ``config``: :class:`PlanConfig` and :func:`check_settings`, shared with the torchtitan section;
- ``step``: step boundaries (the optimizer hook, ``handle.step()``), the phases, the step key;
- ``ranks``: the one all-reduce at a step's end and what it carries (:class:`_Agreed`);
- ``plans``: profile -> plan -> adopt, and the check of the first measured step under a plan;
- ``compiled_steps``: compiled mode's measuring and raising into measured slack;
- ``policy_files``: loading and checking a saved policy;
- ``driver``: :class:`AutoPlanner`, the state machine over steps that ties them together.
"""

from .compiled_steps import RAISE_HEADROOM, RAISE_MARGIN, CompiledSteps
from .config import PlanConfig, check_settings
from .driver import AutoPlanner
from .plans import PlanMaker
from .ranks import _Agreed  # noqa: F401 - private names tools and tests import from here
from .step import _Recording, _StepState, _tensors_of  # noqa: F401
from .step import Phase, StepPlan, TracePurpose, input_key, step_key

__all__ = [
    "AutoPlanner",
    "CompiledSteps",
    "Phase",
    "PlanConfig",
    "PlanMaker",
    "RAISE_HEADROOM",
    "RAISE_MARGIN",
    "StepPlan",
    "TracePurpose",
    "check_settings",
    "input_key",
    "step_key",
]
