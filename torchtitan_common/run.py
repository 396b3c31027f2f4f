"""TapeSAC in one torchtitan job, whatever the front door: wrap the blocks under the job's
settings, and report (torchtitan's metrics, one line under each step's log line).

Both front doors wrap the blocks on the meta model before ``fully_shard``: wrapping replaces a
block's ``forward`` by an instance attribute and touches no parameter, so it survives FSDP2
(which swaps the class and the parameters, not the instance dict). At run time the wrapped
forward runs nested inside FSDP2's pre/post-forward hooks, with the parameters unsharded, and
replay happens inside each block's own backward after FSDP2 has gathered the parameters again;
no module hook runs twice. Rank 0 plans and broadcasts (``tapesac.distributed``).

Under pipeline parallelism a rank wraps the blocks of its own stages (:class:`PipelineStage`):
the ranks that hold the same stages plan together (planned mode's collectives run in their
group), each stage writes its own policy and frontier files, and a stage's error is printed by
that stage's first rank, naming the stage.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tapesac
from tapesac.autoplan import PlanConfig
from tapesac.report import fmt_bytes

from . import cpu
from tapesac.errors import TapeSACError

from .errors import exit_with
from .settings import TapeSACSettings

try:
    from torchtitan.tools.logging import logger
except ImportError:  # pragma: no cover
    import logging

    logger = logging.getLogger("tapesac")


def device() -> torch.device:
    """This rank's device: its current GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def memory_limit_bytes(cfg: TapeSACSettings, device: torch.device) -> tuple[int, int]:
    """(limit, capacity): ``limit_gib`` if set, else ``budget`` times the device capacity."""
    if device.type == "cuda":
        capacity = torch.cuda.mem_get_info(device)[1]
    elif cfg.cpu_capacity_gib > 0:
        capacity = int(cfg.cpu_capacity_gib * 2**30)
    else:
        capacity = cpu.cpu_capacity_bytes()
    limit = int(cfg.limit_gib * 2**30) if cfg.limit_gib > 0 else int(cfg.budget * capacity)
    return limit, capacity


def limit_source(cfg: TapeSACSettings, device: torch.device, capacity: int) -> str:
    """Where the limit came from, in words."""
    p = cfg.prefix
    if cfg.limit_gib > 0:
        return f"{p}.limit_gib = {cfg.limit_gib}"
    if device.type == "cuda":
        return f"{p}.budget {cfg.budget} of the GPU's {fmt_bytes(capacity)}"
    if cfg.cpu_capacity_gib > 0:
        what = f"{p}.cpu_capacity_gib = {cfg.cpu_capacity_gib}"
    else:
        what = "this node's memory divided by its ranks"
    return (f"{p}.budget {cfg.budget} of {fmt_bytes(capacity)}: on CPU there is no device memory, "
            f"so the 'device' is {what}, and the peak counted is the bytes of live tensor storages")


def info(message: str, speaker: int = 0) -> None:
    """Rank ``speaker`` (0) speaks for all ranks (they make the same decisions)."""
    if int(os.environ.get("RANK", "0")) == speaker:
        logger.info(message)


def _artifact(path: str, dump_folder: str, default: str) -> str | None:
    if path.lower() == "none":
        return None
    return path or str(Path(dump_folder) / "tapesac" / default)


@dataclass
class PipelineStage:
    """The pipeline stages this rank holds, and the ranks that hold the same ones."""

    name: str
    """The stage indices, joined by ``+`` (``"0"``; ``"0+2"`` under looped schedules)."""
    group: Any
    """The process group of the ranks holding these stages: they plan together."""
    first_rank: int
    """The global rank that speaks for them."""

    @classmethod
    def of(cls, indices: Sequence[int]) -> PipelineStage:
        """This rank's stages: one all-gather on the default group, then one group per distinct
        set of stages (every rank creates every group, in the same order)."""
        import torch.distributed as dist

        mine = tuple(indices)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        holders: dict[tuple, list[int]] = {}
        for rank, held in enumerate(everyone):
            holders.setdefault(held, []).append(rank)
        group, _all = dist.new_subgroups_by_enumeration(list(holders.values()))
        return cls("+".join(map(str, mine)), group, holders[mine][0])

    def file(self, path: str | None) -> str | None:
        """``policy.json`` -> ``policy.pp0.json``: each stage's plan in its own file."""
        if path is None:
            return None
        p = Path(path)
        return str(p.with_name(f"{p.stem}.pp{self.name}{p.suffix}"))

    def exit_with(self, error: TapeSACError) -> None:
        """End this rank on an error of this stage's planning, printed by the stage's first rank."""
        exit_with(type(error)(f"pipeline stage {self.name}: {error}"), speaker=self.first_rank)


