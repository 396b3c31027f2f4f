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
