"""TapeSAC: automatic, exact selective activation checkpointing for eager PyTorch.

Record each transformer block's forward as a tape of ATen ops, let backward unpack saved values
lazily, and rerun only the producer chains of the values backward actually reads.
"""

from .api import TapeSACHandle, wrap
from .errors import ConfigError, PlanError, PolicyError, ReplayError, TapeSACError, WrapError

__all__ = [
    "wrap",
    "TapeSACHandle",
    "TapeSACError",
    "WrapError",
    "ReplayError",
    "PolicyError",
    "PlanError",
    "ConfigError",
]
__version__ = "0.1.0"
