"""TapeSAC as an activation-checkpointing choice of torchtitan 0.3.x.

torchtitan 0.3 applies activation checkpointing with ``ac_config.build(dump_folder=...)
.apply(model)`` inside each model's ``parallelize_fn``, on the meta model, after tensor
parallelism and before ``fully_shard``. :class:`TapeSAC` wraps the blocks of ``model.layers``
there, exactly as torchtitan 0.2.x's ``tapesac`` converter does (``torchtitan_common.run``):
FSDP2 shards around the wrappers, rank 0 plans and broadcasts.

Under pipeline parallelism torchtitan 0.3 splits the model first and then runs ``parallelize_fn``
on each of this rank's stages, each with a policy of its own. The trainer builds one policy for
all of them, which wraps their blocks right after the split (:meth:`TapeSAC.apply_to_stages`, as
the 0.2.x converter does); the per-stage policies find their stage wrapped and leave it.

When the job compiles the model, TapeSAC runs in compiled mode: the trainer keeps torchtitan's
``apply_compile`` off the blocks and hands torch.compile's arguments to the policy
(``Config.compile_options``), which sets up compilation as ``apply_compile`` would
(:func:`_compile_like_torchtitan`) and compiles each block under its plan.
"""

# No "from __future__ import annotations": tyro needs real types here.
import sys
import weakref
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import tyro
from torch import nn
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing
from torchtitan.tools.logging import logger

from torchtitan_common.run import PipelineStage, Registry, TapeSACRun
from torchtitan_common.settings import TapeSACSettings

_RUNS = Registry()
_APPLIED = "_tapesac_applied"
"""Attribute of a model (part) that holds the policy applied to it until its trainer takes it.
torchtitan builds the policy, applies it and drops it inside ``parallelize_fn``; the trainer
takes it right after (:func:`take_applied`) and holds it for as long as it trains."""


def active() -> "TapeSAC | None":
    """The newest TapeSAC policy whose trainer is still alive in this process (tools and tests
    read its handle)."""
    return _RUNS.newest()


def take_applied(model_parts: "list[nn.Module]") -> "TapeSAC | None":
    """The policy applied to ``model_parts`` or their modules (the last part's when several hold
    one; None if none), for their trainer; none of them holds one after."""
    policy = None
    for part in model_parts:
        for module in part.modules():
            applied = module.__dict__.pop(_APPLIED, None)
            if applied is not None:
                policy = applied
    if policy is not None:
        _RUNS.add(policy)
    return policy


