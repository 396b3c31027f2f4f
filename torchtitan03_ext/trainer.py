"""torchtitan 0.3.x's trainer with ``tapesac`` among the activation-checkpointing choices.

torchtitan's ``Trainer.Config.activation_checkpoint`` is a closed union of tyro subcommands
(``selective``, ``full``, ``memory-budget``, ``none``): the command line can only choose what the
config class declares. :class:`Trainer` declares the same union plus ``tapesac``; a config
function that returns a :class:`Trainer.Config` (every function in
``torchtitan03_ext.config_registry``, or :func:`with_tapesac` around any of torchtitan's) makes
``activation-checkpoint:tapesac`` a choice on the command line. Nothing global is changed:
jobs built from torchtitan's own ``Trainer.Config`` are untouched.
"""

# No "from __future__ import annotations": tyro needs real types here.
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any

import tyro
from torchtitan import trainer as tt_trainer
from torchtitan.distributed import pipeline_parallel
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig as TorchtitanAC
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from tapesac.errors import ConfigError
from torchtitan_common import compiled, pipeline
from torchtitan_common.errors import exit_with
from torchtitan_common.run import TapeSACRun, report_with_step_log

from .activation_checkpoint import TapeSAC, active, take_applied

ActivationCheckpointingConfig = TorchtitanAC | Annotated[TapeSAC.Config, tyro.conf.subcommand("tapesac")]
"""torchtitan's choices plus ``activation-checkpoint:tapesac``."""


SPMD_BACKENDS = ("partial_dtensor", "full_dtensor")
"""torchtitan 0.3's ``parallelism.spmd_backend`` values TapeSAC runs with: DTensor for the
model-parallel axes only (as torchtitan 0.2 did), or for every axis (FSDP2's too)."""


def check_neighbours(config: "tt_trainer.Trainer.Config") -> None:
    """Refuse what TapeSAC cannot run with (ConfigError naming the setting and the fix).

    ``spmd_backend``: torchtitan 0.3's default, ``spmd_types``, needs FSDP2 that reads
    ``spmd_types`` annotations (torch >= 2.14; torch 2.13's ``fully_shard`` refuses its plain
    parameters) and is untested with TapeSAC; ``full_dtensor`` (the blocks' activations are
    DTensors on every axis) and ``partial_dtensor`` run.
    Context parallelism is refused, as on 0.2.x; pipeline parallelism runs under the schedules
    of ``torchtitan_common.pipeline`` with the models whose stages torchtitan's ``pipeline_llm``
    makes. A compiled model runs TapeSAC's compiled mode, under its refusals
    (``torchtitan_common.compiled``).
    """
    if not config.training.disable_cuda_graphs:
        raise ConfigError(
            "CUDA graphs replay a captured step without Python, but TapeSAC records, measures and "
            "plans each step in Python: set --training.disable_cuda_graphs (on CPU it is a no-op)")
    par = config.parallelism
    if par.spmd_backend not in SPMD_BACKENDS:
        raise ConfigError(
            f"parallelism.spmd_backend is '{par.spmd_backend}', but TapeSAC runs with "
            f"{' or '.join(repr(b) for b in SPMD_BACKENDS)} only (on torch 2.13, FSDP2 does not read "
            "spmd_types annotations): set --parallelism.spmd_backend partial_dtensor")
    if par.context_parallel_degree > 1:
        # Context parallelism shards attention along the sequence inside SDPA's dispatch, with
        # ring collectives the recorder cannot replay per shard.
        raise ConfigError(
            f"TapeSAC does not support context parallelism (parallelism.context_parallel_degree = "
            f"{par.context_parallel_degree}): set --parallelism.context_parallel_degree 1")
    if par.pipeline_parallel_degree > 1:
        fix = "or choose another activation-checkpoint: subcommand"
        pipeline.check_schedule(par, fix)
        if config.model_spec is not None:
            pipeline.check_split(config.model_spec.pipelining_fn, pipeline_fns(), config.model_spec.name, fix)
    if compiled.compiles_blocks(config.compile):
        compiled.check(config.activation_checkpoint, config.parallelism)


def pipeline_fns() -> tuple:
    """torchtitan 0.3's ``pipelining_fn`` of its decoder models that split with
    ``_pipeline_module_split`` (``pipeline_vlm`` moves the vision encoder into the first stage,
    then calls ``pipeline_llm``), whose stages TapeSAC wraps (``TapeSAC.apply_to_stages``)."""
    return pipeline_parallel.pipeline_llm, pipeline_parallel.pipeline_vlm


