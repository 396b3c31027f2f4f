"""One clear message for a TapeSAC error in a torchtitan job: printed once (rank 0), the job
ends with status 2, and no rank prints a traceback (torchrun still lists the failed ranks).

Errors found while the config is parsed reach :func:`excepthook`; errors found later (inside
torchtitan's trainer, whose ``@record`` would log a traceback per rank) go through
:func:`exit_with`, which ends the rank with ``SystemExit`` instead.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

from tapesac.errors import TapeSACError

EXIT_STATUS = 2
_OTHER_RANKS_WAIT_S = 10.0


def _say(error: BaseException, speaker: int = 0) -> None:
    """Rank ``speaker`` prints; the others give it time to (torchrun stops every rank once one
    exits). Ranks that meet an error together name one of them (rank 0 for the whole job, the
    first rank of a pipeline stage for that stage's plan)."""
    if os.environ.get("RANK", "0") == str(speaker):
        text = str(error)
        prefix = "" if text.startswith("TapeSAC") else "TapeSAC: "
        print(f"[tapesac] error: {prefix}{text}", file=sys.stderr, flush=True)
    else:
        time.sleep(_OTHER_RANKS_WAIT_S)


class TapeSACExit(SystemExit):
    """Ends a rank after a TapeSAC error was printed; ``error`` is that error (harnesses that
    drive torchtitan's trainer in-process, like ``tools/bench.py``, may catch it)."""

    def __init__(self, error: TapeSACError) -> None:
        super().__init__(EXIT_STATUS)
        self.error = error


def exit_with(error: TapeSACError, speaker: int = 0) -> NoReturn:
    """Print ``error`` once and end this rank (every rank with ``speaker`` meets the same error)."""
    _say(error, speaker)
    sys.stdout.flush()
    raise TapeSACExit(error)


_previous_hook = sys.excepthook


def excepthook(kind, error, tb) -> None:
    if isinstance(error, TapeSACError):
        _say(error)
        sys.stdout.flush()
        os._exit(EXIT_STATUS)  # noqa: SLF001 - nothing ran yet that needs a teardown
    _previous_hook(kind, error, tb)


def install() -> None:
    if sys.excepthook is not excepthook:
        sys.excepthook = excepthook
