"""The ``[tapesac]`` section of a torchtitan 0.2.x job, merged in with ``job.custom_config_module``.

    [job]
    custom_config_module = "torchtitan_ext.config"

    [model]
    converters = ["tapesac"]

    [activation_checkpoint]
    mode = "none"            # TapeSAC replaces activation checkpointing

    [tapesac]
    budget = 0.9

Every field can be overridden on the command line, e.g. ``--tapesac.budget 0.85``. The fields,
their defaults and their checks are defined once, in ``torchtitan_common.settings`` (shared with
the torchtitan 0.3 front door, ``torchtitan03_ext``).
"""

# No "from __future__ import annotations": torchtitan's config merge needs real types here.
from dataclasses import dataclass, field

import torchtitan_ext  # noqa: F401  (registers the converter, the dataset, the CPU shim)
from torchtitan_common.settings import TapeSACSettings


@dataclass(kw_only=True)
class TapeSAC(TapeSACSettings):
    """The ``[tapesac]`` section (fields and their docs: ``TapeSACSettings``)."""

    def __post_init__(self) -> None:
        """Every value is checked here, when the config is parsed: before any work, once."""
        self.check()


@dataclass
class JobConfig:
    tapesac: TapeSAC = field(default_factory=TapeSAC)
