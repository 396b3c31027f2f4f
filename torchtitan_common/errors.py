"""One clear message for a TapeSAC error in a torchtitan job: printed once (rank 0), the job
ends with status 2, and no rank prints a traceback (torchrun still lists the failed ranks).

Errors found while the config is parsed reach :func:`excepthook`, which ends the process at once
with status 2 (nothing ran that needs a teardown). Errors found later (inside torchtitan's
trainer, whose ``@record`` would log a traceback per rank) go through :func:`exit_with`, which
runs the ``atexit`` handlers and then ends the process with status 2 too: the trainer is never closed on
this path, and an interpreter that shut down around its live process group, dataloader and
checkpoint threads could hang, or abort in a native destructor (the gloo teardown problem of
``torchtitan_common.cpu``) and turn status 2 into SIGABRT.
Harnesses that drive the trainer in-process and go on after an error wrap it in :func:`raising`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
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
    """Raised by :func:`exit_with` inside :func:`raising`, after the error was printed;
    ``error`` is that error."""

    def __init__(self, error: TapeSACError) -> None:
        super().__init__(EXIT_STATUS)
        self.error = error


_raising = 0


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """Within it, :func:`exit_with` raises :class:`TapeSACExit` instead of ending the process
    (for harnesses that run torchtitan's trainer in-process, like ``tools/bench.py``)."""
    global _raising
    _raising += 1
    try:
        yield
    finally:
        _raising -= 1


def _end_process() -> NoReturn:
    """What a normal exit does up to the interpreter's teardown (``atexit`` handlers: loggers,
    metric writers, probes; logging's flush), then the end, with status 2."""
    atexit._run_exitfuncs()  # noqa: SLF001
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STATUS)  # noqa: SLF001 - see the module's docstring


def exit_with(error: TapeSACError, speaker: int = 0) -> NoReturn:
    """Print ``error`` once and end this rank (every rank with ``speaker`` meets the same error)."""
    _say(error, speaker)
    if _raising:
        sys.stdout.flush()
        raise TapeSACExit(error)
    _end_process()


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
