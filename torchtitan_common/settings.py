"""TapeSAC's torchtitan settings: one definition of the fields, their defaults and their checks.

torchtitan 0.2.x shows them as the ``[tapesac]`` TOML section (``torchtitan_ext.config``),
torchtitan 0.3.x as the fields of the ``tapesac`` activation-checkpointing choice
(``torchtitan03_ext.TapeSAC.Config``). Both subclass :class:`TapeSACSettings` and only name
where the fields live (``prefix``, used in error messages). The fields shared with the eager API
take :class:`tapesac.autoplan.PlanConfig`'s defaults and checks.
"""

# No "from __future__ import annotations": both torchtitan config parsers need real types here.
from dataclasses import dataclass
from typing import ClassVar, Literal

from tapesac.autoplan import PlanConfig, check_settings
from tapesac.errors import ConfigError

_PLAN = PlanConfig


@dataclass(kw_only=True)
class TapeSACSettings:
    prefix: ClassVar[str] = "tapesac"
    """Where the fields live in the job's config, for error messages (``tapesac.budget``)."""

    mode: Literal["plan", "replay_only"] = "plan"
    """'plan': profile the first steps, then keep what pays most under the memory limit.
    'replay_only': keep nothing a block produces (the memory of full activation checkpointing)
    and recompute only what backward reads."""

    budget: float = 0.9
    """Fraction of device memory the step peak may use, in (0, 1]."""

    limit_gib: float = 0.0
    """Absolute step-peak limit in GiB; when > 0 it overrides ``budget``."""

    safety_margin: float = _PLAN.safety_margin
    """Fraction of the limit the plan leaves unused, for memory a profiled step cannot show
    (allocations outside the blocks' window, data-dependent sizes such as MoE routing)."""

    data_dependent_sizes: Literal["bound", "profiled"] = _PLAN.data_dependent_sizes
    """Where sizes depend on the data (MoE routing under expert parallelism): 'bound' plans for
    the largest sizes any step can have, so that heavier routing stays under the limit;
    'profiled' plans for the profiled step's (less recompute; only ``safety_margin`` covers
    heavier routing)."""

    cpu_capacity_gib: float = 0.0
    """Device capacity assumed on CPU, where no allocator reports one, in GiB. 0: physical memory
    divided by the ranks on this node."""

    warmup_steps: int = _PLAN.warmup_steps
    """Replay-only optimizer steps before the first profile (the first one allocates optimizer
    state once)."""

    profile_steps: int = _PLAN.profile_steps
    """Accepted for compatibility (>= 1): one step is profiled per step shape, every op timed
    ``profile_repeats`` times and memory traced."""

    profile_repeats: int = _PLAN.repeats
    """Runs per op when timing it (median)."""

    timing_reduction: Literal["max", "mean", "median"] = _PLAN.timing_reduction
    """How per-op times are combined across ranks before rank 0 plans."""

    solver_time_limit_s: float = _PLAN.solver_time_limit_s
    """Time limit of the allocation MILP, in seconds (a greedy plan is always available)."""

    policy_file: str = ""
    """Policy to load when it matches this job (skipping profiling) and to save after planning.
    Empty: ``<dump folder>/tapesac/policy.json``; "none": never load or save."""

    frontier_file: str = ""
    """Where to write the step frontier (JSON, plus a PNG next to it). Empty:
    ``<dump folder>/tapesac/frontier.json``; "none": do not write it."""

    verify: bool = _PLAN.verify
    """Measure the first step under each plan; if its peak exceeds the limit, re-plan tighter."""

    compiled_raise_into_slack: bool = _PLAN.compiled_raise_into_slack
    """Compiled mode (``compile.enable``): re-plan into the slack a measured compiled step leaves
    under the limit, and try a limit under the eager model's smallest peak replay-only compiled
    (kept if measured within) instead of refusing it. Off by default: a raised plan or such a try
    may exceed the limit once before the run goes back or stops."""

    on_infeasible: Literal["error", "replay_only"] = _PLAN.on_infeasible
    """When a step that keeps nothing (replay-only, the smallest peak there is) is measured over
    the limit: 'error' ends the job with the measured peak; 'replay_only' trains on, over the
    limit, with a warning."""

    debug: bool = False
    """Compare every recomputed value with the forward's and fail on any difference (slow)."""

    verify_every: int = 0
    """Also make every this-many-th forward of each block a verification forward (its saved
    tensors fingerprinted, every value replay rebuilds checked: catches a kernel that writes
    memory the dispatcher cannot see). 0: only each program's first forward and the profiled and
    measured steps."""

    def check(self) -> None:
        """Raise ConfigError naming the first bad field (``<prefix>.<field>``); subclasses call
        this from ``__post_init__``, so a bad value fails when the config is parsed."""
        p = self.prefix
        if self.mode not in ("plan", "replay_only"):
            raise ConfigError(f"{p}.mode must be 'plan' or 'replay_only', got {self.mode!r}")
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            raise ConfigError(f"{p}.budget must be in (0, 1] (a fraction of device memory), got {budget!r}")
        for name in ("limit_gib", "cpu_capacity_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"{p}.{name} must be >= 0 and finite, got {value!r}")
        if isinstance(self.verify_every, bool) or not isinstance(self.verify_every, int) or self.verify_every < 0:
            raise ConfigError(f"{p}.verify_every must be an int >= 0, got {self.verify_every!r}")
        check_settings(self, {f: f"{p}.{f}" for f in SHARED_WITH_PLAN_CONFIG} | {"repeats": f"{p}.profile_repeats"})


SHARED_WITH_PLAN_CONFIG = ("safety_margin", "warmup_steps", "profile_steps", "solver_time_limit_s",
                           "timing_reduction", "data_dependent_sizes", "on_infeasible")
"""Fields with the same name here and in PlanConfig (``profile_repeats`` is PlanConfig's
``repeats``; ``verify`` is checked by type only)."""
