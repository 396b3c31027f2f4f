"""The exceptions TapeSAC raises. One family, a few subclasses a caller may want to catch."""

from __future__ import annotations


class TapeSACError(RuntimeError):
    """Base class: something TapeSAC cannot do safely. The message names the block and the fix."""


class WrapError(TapeSACError):
    """A block cannot be wrapped as asked (wrapped twice, nested, already checkpointed)."""


class ReplayError(TapeSACError):
    """Backward asked for a value that cannot be rebuilt exactly (input mutated, freed twice)."""


class PolicyError(TapeSACError):
    """A policy does not fit the recorded tape (signature mismatch, bad format or version)."""


class PlanError(TapeSACError):
    """The planner cannot satisfy the request (infeasible memory limit, bad graph)."""


class ConfigError(TapeSACError):
    """A setting is invalid (out of range, or in conflict with another); raised before any work."""
