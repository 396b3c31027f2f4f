"""Planned mode's settings and their checks (shared with the torchtitan ``[tapesac]`` section)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import distributed as tdist
from ..errors import ConfigError, TapeSACError


DATA_DEPENDENT_SIZES = ("bound", "profiled")
ON_INFEASIBLE = ("error", "replay_only")


@dataclasses.dataclass
class PlanConfig:
    """How planned mode profiles, plans and checks."""

    memory_limit_bytes: int
    """Limit on the step peak, in bytes."""
    safety_margin: float = 0.005
    """Fraction of the limit held back for what a profiled step cannot show: allocations outside
    the measured window, and sizes that change with the data (tokens per expert in MoE). Never
    reserved below the smallest achievable peak."""
    data_dependent_sizes: str = "bound"
    """Where a block's sizes depend on the data (MoE routing, a boolean mask): ``"bound"`` plans
    for the largest sizes any step can have (``tapesac.bounds``), so that a step routed more
    heavily than the profiled one stays under the limit; ``"profiled"`` plans for the profiled
    step's sizes (more kept, less recompute; only ``safety_margin`` covers heavier routing)."""
    warmup_steps: int = 1
    """Replay-only optimizer steps before the first profile (the first one allocates optimizer
    state once)."""
    profile_steps: int = 1
    """Accepted for compatibility and must be 1 or more; one step is profiled per step shape
    (its ops timed ``repeats`` times each)."""
    repeats: int = 3
    """Runs per op when timing (median)."""
    timing_reduction: str = "max"
    """How per-op times are combined across ranks: max, mean or median."""
    solver_time_limit_s: float = 0.5
    """Time limit of the allocation MILP that polishes the greedy plan (0: greedy only). At
    Qwen3.5-397B-A17B's 60-block pattern (``tools/paper_shape.py``) the MILP reached the optimum
    within 0.4 s at every limit tried, where 0.15 s left the greedy plan up to 1.6% slower."""
    points_per_block: int = 12
    """Points of each kind's frontier the allocation chooses from."""
    frontier_points: int = 24
    """Points of the step frontier written for people (0: none)."""
    verify: bool = True
    """Measure the first step under each plan and re-plan tighter if it exceeds the limit."""
    compiled_raise_into_slack: bool = False
    """Compiled mode: a measured step well under the limit re-plans for the limit raised by that
    slack (compiled code peaks below the eager memory model), bisecting between the highest
    planned limit measured within and the lowest measured over, at most ``max_replans`` raises.
    A limit under the eager model's smallest peak is tried replay-only compiled instead of
    refused, and kept if its measured step is within it (else ``on_infeasible``). Off by
    default: each raised plan's steps, and such a try's, may exceed the limit once (its first,
    compiling step is not measured on CPU; its measured step may overshoot) before the run goes
    back to the last plan measured within it."""
    max_replans: int = 3
    """Re-plans per step key after measured overshoots, before falling back to replay-only."""
    on_infeasible: str = "error"
    """What a step key does when replay-only (nothing kept: the smallest peak there is) is
    measured over the limit, so that no plan can keep it (memory the profiled step did not
    show: a buffer of the loop's own, a kernel's working memory, compiled code's buffers):
    ``"error"`` ends planned mode with a :class:`~tapesac.errors.PlanError` that names the
    measured peak, as the first plan does for a limit it predicts infeasible; ``"replay_only"``
    goes on replay-only, over the limit, with a warning."""
    max_plans: int = 8
    """Step keys (input shapes) planned at most; steps of further keys run replay-only."""
    max_profile_failures: int = 2
    """Failed profiles of one step key before it runs replay-only for good (with a warning)."""
    policy_path: str | None = None
    """Load the policy from here when it matches (skips profiling); save it here after planning."""
    frontier_path: str | None = None
    """Write the step frontier here as JSON (and as PNG next to it when matplotlib is present)."""
    graph_dir: str | None = None
    """Write each kind of block's measured graph here (``tools/frontier.py --graph`` reads them)."""
    device: torch.device | None = None
    """Device whose memory is measured (default: that of the first block's parameters)."""
    track: Any = None
    """CPU only: what besides the blocks and the stepping optimizers counts toward the peak
    (modules, tensors, optimizers, or a callable returning them). On CUDA the allocator's own
    statistics count everything."""
    process_group: Any = None
    fatal: Callable[[TapeSACError], Any] | None = None
    """Called with an error that ends planned mode (an infeasible limit, ranks that disagree)
    before it is raised; torchtitan prints it once and ends the job there."""
    policy_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Facts stored in the saved policy and checked when loading it (world size, model): a
    policy made under other facts is ignored with a warning, and the run re-plans."""

    def __post_init__(self) -> None:
        limit = self.memory_limit_bytes
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
            raise ConfigError(f"memory_limit_bytes must be a positive number of bytes, got {limit!r}")
        self.memory_limit_bytes = int(limit)
        check_settings(self)


def check_settings(settings: Any, names: dict[str, str] | None = None) -> None:
    """Validate the fields planned mode shares with its front ends (the torchtitan ``[tapesac]``
    section calls this too, with its own field names in ``names``); raise ConfigError."""
    names = names or {}

    def get(field: str) -> Any:
        return getattr(settings, names.get(field, field).rsplit(".", 1)[-1])

    def fail(field: str, rule: str) -> None:
        raise ConfigError(f"{names.get(field, field)} must be {rule}, got {get(field)!r}")

    def integer(field: str, low: int) -> None:
        v = get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < low:
            fail(field, f"an integer >= {low}")

    margin = get("safety_margin")
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        fail("safety_margin", "in [0, 1)")
    integer("warmup_steps", 0)
    integer("profile_steps", 1)
    integer("repeats", 1)
    for field, low in (("max_replans", 0), ("max_plans", 1), ("max_profile_failures", 1),
                       ("points_per_block", 2), ("frontier_points", 0)):
        if names.get(field, field).rsplit(".", 1)[-1] in getattr(settings, "__dataclass_fields__", {}):
            integer(field, low)
    solver = get("solver_time_limit_s")
    if not isinstance(solver, (int, float)) or not solver >= 0:
        fail("solver_time_limit_s", ">= 0")
    if names.get("data_dependent_sizes", "data_dependent_sizes").rsplit(".", 1)[-1] in getattr(
            settings, "__dataclass_fields__", {}) and get("data_dependent_sizes") not in DATA_DEPENDENT_SIZES:
        fail("data_dependent_sizes", "one of " + ", ".join(DATA_DEPENDENT_SIZES))
    if names.get("on_infeasible", "on_infeasible").rsplit(".", 1)[-1] in getattr(
            settings, "__dataclass_fields__", {}) and get("on_infeasible") not in ON_INFEASIBLE:
        fail("on_infeasible", "one of " + ", ".join(ON_INFEASIBLE))
    if get("timing_reduction") not in tdist.REDUCTIONS:
        fail("timing_reduction", "one of " + ", ".join(sorted(tdist.REDUCTIONS)))

