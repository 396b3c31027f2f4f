"""The step-peak model the planner reads: measured windows of a profiled step and what a plan
adds to them (:class:`StepMemory`), built by :class:`MemoryTrace` from any meter's readings.

This module holds plain data and arithmetic only; the meters themselves (allocator statistics,
the CPU storage counter) live in :mod:`tapesac.meter`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class Meter(Protocol):
    """What :class:`MemoryTrace` reads (``tapesac.meter`` has the CUDA and CPU ones): bytes live
    now and the peak since the last ``mark``, in bytes, between ``start`` and ``stop``."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def mark(self) -> None: ...
    def current(self) -> int: ...
    def peak(self) -> int: ...


@dataclasses.dataclass
class Window:
    """A stretch of a profiled (replay-only) step, and what a plan adds to it."""

    label: str
    peak_bytes: float
    """Measured peak in the window, with nothing kept."""
    alive: list[int]
    """Blocks whose kept values are alive throughout the window."""
    replay_block: int | None = None
    """The block whose backward replays in this window; its own memory changes with the plan."""
    intervals: list[float] | None = None
    """Replay windows: measured peak between consecutive unpacks (the k-th from the start of
    unpack k to the start of unpack k+1; the last runs to the window's end)."""


@dataclasses.dataclass
class StepMemory:
    """Step-peak model. Peak of window w under a plan = measured replay-only peak + bytes kept
    by the blocks alive in w + the change of the replaying block's own memory.

    The baseline in every window is measured (parameters, gradients, optimizer state, activations
    outside the blocks, FSDP all-gather and prefetch buffers), never a formula. The replaying
    block's change is resolved per unpack interval (see ``tapesac.planner.simulate``); the limit
    applies to the largest window.
    """

    windows: list[Window]

    def predict(self, kept: dict[int, float], replay_delta: dict[int, float]) -> float:
        """Predicted step peak for per-block kept bytes and replaying blocks' own changes."""
        return max(
            w.peak_bytes + sum(kept.get(b, 0.0) for b in w.alive if b != w.replay_block)
            + (replay_delta.get(w.replay_block, 0.0) if w.replay_block is not None else 0.0)
            for w in self.windows
        )

    def baseline_peak(self) -> float:
        return max(w.peak_bytes for w in self.windows)

    def to_json(self) -> dict:
        return {"windows": [dataclasses.asdict(w) for w in self.windows]}

    @classmethod
    def from_json(cls, data: dict) -> "StepMemory":
        return cls([Window(**w) for w in data["windows"]])

    @staticmethod
    def merge_max(models: list["StepMemory"]) -> "StepMemory":
        """Element-wise maximum over steps or ranks (same layout): the plan must fit the worst."""
        first = models[0]
        if any(len(m.windows) != len(first.windows) for m in models):
            raise ValueError("memory traces have different window layouts")
        merged = []
        for i, w in enumerate(first.windows):
            peak = max(m.windows[i].peak_bytes for m in models)
            intervals = w.intervals
            if intervals is not None:
                all_iv = [m.windows[i].intervals for m in models]
                if any(iv is None or len(iv) != len(intervals) for iv in all_iv):
                    intervals = None
                else:
                    intervals = [max(x) for x in zip(*all_iv)]
            merged.append(dataclasses.replace(w, peak_bytes=peak, intervals=intervals))
        return StepMemory(merged)


class MemoryTrace:
    """Collects window boundaries during a profiling step and builds the :class:`StepMemory`.

    Boundaries: ``fwd_start``/``fwd_end`` of each block, ``bwd_start`` at a block's first unpack,
    every further unpack of that block (interval boundaries inside its window), and ``end``.
    A block's backward window runs to the next boundary; its kept values count as alive until
    the next block's backward starts.
    """

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.events: list[tuple[str, int | None, float, list[float] | None]] = []
        """(kind, block, peak since the previous boundary, intervals of a closed replay window)"""
        self.unpack_orders: dict[int, list[int]] = {}
        """Per block, the values its backward unpacked, in order."""
        self._intervals: list[float] | None = None
        self.started = False

    def start(self) -> None:
        self.meter.start()
        self.started = True
        self.events.append(("start", None, float(self.meter.current()), None))

    def boundary(self, kind: str, block: int | None = None, replayer=None) -> None:
        if not self.started:
            return
        peak = float(self.meter.peak())
        intervals = None
        if self._intervals is not None:
            intervals = self._intervals + [peak]
            peak = max(intervals)
            self._intervals = None
        self.events.append((kind, block, peak, intervals))
        self.meter.mark()
        if replayer is not None:  # a block's backward starts: trace its unpacks
            self._intervals = []
            replayer.unpack_log = self.unpack_orders.setdefault(block, [])
            replayer.on_unpack = self._unpack

    def _unpack(self, replayer) -> None:
        if not replayer.unpack_log:  # the first unpack opens the first interval
            return
        self._intervals.append(float(self.meter.peak()))
        self.meter.mark()

    def finish(self) -> StepMemory:
        self.boundary("end")
        self.meter.stop()
        self.started = False
        return self.model()

    def model(self) -> StepMemory:
        windows: list[Window] = []
        done_fwd: list[int] = []
        done_bwd: set[int] = set()
        replaying: int | None = None
        ev = self.events
        for (kind, block, _p, _i), (_k2, _b2, peak, intervals) in zip(ev, ev[1:]):
            if kind == "start":
                windows.append(Window("before blocks", peak, []))
            elif kind == "fwd_start":
                windows.append(Window(f"forward of block {block}", peak, done_fwd + [block]))
            elif kind == "fwd_end":
                done_fwd.append(block)
                windows.append(Window(f"after forward of block {block}", peak, list(done_fwd)))
            elif kind == "bwd_start":
                if replaying is not None:
                    done_bwd.add(replaying)
                replaying = block
                alive = [b for b in done_fwd if b not in done_bwd]
                windows.append(Window(f"backward of block {block}", peak, alive, replay_block=block,
                                      intervals=intervals))
        return StepMemory(windows)


def fmt_bytes(n: float) -> str:
    """Bytes for people: 1.50 GiB, 312.0 MiB, 4.0 KiB, 12 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"
