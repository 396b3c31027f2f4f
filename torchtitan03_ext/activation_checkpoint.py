"""TapeSAC as an activation-checkpointing choice of torchtitan 0.3.x.

torchtitan 0.3 applies activation checkpointing with ``ac_config.build(dump_folder=...)
.apply(model)`` inside each model's ``parallelize_fn``, on the meta model, after tensor
parallelism and before ``fully_shard``. :class:`TapeSAC` wraps the blocks of ``model.layers``
there, exactly as torchtitan 0.2.x's ``tapesac`` converter does (``torchtitan_common.run``):
FSDP2 shards around the wrappers, rank 0 plans and broadcasts.
"""

# No "from __future__ import annotations": tyro needs real types here.
from dataclasses import dataclass
from typing import Annotated, ClassVar

import tyro
from torch import nn
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing
from torchtitan.tools.logging import logger

from torchtitan_common.run import Registry, TapeSACRun
from torchtitan_common.settings import TapeSACSettings

_RUNS = Registry()
_applied: "list[TapeSAC]" = []
"""Policies applied to a model and not yet taken by their trainer. torchtitan builds the policy,
applies it and drops it inside ``parallelize_fn``; the trainer takes it from here right after
(:func:`take_applied`) and holds it for as long as it trains."""


def active() -> "TapeSAC | None":
    """The newest TapeSAC policy whose trainer is still alive in this process (tools and tests
    read its handle)."""
    return _RUNS.newest()


def take_applied() -> "TapeSAC | None":
    """The policy applied since the last call (the newest; None if none), for its trainer."""
    policy = _applied[-1] if _applied else None
    _applied.clear()
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

        def __post_init__(self) -> None:
            """Every value is checked when the config is parsed: before any work, once."""
            self.check()

    def __init__(self, config: "TapeSAC.Config", dump_folder: str = "") -> None:
        super().__init__(config, dump_folder)
        self.run = TapeSACRun(config)

    @property
    def handle(self):
        return self.run.handle

    def apply(self, model: nn.Module) -> None:
        """Wrap every transformer block of ``model.layers`` (the meta model, before FSDP2)."""
        layers = model.get_submodule("layers")
        blocks = [block for block in layers.children() if block is not None]
        name = self.config.model_name or type(model).__name__
        self.run.wrap(blocks, model=model, dump_folder=self.dump_folder, model_name=name)
        _applied.append(self)
        logger.debug(f"Applied TapeSAC to {len(blocks)} blocks of {name}")
