"""Measuring memory on any device: a storage-counting dispatch mode.

On CUDA the caching allocator's statistics are the ground truth; on CPU there is none, so
:class:`StorageCounter` counts the bytes of every storage that ops create while it is active
and notices their release through weak references (storages keep one Python object for their
whole life, so the reference dies exactly when the storage is freed). It sees what the
dispatcher sees: everything ATen allocates for tensors, not allocator caching or workspace.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .tape import flatten_outputs


_active_counters: list["StorageCounter"] = []
_original_resize = None
_own_resize = False


def _counting_resize(storage, size):
    before = storage.nbytes()
    out = _original_resize(storage, size)
    for counter in _active_counters:
        counter._resized(storage, before)
    return out


class StorageCounter(TorchDispatchMode):
    """Counts live bytes of tracked storages: current, peak, and the total ever allocated.

    Storages that existed before the mode was entered count only if passed to :meth:`track`
    (parameters, gradients, optimizer state). ``mark()`` starts a new peak window. In-place
    storage resizes (FSDP2 frees and re-gathers unsharded parameters with
    ``untyped_storage().resize_()``, which the dispatcher never sees) are counted too.
    """

    def __enter__(self):
        global _original_resize, _own_resize
        if not _active_counters:
            _own_resize = "resize_" in torch.UntypedStorage.__dict__
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _counting_resize
        _active_counters.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _active_counters.remove(self)
            if not _active_counters:
                if _own_resize:
                    torch.UntypedStorage.resize_ = _original_resize
                else:
                    del torch.UntypedStorage.resize_

    def _resized(self, st: torch.UntypedStorage, before: int) -> None:
        key = id(st)
        ref = self._refs.get(key)
        if ref is None or ref() is not st:
            return
        after = st.nbytes()
        self._sizes[key] = after
        self.live_bytes += after - before
        if after > before:
            self.allocated_bytes += after - before
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

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
