"""Measuring memory on any device: allocator statistics on CUDA, a storage counter on CPU.

On CUDA the caching allocator's statistics are the ground truth. On CPU there are none, so
:class:`StorageCounter` counts the bytes of tensor storages while it is active.

What the counter sees:

* every storage an ATen op returns while the counter is on the dispatch mode stack (an output
  whose storage is none of the op's inputs'), from its creation until its Python object dies
  (storages keep one Python object for their whole life, so a weak reference dies exactly when
  the storage is freed), on whatever thread that happens, also after the counter has stopped;
* every in-place storage resize (``UntypedStorage.resize_``, which the dispatcher never sees),
  including storages it has not seen before: a storage that grows while the counter is active
  counts its growth from then on, and a shrink of a counted storage is uncounted. This is how
  FSDP2 unshards (``resize_(n)`` of a storage made once, then an all-gather copied into it) and
  reshards (``resize_(0)``);
* storages that existed before it started only if handed to :meth:`StorageCounter.track`.

What it does not see (an allocator-level meter, e.g. the profiler's ``[memory]`` events, does,
though those miss frees on threads the profiler does not follow, such as gloo's workers):

* the allocator's own behaviour: caching, rounding and fragmentation (it counts requested bytes);
* allocations that are never a dispatched op's output: workspace and temporaries inside a
  kernel, staging buffers inside a collective's implementation (gloo, NCCL), memory that
  libraries outside ATen allocate (numpy, Python objects);
* ops dispatched while it is not on the current thread's mode stack (the stack is thread
  local; autograd carries it into its own threads);
* a wrapper subclass's own storage (a DTensor's has its global size and no data): it counts the
  storages of the inner tensors instead (a DTensor's local shard).

TapeSAC's own work with the modes off (fingerprints) reports itself: :func:`count_transient`
and :func:`count_own`.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Iterable, Protocol

import torch
import torch.utils._python_dispatch as python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .errors import TapeSACError
from .tape import flatten_outputs


# Storage counting --------------------------------------------------------------------------------
#
# Invariants the counter keeps:
#   1. Leaving removes exactly this counter from the dispatch mode stack, wherever it is; modes
#      entered after it (a FlopCounterMode around a step, a second counter) stay, in order.
#      ``enter_below`` puts it under every mode already there, so that a mode entered before it
#      and left while it is active (the user's, around a step boundary) still pops itself.
#   2. Its own bookkeeping runs no ops, so no other mode below it sees (or counts) anything the
#      counter does; two active counters each count every real allocation once.
#   3. A storage is counted at most once per counter, under the bytes this counter attributes to
#      it (``_sizes``); its release or shrink subtracts exactly those bytes.
#   4. Releases may arrive on any thread (a gloo worker thread drops the last reference to a
#      collective's buffer): every update of the counts holds the counter's lock.

_active_counters: list["StorageCounter"] = []
_original_resize = None
_own_resize = False


def _counting_resize(storage, size):
    before = storage.nbytes()
    out = _original_resize(storage, size)
    for counter in _active_counters:
        counter._resized(storage, before)
    return out


def _install_resize_hook() -> None:
    global _original_resize, _own_resize
    _own_resize = "resize_" in torch.UntypedStorage.__dict__
    _original_resize = torch.UntypedStorage.resize_
    torch.UntypedStorage.resize_ = _counting_resize


def _remove_resize_hook() -> None:
    if _own_resize:
        torch.UntypedStorage.resize_ = _original_resize
    else:
        del torch.UntypedStorage.resize_


class StorageCounter(TorchDispatchMode):
    """Counts live bytes of tracked storages: current, peak, and the total ever allocated.

    Storages that existed before the mode was entered count only if passed to :meth:`track`
    (parameters, gradients, optimizer state), or from the moment they grow through
    ``UntypedStorage.resize_``. ``mark()`` starts a new peak window. See the module docstring
    for what it sees and what it does not.

    It may be entered at one step boundary and exited at a later one, with other dispatch modes
    entered and exited in between: exiting takes only this counter off the stack (invariant 1).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocated_bytes = 0
        """Sum of the sizes of all storages created, and of all growth, while active (never
        decreases)."""
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}
        """Bytes this counter attributes to each counted storage (id -> bytes)."""
        self._lock = threading.RLock()  # invariant 4; re-entrant: gc may free a storage mid-update

    def __enter__(self):
        if not _active_counters:
            _install_resize_hook()
        _active_counters.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            if python_dispatch._get_current_dispatch_mode() is self:
                return super().__exit__(*exc)
            _leave_dispatch_stack(self)  # invariant 1
            return None
        finally:
            if self in _active_counters:  # not when left twice (an error above)
                _active_counters.remove(self)
                if not _active_counters:
                    _remove_resize_hook()

    def enter_below(self) -> "StorageCounter":
        """Enter at the bottom of the dispatch mode stack: it still sees every op the modes
        above pass down, and their own last-in, first-out exits stay correct (invariant 1)."""
        depth = python_dispatch._len_torch_dispatch_stack()
        above = [python_dispatch._pop_torch_dispatch_stack(None) for _ in range(depth)]
        above.reverse()
        # The flags each mode above saved on entry described the stack below it; with this
        # counter under all of them, "a mode is active" holds for every one of them.
        non_infra, without_ignore = (python_dispatch._is_in_non_infra_torch_dispatch_mode,
                                     python_dispatch._is_in_any_mode_without_ignore_compile_internals)
        python_dispatch._is_in_torch_dispatch_mode = False
        python_dispatch._is_in_non_infra_torch_dispatch_mode = False
        python_dispatch._is_in_any_mode_without_ignore_compile_internals = False
        self.__enter__()
        below_in, below_non_infra, below_without = True, not self.is_infra_mode(), not self.ignore_compile_internals()
        for m in above:
            python_dispatch._push_on_torch_dispatch_stack(m)
            if getattr(m, "old_dispatch_mode_flags", None):
                m.old_dispatch_mode_flags[-1] = below_in
                m.old_non_infra_dispatch_mode_flags[-1] = m.old_non_infra_dispatch_mode_flags[-1] or below_non_infra
                m.old_without_ignore_compile_internals_dispatch_mode_flags[-1] = (
                    m.old_without_ignore_compile_internals_dispatch_mode_flags[-1] or below_without)
            below_non_infra = below_non_infra or not m.is_infra_mode()
            below_without = below_without or not m.ignore_compile_internals()
        python_dispatch._is_in_torch_dispatch_mode = True
        python_dispatch._is_in_non_infra_torch_dispatch_mode = non_infra or below_non_infra
        python_dispatch._is_in_any_mode_without_ignore_compile_internals = without_ignore or below_without
        python_dispatch.set_is_in_mode_without_ignore_compile_internals(
            python_dispatch._is_in_any_mode_without_ignore_compile_internals)
        return self

    # Bookkeeping (invariant 2: no torch ops in here) --------------------------------------------

    def _count(self, st: torch.UntypedStorage, nbytes: int, new: bool) -> None:
        key = id(st)
        self._refs[key] = weakref.ref(st, lambda ref, k=key: self._release(k, ref))
        self._sizes[key] = nbytes
        self._grow(nbytes, new)

    def _grow(self, nbytes: int, new: bool) -> None:
        self.live_bytes += nbytes
        if new:
            self.allocated_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _counted(self, st: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(st))
        return ref is not None and ref() is st

    def _release(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            if self._refs.get(key) is ref:  # not a later storage that reuses the id
                self.live_bytes -= self._sizes.pop(key)
                del self._refs[key]

    def _add(self, st: torch.UntypedStorage, new: bool) -> None:
        with self._lock:
            if not self._counted(st):  # invariant 3
                self._count(st, st.nbytes(), new)

    def _resized(self, st: torch.UntypedStorage, before: int) -> None:
        with self._lock:
            self._follow_resize(st, before, st.nbytes())

    def _follow_resize(self, st: torch.UntypedStorage, before: int, after: int) -> None:
        if not self._counted(st):
            if after > before:  # e.g. an FSDP2 unshard into a storage made before we started
                self._count(st, after - before, new=True)
            return  # a shrink of bytes we never counted is not ours to subtract
        key = id(st)
        counted = self._sizes[key]
        now = min(after, max(0, counted + after - before))
        self._sizes[key] = now
        if now > counted:
            self._grow(now - counted, new=True)
        else:
            self.live_bytes -= counted - now

    def counted_bytes(self, st: torch.UntypedStorage) -> int:
        """Bytes of ``st`` this counter counts as live now (0 for a storage it does not count)."""
        return self._sizes[id(st)] if self._counted(st) else 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count already-existing tensors (their storages, once each) as live."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                for st in _storages(t):
                    self._add(st, new=False)

    def mark(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [o for o in flatten_outputs(out) if isinstance(o, torch.Tensor) and o.device.type != "meta"]
        if not outs:
            return out
        inputs = {id(st) for a in _tensor_args(args, kwargs) for st in _storages(a)}
        for o in outs:
            for st in _storages(o):
                if id(st) not in inputs:  # views and in-place results allocate nothing
                    self._add(st, new=True)
        return out


def count_transient(nbytes: int) -> None:
    """Memory TapeSAC's own work allocates and frees again with the dispatch modes off (a
    fingerprint's temporaries): every active counter's peak rises as if ``nbytes`` were allocated
    now, on top of what is live. Bookkeeping only (invariant 2)."""
    for counter in list(_active_counters):
        with counter._lock:
            if counter.live_bytes + nbytes > counter.peak_bytes:
                counter.peak_bytes = counter.live_bytes + nbytes


def count_own(t: torch.Tensor) -> None:
    """A tensor TapeSAC's own work made with the dispatch modes off and keeps (a fingerprint):
    every active counter counts its storage from now until it is freed, as if an op had made it."""
    for counter in list(_active_counters):
        for st in _storages(t):
            counter._add(st, new=True)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``t``'s data: its own, or for a wrapper subclass (DTensor, whose
    own storage has the global size and no data) those of its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ctx = t.__tensor_flatten__()
        inner = (getattr(t, a) for a in attrs)
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def _tensor_args(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _leave_dispatch_stack(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch mode stack from below other modes, which stay in order.

    ``TorchDispatchMode.__exit__`` pops whatever is on top and restores flags (is any mode
    active, any non-infra mode, ...) that each mode saved when it was entered; both assume
    last-in, first-out. Here the modes above ``mode`` are popped, ``mode`` is popped, and they are
    pushed back; the flags ``mode`` saved pass to the first mode above it, and those above are
    recomputed, so that each restores, on its own exit, what the stack without ``mode`` implies.
    """
    depth = python_dispatch._len_torch_dispatch_stack()
    if not any(python_dispatch._get_dispatch_stack_at(i) is mode for i in range(depth)):
        raise TapeSACError(f"{type(mode).__name__} left twice, or left on another thread than it "
                           "was entered on: it is not on this thread's dispatch mode stack")
    above = []
    while (top := python_dispatch._pop_torch_dispatch_stack(None)) is not mode:
        above.append(top)
    above.reverse()
    for m in above:
        python_dispatch._push_on_torch_dispatch_stack(m)

    # What the stack below ``mode`` implied when it was entered, then each mode above folded in.
    in_mode = mode.old_dispatch_mode_flags.pop()
    non_infra = mode.old_non_infra_dispatch_mode_flags.pop()
    without_ignore = mode.old_without_ignore_compile_internals_dispatch_mode_flags.pop()
    for m in above:
        if getattr(m, "old_dispatch_mode_flags", None):  # entered through TorchDispatchMode.__enter__
            m.old_dispatch_mode_flags[-1] = in_mode
            m.old_non_infra_dispatch_mode_flags[-1] = non_infra
            m.old_without_ignore_compile_internals_dispatch_mode_flags[-1] = without_ignore
        in_mode = True
        non_infra = non_infra or not m.is_infra_mode()
        without_ignore = without_ignore or not m.ignore_compile_internals()
    python_dispatch._is_in_torch_dispatch_mode = in_mode
    python_dispatch._is_in_non_infra_torch_dispatch_mode = non_infra
    python_dispatch._is_in_any_mode_without_ignore_compile_internals = without_ignore
    python_dispatch.set_is_in_mode_without_ignore_compile_internals(without_ignore)


# Meters ------------------------------------------------------------------------------------------

class StepMeter(Protocol):
    """What planned mode asks of a memory meter over one step; every meter here is one.

    ``start()`` at the step's start, ``stop()`` once at its end (also for a step given up half
    way); ``mark()`` starts a new peak window and ``peak()`` is the peak of the window in bytes.
    A ``live`` meter reads its peak while it runs (what :class:`tapesac.stepmodel.StepTrace`
    needs to cut a step into windows); the others know it only once stopped."""

    live: bool
    """Whether :meth:`peak` may be read before :meth:`stop`."""

    def start(self) -> None: ...
    def mark(self) -> None: ...
    def peak(self) -> int: ...
    def stop(self) -> None: ...


class CudaMeter:
    """Allocator truth on CUDA: bytes allocated now, and the peak since the last mark."""

    live = True

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

    live = True

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
        self.counter.enter_below()  # a step boundary may fall inside the user's own modes
        self.mark()

    def stop(self) -> None:
        self.counter.__exit__(None, None, None)


class AllocatorPeak:
    """An independent meter for CPU code, from the PyTorch profiler's allocator events: inside
    ``with AllocatorPeak() as m:``, the highest running total of the CPU allocator's allocations
    minus frees, relative to the start (``m.peak_bytes``), and what is left at the end
    (``m.left_bytes``). It also sees what the storage counter does not (kernel temporaries,
    compiled code's buffers); it misses frees on threads the profiler does not follow (gloo's).

    The profiler reports the free of a block only if the block was allocated while a profiler
    ran (the CPU allocator's size table is filled only then). Storages passed as ``watch``,
    allocated before, are subtracted when they are freed inside the window: a weak reference on
    each marks the moment in the profiler's own event stream (invariant 2 of the counter holds:
    the mark runs no op), unless the profiler reported that free itself (a block allocated under
    an earlier profiler: its free event at the same address)."""

    def __init__(self, watch: Iterable[torch.UntypedStorage] = ()) -> None:
        self.peak_bytes = 0
        self.left_bytes = 0
        self._watch = {st._cdata: st for st in watch if st.nbytes() > 0}
        self._refs: list[weakref.ref] = []

    def __enter__(self) -> "AllocatorPeak":
        self._refs = [weakref.ref(st, _mark_free(st.data_ptr(), st.nbytes())) for st in self._watch.values()]
        self._watch = {}  # only weakly held from here on: their frees are what is watched
        _start_session()
        return self

    def mark(self) -> None:
        """Start a new peak window: ``peak_bytes`` is the highest total from here on. A profiler
        event marks the moment, as the free marks do (no op runs)."""
        with torch._C._profiler._RecordFunctionFast(_WINDOW_MARK):
            pass

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType

        results = _stop_session()
        self._refs = []
        changes: list[tuple[int, int, int, str]] = []  # (time, ptr, bytes, "alloc", "freed" or "window")
        stack = list(results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                changes.append((node.start_time_ns, fields.ptr, fields.alloc_size, "alloc"))
            elif node.name.startswith(_FREE_MARK):
                ptr, nbytes = (int(x) for x in node.name[len(_FREE_MARK):].split(","))
                changes.append((node.start_time_ns, ptr, -nbytes, "freed"))
            elif node.name == _WINDOW_MARK:
                changes.append((node.start_time_ns, 0, 0, "window"))
        changes.sort(key=lambda c: c[0])
        allocated: set[int] = set()  # blocks allocated in the window, not freed yet
        reported: set[int] = set()  # blocks from before the window whose free the profiler reported
        for _ns, ptr, nbytes, kind in changes:
            if kind != "alloc":
                continue
            if nbytes > 0:
                allocated.add(ptr)
            elif ptr in allocated:
                allocated.discard(ptr)
            else:
                reported.add(ptr)
        live = peak = 0
        for _ns, ptr, nbytes, kind in changes:
            if kind == "window":
                peak = live
                continue
            if kind == "freed" and ptr in reported:
                continue
            live += nbytes
            peak = max(peak, live)
        self.peak_bytes, self.left_bytes = peak, live


_FREE_MARK = "tapesac.freed:"
_WINDOW_MARK = "tapesac.window"


def _start_session() -> None:
    """Start a CPU profiling session that records allocator events and function-scope record
    functions only (ATen ops, the free marks of :func:`_mark_free`), which open and close inside
    it. A record function of Python code (user scope) can open in one session and close in the
    next: step boundaries run inside ``optimizer.step``'s, where one session stops and the next
    starts. Had the first recorded its start, the profiler would write its end into that
    session's freed events (torch 2.13: valgrind shows the write in ``onFunctionExit``; it
    corrupted the heap and aborted test processes). Not through ``torch.profiler.profile``, whose
    objects keep the results in reference cycles until some later garbage collection."""
    from torch._C._autograd import _enable_profiler, _prepare_profiler
    from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope,
                                    _ExperimentalConfig)

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.FUNCTION})
    torch.autograd.profiler._run_on_profiler_start()  # what torch.profiler does: others see it run


def _stop_session():
    """Stop the session :func:`_start_session` started; its results (``_ProfilerResult``)."""
    from torch._C._autograd import _disable_profiler

    try:
        return _disable_profiler()
    finally:
        torch.autograd.profiler._run_on_profiler_stop()


def _mark_free(ptr: int, nbytes: int):
    """A weak reference callback that records the free of a watched storage as a profiler event
    (no op dispatched: a dispatch mode below sees nothing)."""
    name = f"{_FREE_MARK}{ptr},{nbytes}"

    def freed(_ref: weakref.ref) -> None:
        with torch._C._profiler._RecordFunctionFast(name):
            pass

    return freed


class AllocatorStepMeter:
    """One step's peak on CPU from the allocator's events, for compiled code (compiled mode's
    measured step): unlike :class:`StorageCounter` it is no dispatch mode, so dynamo compiles
    under it, and it sees compiled code's buffers and kernel temporaries.

    Peak = bytes of the ``track`` storages at :meth:`start` (as the counter counts them) plus the
    highest running total of the allocator's allocations minus frees until :meth:`stop`, where
    the frees include those of the ``track`` storages (gradients dropped by ``zero_grad``: see
    :class:`AllocatorPeak`'s ``watch``). It sees kernel temporaries the counter does not, so it
    reads at least what the counter reads on eager code.

    Python's automatic garbage collection is paused while it runs (cyclic garbage stays counted
    until the step ends: high): a collection while dynamo compiled under the profiler crashed
    the process (torch 2.13 on CPU, ``tests/test_compiled.py``'s micro-batch test).

    Its peak is known once it has stopped (not ``live``)."""

    live = False

    def __init__(self, track: Iterable[torch.Tensor] = ()) -> None:
        storages = {st._cdata: st for t in track for st in _storages(t)}
        self.base_bytes = sum(st.nbytes() for st in storages.values())
        self._storages = list(storages.values())
        self._peak: AllocatorPeak | None = None
        self._peak_bytes: int | None = None

    @staticmethod
    def available() -> bool:
        """False while another profiler runs (the step cannot be profiled a second time)."""
        return not torch.autograd.profiler._is_profiler_enabled

    def start(self) -> None:
        self._peak, self._storages = AllocatorPeak(self._storages), []
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._peak.__enter__()

    def mark(self) -> None:
        self._peak.mark()

    def stop(self) -> None:
        """End the step (for a step given up too); a meter already stopped stays as it is."""
        if self._peak is None:
            return
        peak, self._peak = self._peak, None
        peak.__exit__(None, None, None)
        if self._gc_was_enabled:
            gc.enable()
        self._peak_bytes = self.base_bytes + peak.peak_bytes

    def peak(self) -> int:
        """The peak in bytes of the window since :meth:`start` or the last :meth:`mark`, read
        after :meth:`stop`."""
        if self._peak_bytes is None:
            raise TapeSACError("AllocatorStepMeter.peak() is known once the meter has stopped")
        return self._peak_bytes


def meter_for(device: torch.device, track: Iterable[torch.Tensor] = ()) -> StepMeter:
    """The meter for ``device``: allocator statistics on CUDA, a :class:`CpuMeter` elsewhere."""
    return CudaMeter(device) if device.type == "cuda" else CpuMeter(track)
