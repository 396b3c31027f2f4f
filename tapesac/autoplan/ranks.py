"""Rank agreement: the one all-reduce at every step's end, and what it carries.

Every decision that leads to a collective is taken from data every rank has (step counts,
broadcast plans) or from :class:`_Agreed`, the facts of the step that ended reduced over ranks
by one small all-reduce. Rank 0 speaks for every rank (:func:`say`): the decisions are the same
everywhere.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .. import distributed as tdist
from ..errors import TapeSACError

log = logging.getLogger("tapesac")


@dataclasses.dataclass(frozen=True)
class _Agreed:
    """What every rank knows about the step that ended, from one all-reduce (:meth:`reduce`)."""

    ran: bool
    """Some rank ran a block forward."""
    same: bool
    """Every rank ran the same step key."""
    mismatch: bool
    """Some rank's tape did not match its plan."""
    failed: bool
    """Some rank's profile failed."""
    off_plan: bool
    """Some rank left its plan."""
    twice: bool
    """Some rank backwarded a recording twice."""
    broke: bool
    """Compiled mode: some rank's compiled policy fell back to full AC (``CompiledRunner.broken``)."""
    uncompiled: frozenset[int]
    """Compiled mode: blocks of the step's plan that lack compiled code for it on some rank."""
    profiler: bool
    """Another profiler than TapeSAC's allocator meter runs on some rank (the user's), so that
    meter cannot measure a step there."""

    def reduce(self, key: str, blocks: int, group: Any, device: torch.device) -> "_Agreed":
        """This rank's facts (``same`` true) reduced with the other ranks' by one all-reduce: a
        maximum over int flags, one per fact and one per block for ``uncompiled`` (every rank has
        all ``blocks``), and the step key's hash both ways, to tell it is the same."""
        uncompiled = [int(b in self.uncompiled) for b in range(blocks)]
        flags = [self.ran, self.mismatch, self.failed, self.off_plan, self.twice, self.broke, self.profiler,
                 *uncompiled]
        if tdist.active(group):
            import torch.distributed as dist

            h = int(key, 16) >> 2
            dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            t = torch.tensor([h, -h, *[int(f) for f in flags]], dtype=torch.int64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            v = t.tolist()
            same, flags = v[0] == -v[1], v[2:]
        else:
            same = True
        ran, mismatch, failed, off_plan, twice, broke, profiler = map(bool, flags[:7])
        return _Agreed(ran=ran, same=same, mismatch=mismatch, failed=failed, off_plan=off_plan, twice=twice,
                       broke=broke, profiler=profiler,
                       uncompiled=frozenset(b for b, f in enumerate(flags[7:]) if f))


def say(group: Any, level: int, msg: str, *args: Any) -> None:
    """Rank 0 speaks for every rank: decisions are the same everywhere."""
    if tdist.rank(group) == 0:
        log.log(level, msg, *args)


def fail(config: Any, error: TapeSACError):
    """End planned mode with ``error`` (the same on every rank); ``config.fatal`` sees it first."""
    if config.fatal is not None:
        config.fatal(error)
    raise error
