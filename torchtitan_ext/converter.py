"""The ``tapesac`` model converter: TapeSAC on every transformer block, under FSDP2, TP, EP, PP.

torchtitan runs converters on the meta model, before parallelisation. The converter checks the
job there (clear errors before any work) and wraps each block of ``model.layers``: wrapping
replaces the block's ``forward`` by an instance attribute and touches no parameter, so it
survives ``fully_shard`` (which swaps the class and the parameters, not the instance dict). At
run time the wrapped forward therefore runs nested inside FSDP2's pre/post-forward hooks, with
the parameters unsharded, and replay happens inside each block's own backward after FSDP2 has
gathered the parameters again; no module hook runs twice.

Under pipeline parallelism the model is split into stages after the converters ran (each stage a
deep copy of the whole meta model with the other stages' modules removed), so the converter
wraps later: right after torchtitan's ``pipeline_module_split``, still on the meta model parts
and before they are parallelised, all blocks of this rank's stages under one handle. Stages hold
different blocks, so each stage plans on its own: planned mode's collectives run in the group of
ranks that hold the same stage, and each stage writes its own policy and frontier files.
"""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tapesac
from tapesac.autoplan import PlanConfig
from tapesac.errors import ConfigError, TapeSACError
from tapesac.report import fmt_bytes

from . import cpu_shim, permutation
from .errors import exit_with

try:
    from torchtitan.tools.logging import logger
except ImportError:  # pragma: no cover
    import logging

    logger = logging.getLogger("tapesac")


def validate(job_config: Any, parallel_dims: Any = None) -> Any:
    """Check the ``[tapesac]`` section's neighbours (its own fields were checked when the config
    was parsed, in ``torchtitan_ext.config.TapeSAC``); return the section."""
    cfg = getattr(job_config, "tapesac", None)
    if cfg is None:
        raise ConfigError(
            "the 'tapesac' converter needs the [tapesac] config section: set "
            "job.custom_config_module = \"torchtitan_ext.config\" in the TOML (or pass "
            "--job.custom_config_module torchtitan_ext.config)"
        )
    ac = job_config.activation_checkpoint.mode
    if ac != "none":
        raise ConfigError(
            f"activation_checkpoint.mode is '{ac}', but TapeSAC replaces activation checkpointing: set "
            "activation_checkpoint.mode = \"none\" (CLI: --activation_checkpoint.mode none)"
        )
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError(
            "compile.enable compiles the transformer blocks, but TapeSAC records them eagerly: "
            "set compile.enable = false, or compile only the loss (compile.components = [\"loss\"])"
        )
    if parallel_dims is not None and getattr(parallel_dims, "cp_enabled", False):
        # Context parallelism shards attention along the sequence inside SDPA's dispatch, with
        # ring collectives the recorder cannot replay per shard.
        raise ConfigError(
            f"TapeSAC does not support context parallelism (parallelism.context_parallel_degree = "
            f"{job_config.parallelism.context_parallel_degree}): set parallelism.context_parallel_degree = 1 "
            "(CLI: --parallelism.context_parallel_degree 1), or remove \"tapesac\" from model.converters"
        )
    if parallel_dims is not None and getattr(parallel_dims, "pp_enabled", False):
        par = job_config.parallelism
        schedule = par.pipeline_parallel_schedule
        if par.pipeline_parallel_schedule_csv or schedule.lower() not in {s.lower() for s in PP_SCHEDULES}:
            what = (f"pipeline_parallel_schedule_csv = {par.pipeline_parallel_schedule_csv!r}"
                    if par.pipeline_parallel_schedule_csv else f"pipeline_parallel_schedule = {schedule!r}")
            raise ConfigError(
                f"TapeSAC supports the pipeline schedules {', '.join(PP_SCHEDULES)}; parallelism.{what} "
                "is not one of them (zero-bubble schedules split backward into input and weight passes, "
                "which TapeSAC does not replay): set parallelism.pipeline_parallel_schedule to one of those"
            )
        split = _pipelining_fn(job_config.model.name)
        if split is not None and not _is_pipeline_llm(split):
            raise ConfigError(
                f"model {job_config.model.name} splits its pipeline stages with its own "
                f"{getattr(split, '__qualname__', split)}, and TapeSAC wraps the stages that torchtitan's "
                "pipeline_llm makes: set parallelism.pipeline_parallel_degree = 1, or remove \"tapesac\" "
                "from model.converters"
            )
    return cfg


def _pipelining_fn(model_name: str) -> Any:
    try:
        from torchtitan.protocols.train_spec import get_train_spec

        return get_train_spec(model_name).pipelining_fn
    except Exception:  # noqa: BLE001 - an unknown model fails in torchtitan, with its own message
        return None


def _is_pipeline_llm(fn: Any) -> bool:
    from torchtitan.distributed import pipeline_parallel

    return fn is pipeline_parallel.pipeline_llm


PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
"""Pipeline schedules TapeSAC runs under: each micro-batch's backward is one autograd pass."""


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def memory_limit_bytes(cfg: Any, device: torch.device) -> tuple[int, int]:
    """(limit, capacity): ``limit_gib`` if set, else ``budget`` times the device capacity."""
    if device.type == "cuda":
        capacity = torch.cuda.mem_get_info(device)[1]
    elif cfg.cpu_capacity_gib > 0:
        capacity = int(cfg.cpu_capacity_gib * 2**30)
    else:
        capacity = cpu_shim.cpu_capacity_bytes()
    limit = int(cfg.limit_gib * 2**30) if cfg.limit_gib > 0 else int(cfg.budget * capacity)
    return limit, capacity


def _limit_source(cfg: Any, device: torch.device, capacity: int) -> str:
    """Where the limit came from, in words."""
    if cfg.limit_gib > 0:
        return f"tapesac.limit_gib = {cfg.limit_gib}"
    if device.type == "cuda":
        return f"tapesac.budget {cfg.budget} of the GPU's {fmt_bytes(capacity)}"
    if cfg.cpu_capacity_gib > 0:
        what = f"tapesac.cpu_capacity_gib = {cfg.cpu_capacity_gib}"
    else:
        what = "this node's memory divided by its ranks"
    return (f"tapesac.budget {cfg.budget} of {fmt_bytes(capacity)}: on CPU there is no device memory, "
            f"so the 'device' is {what}, and the peak counted is the bytes of live tensor storages")


def _info(message: str, stage: "_Stage | None" = None) -> None:
    """Rank 0 speaks for all ranks (they make the same decisions); under pipeline parallelism,
    the first rank of each stage speaks for its stage."""
    first = stage.first_rank if stage is not None else 0
    if int(os.environ.get("RANK", "0")) == first:
        logger.info(message)


class _Stage:
    """This rank's pipeline stages: their name, and the ranks that hold the same stages."""

    def __init__(self, indices: list[int], group: Any, first_rank: int) -> None:
        self.name = "+".join(map(str, indices))
        self.group = group
        """The process group of the ranks holding these stages (they plan together)."""
        self.first_rank = first_rank

    def exit_with(self, error: TapeSACError) -> None:
        """End this rank on an error of this stage's planning, printed by the stage's first rank."""
        exit_with(type(error)(f"pipeline stage {self.name}: {error}"), speaker=self.first_rank)


def _stage_of(stages: list[Any]) -> _Stage:
    """Who holds the same stages as this rank: one all-gather on the default group, then one
    group per distinct set of stages (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    mine = tuple(s.stage_index for s in stages)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_stage: dict[tuple, list[int]] = {}
    for rank, held in enumerate(everyone):
        by_stage.setdefault(held, []).append(rank)
    group, _all = dist.new_subgroups_by_enumeration(list(by_stage.values()))
    return _Stage(list(mine), group, by_stage[mine][0])


def _per_stage(path: str | None, stage: _Stage | None) -> str | None:
    """``policy.json`` -> ``policy.pp0.json``: each stage's plan in its own file."""
    if path is None or stage is None:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.pp{stage.name}{p.suffix}"))


def _wrap_after_pipeline_split(converter: "TapeSACConverter") -> None:
    """Wrap the stages ``pipeline_module_split`` returns, once, as it returns them.

    torchtitan's ``pipeline_llm`` (the ``pipelining_fn`` of its decoder models) splits the meta
    model with this module-level function and then parallelises each part; the patch takes
    itself out at its first call (one split per trainer) and holds the converter weakly.
    """
    from torchtitan.distributed import pipeline_parallel

    original = pipeline_parallel.pipeline_module_split
    ref = weakref.ref(converter)

    def pipeline_module_split(*args: Any, **kwargs: Any):
        pipeline_parallel.pipeline_module_split = original
        stages, parts = original(*args, **kwargs)
        target = ref()
        if target is not None:
            target.wrap(parts, _stage_of(stages))
        return stages, parts

    pipeline_parallel.pipeline_module_split = pipeline_module_split


def _artifact(path: str, dump_folder: str, default: str) -> str | None:
    if path.lower() == "none":
        return None
    return path or str(Path(dump_folder) / "tapesac" / default)


_CONVERTERS: list[weakref.ref] = []
"""Converters built in this process, newest last, held weakly (a finished trainer is freed)."""


def active() -> "TapeSACConverter | None":
    """The newest converter still alive in this process (tools and tests inspect its handle)."""
    for ref in reversed(_CONVERTERS):
        converter = ref()
        if converter is not None:
            return converter
    return None