TEXT_ONLY_SPECIAL_TOKENS = {"image_id": -1, "video_id": -1}
"""What a text batch gives a multimodal model that reads vision token ids on every forward
(Qwen3.5's ``Qwen35Model.forward`` reads ``special_tokens["image_id"]``): ids no token has, for
a batch that has no vision input."""


class Trainer(tt_trainer.Trainer):
    """torchtitan's trainer; with ``activation-checkpoint:tapesac`` it also reports TapeSAC's
    numbers in torchtitan's metrics and a line under each step's log line (rank 0).

    It also trains a multimodal model on text batches: torchtitan's text dataloaders give no
    ``special_tokens``, which Qwen3.5's forward needs even without images
    (:meth:`post_dataloading_process`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(tt_trainer.Trainer.Config):
        activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=SelectiveAC.Config)

        def __post_init__(self) -> None:
            # Explicit base: slots=True rebuilds the class, which breaks zero-argument super().
            tt_trainer.Trainer.Config.__post_init__(self)
            ac = self.activation_checkpoint
            if isinstance(ac, TapeSAC.Config):
                check_neighbours(self)
                if self.model_spec is not None:
                    ac.model_name = f"{self.model_spec.name}/{self.model_spec.flavor}"

    def __init__(self, config: Config) -> None:
        if isinstance(config.activation_checkpoint, TapeSAC.Config):
            try:
                check_neighbours(config)  # a config changed after parsing
            except ConfigError as e:
                exit_with(e)
            if compiled.compiles_blocks(config.compile):
                config = _compiled_by_tapesac(config)
            if config.parallelism.pipeline_parallel_degree > 1:
                stages_policy = config.activation_checkpoint.build(dump_folder=config.dump_folder)
                pipeline.wrap_after_split(pipeline_parallel, "_pipeline_module_split", stages_policy,
                                          TapeSAC.apply_to_stages)
        super().__init__(config)
        # The TapeSAC policy applied to this model in parallelize_fn (None with another choice).
        self.tapesac = take_applied(self.model_parts)
        if self.tapesac is not None:
            report_with_step_log(self.metrics_processor, _current_run)
        self._text_only_tokens = "special_tokens" in inspect.signature(self.model_parts[0].forward).parameters

    def post_dataloading_process(self, input_dict: dict[str, Any], labels: Any) -> tuple[Any, Any, dict[str, Any]]:
        """torchtitan's, plus :data:`TEXT_ONLY_SPECIAL_TOKENS` for a model whose forward takes
        ``special_tokens`` when the batch has none (a text batch; a multimodal dataloader's
        batch carries its own)."""
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if self._text_only_tokens and "special_tokens" not in extra_kwargs:
            extra_kwargs["special_tokens"] = dict(TEXT_ONLY_SPECIAL_TOKENS)
        return inputs, labels, extra_kwargs


def _compiled_by_tapesac(config: "Trainer.Config") -> "Trainer.Config":
    """``config`` with TapeSAC compiling the blocks instead of torchtitan.

    torchtitan's ``parallelize_fn`` compiles each block (``apply_compile``) right after applying
    activation checkpointing, and a compiled block cannot be recorded: torchtitan gets the
    compile settings without ``"model"`` (the loss is still compiled when listed), and TapeSAC
    gets ``torch.compile``'s arguments, compiling each block under its plan. The caller's config
    is left as it was.
    """
    ac = dataclasses.replace(config.activation_checkpoint, compile_options=compiled.compile_options(config.compile))
    torchtitan_compile = dataclasses.replace(config.compile, components=compiled.without_blocks(config.compile.components))
    return dataclasses.replace(config, activation_checkpoint=ac, compile=torchtitan_compile)


def _current_run() -> TapeSACRun | None:
    policy = active()
    return policy.run if policy is not None else None


def with_tapesac(config: tt_trainer.Trainer.Config) -> Trainer.Config:
    """``config`` (any torchtitan ``Trainer.Config``, e.g. ``llama3_8b()``) as this trainer's
    config, so that ``activation-checkpoint:tapesac`` can be chosen on the command line. Its
    fields are shared, not copied; choose TapeSAC by setting ``activation_checkpoint`` to a
    ``TapeSAC.Config`` (checked with the rest when the command line is parsed)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return Trainer.Config(**values)
