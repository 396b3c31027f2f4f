"""The ``tapesac`` model converter of torchtitan 0.2.x: TapeSAC on every transformer block, under
FSDP2.

torchtitan runs converters on the meta model, before parallelisation. The converter checks the
job there (clear errors before any work) and wraps each block of ``model.layers`` (how that
survives FSDP2, and what runs where: ``torchtitan_common.run``).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

import tapesac
from tapesac.errors import ConfigError
from torchtitan_common.errors import exit_with
from torchtitan_common.run import Registry, TapeSACRun, memory_limit_bytes, report_with_step_log

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
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError(
            "compile.enable compiles the transformer blocks, but TapeSAC records them eagerly: "
            "set compile.enable = false, or compile only the loss (compile.components = [\"loss\"])"
        )
    if parallel_dims is not None and getattr(parallel_dims, "pp_enabled", False):
        raise ConfigError("TapeSAC does not support pipeline parallelism yet: set "
                          "parallelism.pipeline_parallel_degree = 1")
    return cfg


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
        """Wrap every transformer block (on the meta model; FSDP2 shards around the wrappers)."""
        if not hasattr(model, "layers"):
            raise ConfigError(f"TapeSAC wraps model.layers, and {type(model).__name__} has none")
        blocks = [b for b in model.layers.values() if b is not None]
        job = self.job_config
        self.run.wrap(blocks, model=model, dump_folder=job.job.dump_folder,
                      model_name=f"{job.model.name}/{job.model.flavor}")

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return self.run.metrics()

    def summary(self) -> str:
        return self.run.summary()


def _current_run() -> TapeSACRun | None:
    converter = active()
    return converter.run if converter is not None else None


def _report_metrics() -> None:
    """Add TapeSAC's numbers to torchtitan's metrics (TensorBoard, W&B) and a line under each
    step's log line (rank 0). torchtitan's trainer may run as ``torchtitan.train`` or, with
    ``python -m torchtitan.train``, as ``__main__``: both copies are wrapped, once each."""
    for module in {sys.modules.get("torchtitan.train"), sys.modules.get("__main__")}:
        build = getattr(module, "build_metrics_processor", None)
        if build is None or getattr(build, "__tapesac__", False) or not hasattr(module, "Trainer"):
            continue

        @functools.wraps(build)
        def build_with_tapesac_metrics(*args: Any, _build=build, **kwargs: Any):
            processor = _build(*args, **kwargs)
            report_with_step_log(processor, _current_run)
            return processor

        build_with_tapesac_metrics.__tapesac__ = True  # type: ignore[attr-defined]
        module.build_metrics_processor = build_with_tapesac_metrics


def register() -> None:
    from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

    if "tapesac" not in _registry_model_converter_cls:
        register_model_converter(TapeSACConverter, "tapesac")
