"""Moved to :mod:`torchtitan_common.errors` (shared by both torchtitan front doors); these names
stay importable from here."""

from torchtitan_common.errors import EXIT_STATUS, TapeSACExit, excepthook, exit_with, install, raising

__all__ = ["EXIT_STATUS", "TapeSACExit", "excepthook", "exit_with", "install", "raising"]