class TapeSAC(ActivationCheckpointing):
    """Automatic, exact selective activation checkpointing: keep what pays most under a limit on
    step-peak memory, recompute only what backward reads (fields: ``TapeSACSettings``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config, TapeSACSettings):
        """TapeSAC's settings, shared with torchtitan 0.2.x's ``[tapesac]`` section.

        The base class's ``preserve_rng_state`` and ``determinism_check`` change nothing here:
        TapeSAC always records the generator state of random ops (gradients are bit-identical
        either way) and checks recomputed values with ``debug``.
        """

        prefix: ClassVar[str] = "activation_checkpoint"

        debug: bool = False
        """Compare every recomputed value with the forward's and fail on any difference (slow)."""

        model_name: Annotated[str, tyro.conf.Suppress] = ""
        """``<model>/<flavor>``, stored in the saved policy (set from the trainer's model spec)."""

        compile_options: Annotated[dict[str, Any] | None, tyro.conf.Suppress] = None
        """``torch.compile``'s arguments for the blocks in compiled mode, else None (eager): set by
        the trainer when the job compiles the model (``compile.enable``, ``"model"`` in
        ``compile.components``), which TapeSAC then does itself (``torchtitan_common.compiled``)."""

        def __post_init__(self) -> None:
            """Every value is checked when the config is parsed: before any work, once."""
            self.check()

    def __init__(self, config: "TapeSAC.Config", dump_folder: str = "") -> None:
        super().__init__(config, dump_folder)
        self.run = TapeSACRun(config)
        self._applied_to: "weakref.ref[nn.Module] | None" = None
        """The model this policy wrapped the blocks of (weak: the model holds the policy)."""

    @property
    def handle(self):
        return self.run.handle

    def apply(self, model: nn.Module) -> None:
        """Wrap every transformer block of ``model.layers`` (the meta model, before FSDP2).

        A multimodal model's ``parallelize_fn`` applies the same policy to its vision encoder
        after the model (Qwen3.5's does): a module inside a model this policy was applied to is
        left as it is, so the decoder's blocks are the ones planned, and the encoder's memory,
        when it runs, is part of the measured step.
        """
        if model.__dict__.get(_APPLIED, self) is not self:
            # A pipeline stage: wrapped with this rank's other stages when torchtitan split the
            # model, by the policy the trainer built for them (apply_to_stages).
            self._applied_to = weakref.ref(model)
            return
        root = self._applied_to() if self._applied_to is not None else None
        if root is not None and any(module is model for module in root.modules()):
            logger.info(f"TapeSAC plans the blocks of {type(root).__name__}.layers; {type(model).__name__} "
                        "runs without activation checkpointing")
            return
        layers = model.get_submodule("layers")
        blocks = [block for block in layers.children() if block is not None]
        name = self.config.model_name or type(model).__name__
        options = self.config.compile_options
        if options is not None:
            options = _compile_like_torchtitan(model, options)
        self.run.wrap(blocks, model=model, dump_folder=self.dump_folder, model_name=name, compile_options=options)
        model.__dict__[_APPLIED] = self
        self._applied_to = weakref.ref(model)
        logger.debug(f"Applied TapeSAC to {len(blocks)} blocks of {name}")

    def apply_to_stages(self, parts: "list[nn.Module]", stage: PipelineStage) -> None:
        """Wrap the blocks of this rank's pipeline stages ``parts`` under one handle, planned as
        ``stage`` (on the meta parts, right after torchtitan splits the model and before it
        parallelises them: ``torchtitan_common.pipeline``). The trainer builds this policy for
        them; the policy torchtitan then builds and applies to each part in ``parallelize_fn``
        finds the part wrapped and leaves it (and a vision encoder in it) as it is (:meth:`apply`).
        """
        blocks = [block for part in parts if getattr(part, "layers", None) is not None
                  for block in part.layers.children() if block is not None]
        name = self.config.model_name or type(parts[0]).__name__
        options = self.config.compile_options
        if options is not None:
            options = _compile_like_torchtitan(parts[0], options)
        self.run.wrap(blocks, model=parts, dump_folder=self.dump_folder, model_name=name, stage=stage,
                      compile_options=options)
        for part in parts:
            part.__dict__[_APPLIED] = self
        logger.debug(f"Applied TapeSAC to {len(blocks)} blocks of pipeline stage {stage.name} of {name}")


def _compile_like_torchtitan(model: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for TapeSAC's compiled blocks, after what torchtitan 0.3's ``apply_compile``
    sets up before it compiles the blocks itself (``torchtitan.distributed.compile``).

    The same dynamo settings (process-wide, as torchtitan sets them): scalar outputs captured
    (MoE routing), and forward side effects not replayed in a checkpointed block's backward
    (without it, a block that enters a ``TorchFunctionMode``, as FlexAttention's mask helpers
    do, breaks the graph around its checkpoint and runs eagerly). The same backend: with
    ``aot_eager``, FlexAttention's regions still go to inductor. Async TP is left out: compiled
    mode refuses TP.
    """
    import torch._dynamo
    from torchtitan.distributed import compile as tt_compile

    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    _no_eager_only_position_check()
    return {**options, "backend": tt_compile._maybe_regional_inductor_backend(model, options["backend"])}


def _no_eager_only_position_check() -> None:
    """Skip RoPE's bounds check on positions in eager forwards too, as compiled ones do.

    torchtitan 0.3 checks positions (``le``, ``all``, ``_assert_async``) only when not compiling
    (``torchtitan.models.common.rope._maybe_check_max_pos``): the tape TapeSAC records eagerly
    would hold ops the compiled trace does not run, and no plan could be mapped onto the trace
    (compiled invariant 1 of ``tapesac.compiled``). So in compiled mode this process records
    what compiles: every torchtitan module imported so far (the model is built) that holds the
    check gets one that returns at once.
    """
    from torchtitan.models.common import rope

    check = rope._maybe_check_max_pos
    if getattr(check, "__tapesac__", False):
        return

    def skip_position_check(positions, *, max_valid_pos: int) -> None:
        return None

    skip_position_check.__tapesac__ = True  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.") and getattr(module, "_maybe_check_max_pos", None) is check:
            module._maybe_check_max_pos = skip_position_check
