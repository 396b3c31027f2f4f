"""The ``tapesac`` model converter of torchtitan 0.2.x: TapeSAC on every transformer block, under
FSDP2, TP, EP and PP.

torchtitan runs converters on the meta model, before parallelisation. The converter checks the
job there (clear errors before any work) and wraps each block of ``model.layers`` (how that
survives FSDP2, and what runs where: ``torchtitan_common.run``).

Under pipeline parallelism the model is split into stages after the converters ran, so the
converter wraps later, right after torchtitan's ``pipeline_module_split``
(``torchtitan_common.pipeline``).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

import tapesac
from tapesac.errors import ConfigError
from torchtitan_common import compiled, pipeline
from torchtitan_common.errors import exit_with
from torchtitan_common.patches import until_first_call
from torchtitan_common.run import PipelineStage, Registry, TapeSACRun, memory_limit_bytes, report_with_step_log

from . import permutation

__all__ = ["TapeSACConverter", "active", "memory_limit_bytes", "register", "validate"]


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
    if compiled.compiles_blocks(job_config.compile):
        compiled.check(cfg, job_config.parallelism)
    if parallel_dims is not None and getattr(parallel_dims, "cp_enabled", False):
        # Context parallelism shards attention along the sequence inside SDPA's dispatch, with
        # ring collectives the recorder cannot replay per shard.
        raise ConfigError(
            f"TapeSAC does not support context parallelism (parallelism.context_parallel_degree = "
            f"{job_config.parallelism.context_parallel_degree}): set parallelism.context_parallel_degree = 1 "
            "(CLI: --parallelism.context_parallel_degree 1), or remove \"tapesac\" from model.converters"
        )
    if parallel_dims is not None and getattr(parallel_dims, "pp_enabled", False):
        fix = 'or remove "tapesac" from model.converters'
        pipeline.check_schedule(job_config.parallelism, fix)
        pipeline.check_split(_pipelining_fn(job_config.model.name), (_pipeline_llm(),), job_config.model.name, fix)
    return cfg


PP_SCHEDULES = pipeline.SCHEDULES


def _pipelining_fn(model_name: str) -> Any:
    try:
        from torchtitan.protocols.train_spec import get_train_spec

        return get_train_spec(model_name).pipelining_fn
    except Exception:  # noqa: BLE001 - an unknown model fails in torchtitan, with its own message
        return None


def _pipeline_llm() -> Any:
    from torchtitan.distributed import pipeline_parallel

    return pipeline_parallel.pipeline_llm


_CONVERTERS = Registry()


def active() -> "TapeSACConverter | None":
    """The newest converter still alive in this process (tools and tests inspect its handle)."""
    return _CONVERTERS.newest()


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
        self.compile_options = None
        """torch.compile's arguments for the blocks in compiled mode, else None (eager)."""
        if compiled.compiles_blocks(job_config.compile):
            # TapeSAC compiles the blocks itself, after recording them eagerly: torchtitan's
            # apply_compile must not wrap them first (a compiled block cannot be recorded).
            self.compile_options = compiled.compile_options(job_config.compile)
            job_config.compile.components = compiled.without_blocks(job_config.compile.components)
            # apply_compile also turns this on, for token-choice MoE: its experts read their token
            # counts with tolist(), where dynamo otherwise breaks the graph, and a MoE block's
            # checkpoint then runs eagerly under its compiled wrapper.
            torch._dynamo.config.capture_scalar_outputs = True
        self.run = TapeSACRun(self.cfg)
        _CONVERTERS.add(self)
        _report_metrics()

    @property
    def handle(self) -> tapesac.TapeSACHandle | None:
        return self.run.handle

    @property
    def limit_bytes(self) -> int | None:
        return self.run.limit_bytes

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

    def wrap(self, parts: list[nn.Module], stage: PipelineStage | None = None) -> None:
        """Wrap the blocks of ``parts`` (this rank's model, or its pipeline stages) in one handle."""
        blocks = [b for m in parts if getattr(m, "layers", None) is not None
                  for b in m.layers.values() if b is not None]
        job = self.job_config
        self.run.wrap(blocks, model=parts, dump_folder=job.job.dump_folder,
                      model_name=f"{job.model.name}/{job.model.flavor}", stage=stage,
                      compile_options=self.compile_options)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return self.run.metrics()

    def summary(self) -> str:
        return self.run.summary()


def _wrap_after_pipeline_split(converter: TapeSACConverter) -> None:
    """Wrap the stages ``pipeline_module_split`` returns, once, as it returns them
    (``torchtitan_common.pipeline``): torchtitan's ``pipeline_llm``, the ``pipelining_fn`` of its
    decoder models (:func:`validate` refuses others), splits the meta model with it and then
    parallelises each part."""
    from torchtitan.distributed import pipeline_parallel

    pipeline.wrap_after_split(pipeline_parallel, "pipeline_module_split", converter, TapeSACConverter.wrap)


def _current_run() -> TapeSACRun | None:
    converter = active()
    return converter.run if converter is not None else None


def _report_metrics() -> None:
    """Add TapeSAC's numbers to torchtitan's metrics (TensorBoard, W&B) and a line under each
    step's log line (rank 0), through the metrics processor the trainer builds next (the patch
    takes itself out at that call: ``torchtitan_common.patches``). torchtitan's trainer may run
    as ``torchtitan.train`` or, with ``python -m torchtitan.train``, as ``__main__``: both copies
    are wrapped."""
    modules = [m for m in {sys.modules.get("torchtitan.train"), sys.modules.get("__main__")}
               if m is not None and hasattr(m, "Trainer")]

    def wrap(build: Any) -> Any:
        @functools.wraps(build)
        def build_with_tapesac_metrics(*args: Any, **kwargs: Any):
            processor = build(*args, **kwargs)
            report_with_step_log(processor, _current_run)
            return processor

        return build_with_tapesac_metrics

    until_first_call(modules, "build_metrics_processor", wrap)


def register() -> None:
    from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

    if "tapesac" not in _registry_model_converter_cls:
        register_model_converter(TapeSACConverter, "tapesac")