class TapeSACRun:
    """The blocks of one model under one job's settings: :meth:`wrap` them, then read
    :meth:`metrics` and :meth:`summary` as the job trains."""

    def __init__(self, cfg: TapeSACSettings) -> None:
        self.cfg = cfg
        self.handle: tapesac.TapeSACHandle | None = None
        self.limit_bytes: int | None = None

    def wrap(self, blocks: Sequence[nn.Module], *, model: nn.Module | Sequence[nn.Module], dump_folder: str,
             model_name: str, stage: PipelineStage | None = None,
             compile_options: dict[str, Any] | None = None) -> None:
        """Wrap ``blocks`` (on the meta model, before FSDP2) in the settings' mode; ``model`` is
        what holds them (a model, or a rank's pipeline stages, given as ``stage``).
        ``compile_options`` (torch.compile's arguments) turns on compiled mode: planned blocks
        run compiled under their plan (``tapesac.compiled``)."""
        cfg = self.cfg
        dev = device()
        where = f" of pipeline stage {stage.name}" if stage is not None else ""
        speaker = stage.first_rank if stage is not None else 0
        if not blocks:
            info(f"TapeSAC: no transformer block{where}: nothing to wrap", speaker)
            return
        if cfg.mode == "replay_only":
            self.handle = tapesac.wrap(blocks, debug=cfg.debug, verify_every=cfg.verify_every)
            info(f"TapeSAC: replay-only on {len(blocks)} blocks{where}: nothing a block makes is kept, "
                 "backward recomputes only what it reads", speaker)
            return
        limit, capacity = memory_limit_bytes(cfg, dev)
        self.limit_bytes = limit
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        meta = {"world_size": world, "model": model_name}
        if stage is not None:
            meta["pipeline_stage"] = stage.name
        in_file = stage.file if stage is not None else (lambda path: path)
        track = list(model) if isinstance(model, Sequence) else [model]
        plan = PlanConfig(
            memory_limit_bytes=limit, safety_margin=float(cfg.safety_margin),
            data_dependent_sizes=cfg.data_dependent_sizes,
            warmup_steps=int(cfg.warmup_steps), profile_steps=int(cfg.profile_steps),
            repeats=int(cfg.profile_repeats), timing_reduction=cfg.timing_reduction,
            solver_time_limit_s=float(cfg.solver_time_limit_s), verify=bool(cfg.verify),
            compiled_raise_into_slack=bool(cfg.compiled_raise_into_slack), on_infeasible=cfg.on_infeasible,
            policy_path=in_file(_artifact(cfg.policy_file, dump_folder, "policy.json")),
            frontier_path=in_file(_artifact(cfg.frontier_file, dump_folder, "frontier.json")),
            device=dev, track=lambda: track,
            fatal=stage.exit_with if stage is not None else exit_with,
            process_group=stage.group if stage is not None else None,
            policy_meta=meta,
        )
        compiled = compile_options is not None
        self.handle = tapesac.wrap(blocks, plan_config=plan, debug=cfg.debug, verify_every=cfg.verify_every,
                                   compile=compiled, compile_options=compile_options)
        info(f"TapeSAC: planned mode on {len(blocks)} blocks{where}, step-peak limit {fmt_bytes(limit)} "
             f"per rank ({limit_source(cfg, dev, capacity)}); {cfg.warmup_steps} warm-up step(s) "
             "replay-only, then one profiled step, then the plan"
             + (f", run compiled ({compile_options})" if compiled else ""), speaker)

    def metrics(self) -> dict[str, float]:
        """TapeSAC numbers for torchtitan's metrics (TensorBoard, W&B), this rank's."""
        out: dict[str, float] = {}
        if self.limit_bytes:
            out["tapesac/limit_gib"] = self.limit_bytes / 2**30
        if self.handle is None:
            return out
        stats = self.handle.stats().values()
        out["tapesac/kept_gib"] = sum(s["kept_bytes"] for s in stats) / 2**30
        out["tapesac/replayed_ops"] = float(sum(s["ops_replayed"] for s in stats))
        planner = self.handle.planner
        policy = planner.current_policy() if planner is not None else None
        if policy is not None and policy.predicted_peak_bytes is not None:
            out["tapesac/predicted_peak_gib"] = policy.predicted_peak_bytes / 2**30
            out["tapesac/recompute_ms"] = (policy.predicted_recompute_s or 0.0) * 1e3
        if planner is not None and planner.history:
            out["tapesac/measured_peak_gib"] = planner.history[-1]["measured_peak_bytes"] / 2**30
        return out

    def summary(self) -> str:
        """One line for the console, under torchtitan's step line."""
        m = self.metrics()
        parts = [f"limit {m['tapesac/limit_gib'] * 1024:.1f} MiB"] if "tapesac/limit_gib" in m else []
        if "tapesac/predicted_peak_gib" in m:
            parts.append(f"predicted peak {m['tapesac/predicted_peak_gib'] * 1024:.1f} MiB")
        if "tapesac/measured_peak_gib" in m:
            step = self.handle.planner.history[-1]["step"]
            parts.append(f"measured {m['tapesac/measured_peak_gib'] * 1024:.1f} MiB (step {step})")
        parts.append(f"kept {m.get('tapesac/kept_gib', 0) * 1024:.1f} MiB")
        if "tapesac/recompute_ms" in m:
            parts.append(f"recompute {m['tapesac/recompute_ms']:.1f} ms (predicted)")
        parts.append(f"replayed {int(m.get('tapesac/replayed_ops', 0))} ops")
        planner = self.handle.planner if self.handle is not None else None
        mode = planner.last_step_mode if planner is not None else "replay-only"
        return f"TapeSAC [{mode}]: " + ", ".join(parts)


def report_with_step_log(processor: Any, current: Callable[[], TapeSACRun | None]) -> None:
    """Make ``processor.log`` (torchtitan's ``MetricsProcessor.log``, called once per step) add
    the current run's metrics and, on rank 0, log its summary under the step's line."""
    log = processor.log

    def log_with_tapesac(step, *args, extra_metrics=None, **kwargs):
        run = current()
        extra = dict(extra_metrics or {})
        if run is not None:
            extra.update(run.metrics())
        out = log(step, *args, extra_metrics=extra, **kwargs)
        if run is not None:
            info(run.summary())
        return out

    processor.log = log_with_tapesac


class Registry:
    """Objects made in this process, newest last, held weakly (a finished trainer is freed)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def add(self, obj: Any) -> None:
        self._refs.append(weakref.ref(obj))

    def newest(self) -> Any:
        for ref in reversed(self._refs):
            obj = ref()
            if obj is not None:
                return obj
        return None
