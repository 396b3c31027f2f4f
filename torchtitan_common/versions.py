"""Which torchtitan is installed, and a clear error when a front door does not support it."""

from __future__ import annotations

from importlib import metadata

from tapesac.errors import ConfigError

FRONT_DOORS = {(0, 2): "torchtitan_ext", (0, 3): "torchtitan03_ext"}
"""torchtitan (major, minor) -> the TapeSAC package that supports it."""


def torchtitan_version() -> str | None:
    """The installed torchtitan's version string, or None when it is not installed."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, int] | None:
    try:
        major, minor = version.split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def require(front_door: str) -> str:
    """The installed torchtitan's version, if ``front_door`` supports it; else ConfigError
    naming the version found, the versions this front door supports, and what to do."""
    supported = [mm for mm, door in FRONT_DOORS.items() if door == front_door]
    wanted = " or ".join(f"{a}.{b}.x" for a, b in supported)
    version = torchtitan_version()
    if version is None:
        raise ConfigError(f"{front_door} needs torchtitan {wanted}, and torchtitan is not installed: "
                          f"see the README's torchtitan section")
    mm = _major_minor(version)
    if mm in supported:
        return version
    other = FRONT_DOORS.get(mm) if mm is not None else None
    fix = (f"use {other} instead (see the README)" if other else
           "install a supported torchtitan (see the README; supported: "
           + ", ".join(f"{a}.{b}.x with {d}" for (a, b), d in FRONT_DOORS.items()) + ")")
    raise ConfigError(f"torchtitan {version} is installed, but {front_door} supports torchtitan {wanted}: {fix}")
