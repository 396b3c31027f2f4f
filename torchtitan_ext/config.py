"""The ``[tapesac]`` section of a torchtitan job, merged in with ``job.custom_config_module``.

    [job]
    custom_config_module = "torchtitan_ext.config"

    [model]
    converters = ["tapesac"]

    [activation_checkpoint]
    mode = "none"            # TapeSAC replaces activation checkpointing

    [tapesac]
    budget = 0.9

Every field can be overridden on the command line, e.g. ``--tapesac.budget 0.85``.
"""

# No "from __future__ import annotations": torchtitan's config merge needs real types here.
from dataclasses import dataclass, field
from typing import Literal

import torchtitan_ext  # noqa: F401  (registers the converter, the dataset, the CPU shim)


@dataclass
class TapeSAC:
    mode: Literal["plan", "replay_only"] = "plan"
    """'plan': profile the first steps, then keep what pays most under the memory limit.
    'replay_only': keep nothing a block produces (the memory of full activation checkpointing)
    and recompute only what backward reads."""

    budget: float = 0.9
    """Fraction of device memory the step peak may use, in (0, 1]."""

    limit_gib: float = 0.0
    """Absolute step-peak limit in GiB; when > 0 it overrides ``budget``."""

    safety_margin: float = 0.005
    """Fraction of the limit the plan leaves unused, for memory a profiled step cannot show
    (allocations outside the blocks' window, data-dependent sizes such as MoE routing)."""

    cpu_capacity_gib: float = 0.0
    """Device capacity assumed on CPU, where no allocator reports one, in GiB. 0: physical memory
    divided by the ranks on this node."""

    warmup_steps: int = 1
    """Replay-only steps before profiling starts."""

    profile_steps: int = 1
    """Steps in which every op is timed and memory is traced; times are their median."""

    profile_repeats: int = 3
    """Runs per op when timing it (median)."""

    timing_reduction: Literal["max", "mean", "median"] = "max"
    """How per-op times are combined across ranks before rank 0 plans."""

    solver_time_limit_s: float = 0.15
    """Time limit of the allocation MILP, in seconds (a greedy plan is always available)."""

    policy_file: str = ""
    """Policy to load when it matches this job (skipping profiling) and to save after planning.
    Empty: ``<job.dump_folder>/tapesac/policy.json``; "none": never load or save."""

    frontier_file: str = ""
    """Where to write the step frontier (JSON, plus a PNG next to it). Empty:
    ``<job.dump_folder>/tapesac/frontier.json``; "none": do not write it."""

    verify: bool = True
    """Measure the first planned step; if its peak exceeds the limit, re-plan with a margin."""

    debug: bool = False
    """Compare every recomputed value with the forward's and fail on any difference (slow)."""


@dataclass
class JobConfig:
    tapesac: TapeSAC = field(default_factory=TapeSAC)
