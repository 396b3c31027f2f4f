"""Measuring memory on any device: a storage-counting dispatch mode.

On CUDA the caching allocator's statistics are the ground truth; on CPU there is none, so
:class:`StorageCounter` counts the bytes of every storage that ops create while it is active
and notices their release through weak references (storages keep one Python object for their
whole life, so the reference dies exactly when the storage is freed). It sees what the
dispatcher sees: everything ATen allocates for tensors, not allocator caching or workspace.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .tape import flatten_outputs


class StorageCounter(TorchDispatchMode):
    """Counts live bytes of tracked storages: current, peak, and the total ever allocated.

    Storages that existed before the mode was entered count only if passed to :meth:`track`
    (parameters, gradients, optimizer state). ``mark()`` starts a new peak window.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocated_bytes = 0
        """Sum of the sizes of all storages created while active (never decreases)."""
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _add(self, st: torch.UntypedStorage, new: bool) -> None:
        key = id(st)
        ref = self._refs.get(key)
        if ref is not None and ref() is st:
            return
        n = st.nbytes()
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._release(k))
        self._sizes[key] = n
        self.live_bytes += n
        if new:
            self.allocated_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count already-existing tensors (their storages, once each) as live."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), new=False)

    def mark(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [o for o in flatten_outputs(out) if isinstance(o, torch.Tensor) and o.device.type != "meta"]
        if not outs:
            return out
        inputs = {id(_storage(a)) for a in _tensor_args(args, kwargs)}
        for o in outs:
            st = _storage(o)
            if st is not None and id(st) not in inputs:  # views and in-place results allocate nothing
                self._add(st, new=True)
        return out


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _tensor_args(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


# Meters ------------------------------------------------------------------------------------------

class CudaMeter:
    """Allocator truth on CUDA: bytes allocated now, and the peak since the last mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def mark(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        self.mark()

    def stop(self) -> None:
        pass


class CpuMeter:
    """Storage counting on CPU (see :class:`StorageCounter`), active between start and stop."""

    def __init__(self, track: Iterable[torch.Tensor] = ()) -> None:
        self.counter = StorageCounter()
        self._track = list(track)

    def current(self) -> int:
        return self.counter.live_bytes

    def peak(self) -> int:
        return self.counter.peak_bytes

    def mark(self) -> None:
        self.counter.mark()

    def start(self) -> None:
        self.counter.track(self._track)
        self._track = []
        self.counter.__enter__()
        self.mark()

    def stop(self) -> None:
        self.counter.__exit__(None, None, None)


def meter_for(device: torch.device, track: Iterable[torch.Tensor] = ()):
    return CudaMeter(device) if device.type == "cuda" else CpuMeter(track)


# The step-peak model --------------------------------------------------------------------------------

@dataclasses.dataclass
class Window:
    """A stretch of a profiled (replay-only) step, and what a plan adds to it."""

    label: str
    peak_bytes: float
    """Measured peak in the window, with nothing kept."""
    alive: list[int]
    """Blocks whose kept values are alive throughout the window."""
    replay_block: int | None = None
    """The block whose backward replays in this window (its transient changes with the plan)."""


@dataclasses.dataclass
class StepMemory:
    """Step-peak model: peak of window w = measured + kept of alive blocks + transient change.

    The baseline in every window is measured (parameters, gradients, optimizer state,
    activations outside the blocks, FSDP all-gather and prefetch buffers), never a formula. A
    plan changes it by what the blocks keep and by how much the replaying block's transient
    differs from replay-only; the limit applies to the largest window.
    """

    windows: list[Window]

    def predict(self, kept: dict[int, float], transient_delta: dict[int, float]) -> float:
        """Predicted step peak for per-block kept bytes and transient changes vs replay-only."""
        return max(
            w.peak_bytes + sum(kept.get(b, 0.0) for b in w.alive)
            + (transient_delta.get(w.replay_block, 0.0) if w.replay_block is not None else 0.0)
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
        """Element-wise maximum over ranks (same window layout): the plan must fit the worst."""
        first = models[0]
        if any(len(m.windows) != len(first.windows) for m in models):
            raise ValueError("memory traces of the ranks have different window layouts")
        return StepMemory([dataclasses.replace(w, peak_bytes=max(m.windows[i].peak_bytes for m in models))
                           for i, w in enumerate(first.windows)])


class MemoryTrace:
    """Collects window boundaries during a profiling step and builds the :class:`StepMemory`.

    Boundaries: ``fwd_start``/``fwd_end`` of each block, ``bwd_start`` at a block's first unpack,
    and ``end`` after the step. A block's backward window runs until the next boundary; its kept
    values are counted alive until the next block's backward starts.
    """

    def __init__(self, meter) -> None:
        self.meter = meter
        self.events: list[tuple[str, int | None, float, float]] = []
        """(kind, block, peak since the previous boundary, replay transient peak in that stretch)"""
        self._replayer = None
        self.started = False

    def start(self) -> None:
        self.meter.start()
        self.started = True
        self.events.append(("start", None, float(self.meter.current()), 0.0))

    def boundary(self, kind: str, block: int | None = None, replayer=None) -> None:
        if not self.started:
            return
        transient = 0.0
        if self._replayer is not None:
            transient = float(self._replayer.transient_peak_bytes)
            self._replayer.track_transient = False
        self.events.append((kind, block, float(self.meter.peak()), transient))
        self.meter.mark()
        self._replayer = replayer
        if replayer is not None:
            replayer.track_transient = True
            replayer.transient_peak_bytes = 0

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
        for (kind, block, _p, _t), (_k2, _b2, peak, transient) in zip(ev, ev[1:]):
            if kind == "start":
                windows.append(Window("before blocks", peak, []))
                continue
            if kind == "fwd_start":
                windows.append(Window(f"forward of block {block}", peak, done_fwd + [block]))
            elif kind == "fwd_end":
                done_fwd.append(block)
                windows.append(Window(f"after forward of block {block}", peak, list(done_fwd)))
            elif kind == "bwd_start":
                if replaying is not None:
                    done_bwd.add(replaying)
                replaying = block
                alive = [b for b in done_fwd if b not in done_bwd]
                # The measured peak includes the replay-only transient; the plan's is added back.
                windows.append(Window(f"backward of block {block}", peak, alive, replay_block=block))
        return StepMemory(windows)