class TapeSACConverter:
    """Registered as ``tapesac``: list it in ``model.converters``."""

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        self.job_config = job_config
        self.parallel_dims = parallel_dims
        try:
            self.cfg = validate(job_config, parallel_dims)
        except ConfigError as e:
            exit_with(e)
        if parallel_dims is not None and getattr(parallel_dims, "ep_enabled", False):
            # The Triton permutation writes its indices where the recorder cannot see them.
            permutation.install()
        self.handle: tapesac.TapeSACHandle | None = None
        self.limit_bytes: int | None = None
        _CONVERTERS.append(weakref.ref(self))
        _report_metrics()

    # ModelConverter protocol ----------------------------------------------------------------

    def convert(self, model: nn.Module) -> None:
        """Wrap every transformer block (on the meta model; FSDP2 shards around the wrappers).
        Under pipeline parallelism, arrange to wrap this rank's stages once they exist."""
        if not hasattr(model, "layers"):
            raise ConfigError(f"TapeSAC wraps model.layers, and {type(model).__name__} has none")
        if self.parallel_dims is not None and self.parallel_dims.pp_enabled:
            _wrap_after_pipeline_split(self)
            return
        self.wrap([model])

    def wrap(self, parts: list[nn.Module], stage: _Stage | None = None) -> None:
        """Wrap the blocks of ``parts`` (this rank's model, or its pipeline stages) in one handle."""
        blocks = [b for m in parts if getattr(m, "layers", None) is not None
                  for b in m.layers.values() if b is not None]
        where = f" of pipeline stage {stage.name}" if stage is not None else ""
        if not blocks:
            _info(f"TapeSAC: no transformer block{where}: nothing to wrap")
            return
        device = _device()
        cfg = self.cfg
        if cfg.mode == "replay_only":
            self.handle = tapesac.wrap(blocks, debug=cfg.debug)
            _info(f"TapeSAC: replay-only on {len(blocks)} blocks{where}: nothing a block makes is kept, "
                  "backward recomputes only what it reads", stage)
            return
        limit, capacity = memory_limit_bytes(cfg, device)
        self.limit_bytes = limit
        dump = self.job_config.job.dump_folder
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        meta = {"world_size": world, "model": f"{self.job_config.model.name}/{self.job_config.model.flavor}"}
        if stage is not None:
            meta["pipeline_stage"] = stage.name
        plan = PlanConfig(
            memory_limit_bytes=limit, safety_margin=float(cfg.safety_margin),
            warmup_steps=int(cfg.warmup_steps), profile_steps=int(cfg.profile_steps),
            repeats=int(cfg.profile_repeats), timing_reduction=cfg.timing_reduction,
            solver_time_limit_s=float(cfg.solver_time_limit_s), verify=bool(cfg.verify),
            policy_path=_per_stage(_artifact(cfg.policy_file, dump, "policy.json"), stage),
            frontier_path=_per_stage(_artifact(cfg.frontier_file, dump, "frontier.json"), stage),
            device=device, track=lambda: parts,
            fatal=stage.exit_with if stage is not None else exit_with,
            process_group=stage.group if stage is not None else None,
            policy_meta=meta,
        )
        self.handle = tapesac.wrap(blocks, plan_config=plan, debug=cfg.debug)
        _info(f"TapeSAC: planned mode on {len(blocks)} blocks{where}, step-peak limit {fmt_bytes(limit)} "
              f"per rank ({_limit_source(cfg, device, capacity)}); {cfg.warmup_steps} warm-up step(s) "
              "replay-only, then one profiled step, then the plan", stage)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        pass

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


def _report_metrics() -> None:
    """Add TapeSAC's numbers to torchtitan's metrics (TensorBoard, W&B) and a line under each
    step's log line (rank 0). torchtitan's trainer may run as ``torchtitan.train`` or, with
    ``python -m torchtitan.train``, as ``__main__``: both copies are wrapped, once each."""
    import sys

    for module in {sys.modules.get("torchtitan.train"), sys.modules.get("__main__")}:
        build = getattr(module, "build_metrics_processor", None)
        if build is None or getattr(build, "__tapesac__", False) or not hasattr(module, "Trainer"):
            continue

        @functools.wraps(build)
        def build_with_tapesac_metrics(*args: Any, _build=build, **kwargs: Any):
            processor = _build(*args, **kwargs)
            log = processor.log

            def log_with_tapesac(step, *a, extra_metrics=None, **k):
                converter = active()
                extra = dict(extra_metrics or {})
                if converter is not None:
                    extra.update(converter.metrics())
                out = log(step, *a, extra_metrics=extra, **k)
                if converter is not None and int(os.environ.get("RANK", "0")) == 0:
                    logger.info(converter.summary())
                return out

            processor.log = log_with_tapesac
            return processor

        build_with_tapesac_metrics.__tapesac__ = True  # type: ignore[attr-defined]
        module.build_metrics_processor = build_with_tapesac_metrics


def register() -> None:
    from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

    if "tapesac" not in _registry_model_converter_cls:
        register_model_converter(TapeSACConverter, "tapesac")
