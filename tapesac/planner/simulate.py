"""Bytes replay holds over a block's backward, for any keep set, without running anything.

The same lazy bookkeeping as :class:`tapesac.replay.Replayer`, on a :class:`BlockGraph`: for each
unpack (in the order a profiled backward asked for them) the chain of missing values is rebuilt,
outputs are cached while something still needs them, and values are dropped at their last use
(after the op that uses them last returns: its inputs and outputs are alive together).
Kept values sit in the cache from the start and leave at their last use too. Storages count once.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from ..walk import producer_ops
from .graph import BlockGraph


def simulate_replay(g: BlockGraph, kept: Iterable[int], order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For each unpack k of ``order``: (peak bytes held while serving it, bytes held after it).

    Held bytes are the block's own: kept values and rebuilt ones, not always-available values.
    """
    kept = set(kept)
    value_op, deps, storage, nbytes = g.value_op, g.op_deps, g.value_storage, g.storage_bytes
    outs = g.op_outputs()
    closure = g.closure(kept)
    counts = g.read_counts or [1] * len(g.read)
    rc: Counter[int] = Counter()
    for v, c in zip(g.read, counts):
        rc[v] += c
    for o in closure:
        for d in deps[o]:
            rc[d] += 1
    cache = {v for v in kept if rc[v] > 0}

    def held(extra: set[int] = frozenset()) -> float:
        return sum(nbytes[s] for s in {storage[v] for v in cache | extra})

    peaks, afters = np.zeros(len(order)), np.zeros(len(order))
    for k, u in enumerate(order):
        peak = held()
        if u not in cache and value_op[u] >= 0:
            run = sorted(producer_ops((u,), value_op.__getitem__, deps.__getitem__,
                                      lambda x: x in cache or value_op[x] < 0))
            pending: Counter[int] = Counter(d for o in run for d in deps[o])
            local: set[int] = set()
            for o in run:
                for d in deps[o]:
                    pending[d] -= 1
                for v in outs[o]:
                    if pending[v] > 0 or v == u:
                        local.add(v)
                    if rc[v] > 0:
                        cache.add(v)
                # While the op runs its inputs and all its outputs are alive together: an input
                # used here for the last time is freed only after the op returns.
                peak = max(peak, held(local | set(outs[o])))
                for d in deps[o]:
                    rc[d] -= 1
                    if rc[d] <= 0:
                        cache.discard(d)
                    if pending[d] <= 0 and d != u:
                        local.discard(d)
        rc[u] -= 1
        if rc[u] <= 0:
            cache.discard(u)
        after = held()
        peaks[k], afters[k] = max(peak, after), after
    return peaks, afters
