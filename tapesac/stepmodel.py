"""The step-peak model: what one optimizer step's memory looks like, and what a plan adds to it.

A *step* is one optimizer step (or one explicit ``handle.step()``): every forward and backward of
every wrapped block between two step boundaries, whatever the loop shape (micro-batches with all
forwards first or interleaved, blocks applied more than once, outputs fanned out, a retained
graph's second backward). Each forward of a block is a *recording*; a recording's kept values
live from its forward until its backward replays it or its graph is freed.

:class:`StepTrace` follows a profiled (replay-only) step through events and cuts it into
windows; :class:`StepMemory` (plain data, what the planner reads) predicts the peak of a step
that runs the same program under a plan:

    peak(w) = measured replay-only peak of w
              + sum over the other live recordings r in w of kept_bytes(block of r)
              + the replaying recording's own change in w (see ``tapesac.planner.replay_deltas``)

The limit applies to the largest window. A block recorded twice and alive twice counts twice.

A trace shows only the backwards its step ran. A step that retains a graph for a second
backward holds, through its first backward, everything autograd would otherwise free as it goes
(saved tensors outside the blocks, block inputs, whatever pass-through blocks saved) while the
gradients are allocated; a trace of a step that freed its graph cannot show that. Such steps are
traced on their own and planned with :meth:`StepMemory.union` (``tapesac.autoplan``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .meter import StepMeter


@dataclasses.dataclass
class Window:
    """A stretch of a profiled (replay-only) step, and what a plan adds to it."""

    label: str
    peak_bytes: float
    """Measured peak in the window, with nothing kept."""
    alive: list[int]
    """Blocks of the recordings whose kept values are alive in the window, one entry per
    recording (a block recorded twice and alive twice appears twice); the replaying recording
    is not among them."""
    replay_block: int | None = None
    """The block whose recording replays in this window; its own memory changes with the plan."""
    intervals: list[float] | None = None
    """Replay windows: measured peak between consecutive unpacks (the k-th from the start of
    unpack k to the start of unpack k+1; the last runs to the window's end)."""
    unpacks: list[int] | None = None
    """Replay windows: the values unpacked, in order (matched against the block graph's order)."""


    def active_block(self) -> int | None:
        """The block running in this window: the one replaying, or the one recording its forward."""
        if self.replay_block is not None:
            return self.replay_block
        if self.label.startswith("forward of block "):
            return int(self.label.rsplit(" ", 1)[1])
        return None


@dataclasses.dataclass
class StepMemory:
    """The windows of one profiled step (see the module docstring for the formula)."""

    windows: list[Window]

    def predict(self, kept: dict[int, float], replay_delta: dict[int, float]) -> float:
        """Predicted step peak for per-block kept bytes and per-window replay changes
        (``replay_delta`` is keyed by window index)."""
        return max(
            (w.peak_bytes + sum(kept.get(b, 0.0) for b in w.alive) + replay_delta.get(i, 0.0)
             for i, w in enumerate(self.windows)),
            default=0.0,
        )

    def baseline_peak(self) -> float:
        return max((w.peak_bytes for w in self.windows), default=0.0)

    def backwards_twice(self) -> bool:
        """Some recording was backwarded more than once (a retained graph): a block appears in
        more replay windows than it has recordings."""
        replays: dict[int, int] = {}
        for w in self.windows:
            if w.replay_block is not None:
                replays[w.replay_block] = replays.get(w.replay_block, 0) + 1
        recorded: dict[int, int] = {}
        for w in self.windows:
            if w.label.startswith("forward of block "):
                b = int(w.label.rsplit(" ", 1)[1])
                recorded[b] = recorded.get(b, 0) + 1
        return any(n > recorded.get(b, 0) for b, n in replays.items())

    def replay_windows(self) -> list[int]:
        return [i for i, w in enumerate(self.windows) if w.replay_block is not None]

    def to_json(self) -> dict[str, Any]:
        return {"windows": [dataclasses.asdict(w) for w in self.windows]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StepMemory":
        return cls([Window(**w) for w in data["windows"]])

    @staticmethod
    def union(models: list["StepMemory"]) -> "StepMemory":
        """Every window of every model: a plan that fits the union fits each of the steps they
        were traced from. For steps of one program whose backwards differ (a graph retained for a
        second backward in some steps only), which no single trace shows."""
        return StepMemory([w for m in models for w in m.windows])

    @staticmethod
    def merge_max(models: list["StepMemory"]) -> "StepMemory":
        """Element-wise maximum over steps or ranks (same layout): the plan must fit the worst.
        Raises ValueError when the layouts differ (a different program)."""
        first = models[0]
        for m in models[1:]:
            if len(m.windows) != len(first.windows) or any(
                    (a.alive, a.replay_block) != (b.alive, b.replay_block)
                    for a, b in zip(m.windows, first.windows)):
                raise ValueError("memory traces have different window layouts")
        merged = []
        for i, w in enumerate(first.windows):
            peak = max(m.windows[i].peak_bytes for m in models)
            intervals, unpacks = w.intervals, w.unpacks
            if intervals is not None:
                all_iv = [m.windows[i].intervals for m in models]
                same = all(m.windows[i].unpacks == unpacks for m in models)
                if not same or any(iv is None or len(iv) != len(intervals) for iv in all_iv):
                    intervals = unpacks = None
                else:
                    intervals = [max(x) for x in zip(*all_iv)]
            merged.append(dataclasses.replace(w, peak_bytes=peak, intervals=intervals, unpacks=unpacks))
        return StepMemory(merged)


class StepTrace:
    """Cuts one traced step into :class:`Window` s from recording events.

    Events: ``forward_start``/``forward_end`` of a recording, ``unpack`` (a recording's backward
    asks for a value: the first one of a pass opens its replay window, later ones split it into
    intervals), ``released`` (a recording's graph is gone: its kept values with it), ``finish``.
    A window ends at the next forward or replay event; releases only update the live set, so the
    live set of a window is the one at its start (a superset of what is live later in it).
    """

    def __init__(self, meter: StepMeter) -> None:
        """``meter`` must be ``live``: each window's peak is read as the window closes."""
        self.meter = meter
        self.windows: list[Window] = []
        self.started = False
        self._live: dict[int, int] = {}
        """recording id -> block, for recordings whose kept values are alive."""
        self._replaying: int | None = None
        self._current: Window | None = None

    def start(self) -> None:
        self.meter.start()
        self.started = True
        self._open("before blocks", None)

    def _open(self, label: str, replay_block: int | None) -> None:
        self._current = Window(label, 0.0, list(self._live.values()), replay_block,
                               [] if replay_block is not None else None,
                               [] if replay_block is not None else None)
        self.meter.mark()

    def _close(self) -> None:
        w = self._current
        if w is None:
            return
        peak = float(self.meter.peak())
        if w.intervals is not None:
            w.intervals.append(peak)
            peak = max(w.intervals)
        w.peak_bytes = peak
        self.windows.append(w)
        self._current = None

    # Events ------------------------------------------------------------------------------------

    def forward_start(self, rid: int, block: int) -> None:
        if not self.started:
            return
        self._close()
        self._replaying = None
        self._live[rid] = block
        self._open(f"forward of block {block}", None)

    def forward_end(self, rid: int, block: int) -> None:
        if not self.started:
            return
        self._close()
        self._open(f"after forward of block {block}", None)

    def unpack(self, rid: int, block: int, vid: int) -> None:
        if not self.started:
            return
        w = self._current
        if rid != self._replaying or w is None or w.replay_block is None:
            self._close()
            self._live.pop(rid, None)
            self._replaying = rid
            self._open(f"backward of block {block}", block)
            w = self._current
        else:
            w.intervals.append(float(self.meter.peak()))
            self.meter.mark()
        w.unpacks.append(vid)

    def released(self, rid: int) -> None:
        self._live.pop(rid, None)

    def finish(self) -> StepMemory:
        """Close the last window, stop the meter, and return the model."""
        self._close()
        self.meter.stop()
        self.started = False
        return StepMemory(self.windows)

    def abort(self) -> None:
        if self.started:
            self.meter.stop()
            self.started = False

    def unpack_orders(self) -> dict[int, list[int]]:
        """Per block, the values the first replay window of that block unpacked, in order."""
        orders: dict[int, list[int]] = {}
        for w in self.windows:
            if w.replay_block is not None and w.replay_block not in orders:
                orders[w.replay_block] = list(w.unpacks or [])
        return orders
