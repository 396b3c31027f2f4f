"""The exceptions TapeSAC raises. One family, a few subclasses a caller may want to catch."""

from __future__ import annotations

from typing import Any

import torch


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

    floor_bytes: float | None = None
    """For an infeasible limit: the smallest predicted step peak, which the limit is below."""


class ConfigError(TapeSACError):
    """A setting is invalid (out of range, or in conflict with another); raised before any work."""


AUTOGRAD_MODIFIED = ("one of the variables needed for gradient computation has been modified by an "
                     "inplace operation")
"""Autograd's own words for a saved tensor changed in place, so callers match one message."""

_LEGACY_TYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                 torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
                 torch.int64: "Long", torch.bool: "Bool"}


def _type_string(dtype: torch.dtype, device: torch.device) -> str:
    """The tensor type as autograd's message prints it (``torch.FloatTensor``, ``CPUBFloat16Type``)."""
    legacy = _LEGACY_TYPES.get(dtype)
    if legacy is not None and device.type in ("cpu", "cuda"):
        return f"torch.{'cuda.' if device.type == 'cuda' else ''}{legacy}Tensor"
    name = torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    return f"{device.type.upper()}{name}Type"


def modified_error(dtype: torch.dtype, device: torch.device, shape: Any, current: int, expected: int,
                   block: int, recomputes: str | None = None) -> ReplayError:
    """Autograd's error for a saved tensor changed in place, raised by TapeSAC on its behalf.

    ``recomputes`` says what replay rebuilds from the tensor, when autograd itself never reads it.
    """
    msg = (f"{AUTOGRAD_MODIFIED}: [{_type_string(dtype, device)} {list(shape)}] is at version "
           f"{current}; expected version {expected} instead.")
    if recomputes is None:
        return ReplayError(
            f"{msg} Hint: enable anomaly detection to find the operation that failed to compute its "
            "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False). (Checked by "
            f"TapeSAC block {block} for autograd, which cannot check tensors saved under its hooks.)"
        )
    return ReplayError(
        f"{msg} TapeSAC block {block} recomputes saved values from this tensor ({recomputes}) in "
        "backward, so it must not change between the block's forward and backward: clone it "
        "before updating it in place, or update a copy."
    )
