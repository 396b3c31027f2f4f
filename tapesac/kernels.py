"""Kernels the dispatcher never sees: Triton launches as tape steps.

A Triton kernel (flash-linear-attention's, Liger's, an MoE dispatch kernel) writes its output
buffers without any ATen op: a dispatch mode sees the ``torch.empty`` that allocated a buffer and
nothing after it. Two things here let the recorder keep its promises anyway:

* :func:`install` patches the launch path of Triton's kernel objects (``run`` of
  ``JITFunction``, the interpreter's ``InterpretedFunction``, ``Autotuner`` and ``Heuristics``)
  for as long as any handle is alive, so that a launch inside a recorded block forward becomes a
  :class:`KernelLaunch` step of the tape: its arguments, grid and constexprs, and the pointer
  arguments it writes. Replay relaunches it on the rebuilt arguments, profiling times it like an
  ATen op. Launches anywhere else run untouched (one attribute read per launch).

Fingerprints of values (what verification forwards compare, replay invariant R6) are in
:mod:`~tapesac.fingerprints`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor

# Triton launches as tape steps ---------------------------------------------------------------------


class KernelLaunch:
    """A tape step that launches one Triton kernel with the recorded grid; called as an op is,
    ``launch(*args, **kwargs)``, with tensors where the tape has values.

    Its name (in signatures and messages) is the kernel's qualified name with the constexprs it
    was launched with, which select the compiled program; the grid and other integers are data
    (sizes), as integer arguments of ATen ops are."""

    __slots__ = ("kernel", "grid", "consts", "__name__")

    def __init__(self, kernel: Any, grid: Any, consts: tuple) -> None:
        self.kernel = kernel
        self.grid = grid
        self.consts = consts
        """``(name, value)`` of each constexpr argument given at the launch, sorted by name."""
        fn = _python_function(kernel)
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(kernel).__name__)}"
        self.__name__ = f"triton:{where}[{', '.join(f'{k}={v!r}' for k, v in consts)}]"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel.run(*args, grid=self.grid, warmup=False, **kwargs)

    def _key(self) -> tuple:
        grid = self.grid
        shape = getattr(grid, "__code__", None) if callable(grid) else len(grid)
        return (id(self.kernel), self.consts, shape)

    def same_grid(self, other: "KernelLaunch") -> bool:
        """Whether ``other`` launches as many programs: equal grid tuples, or the same grid
        function over equal captured values (a followed forward replays with the tape's grid)."""
        a, b = self.grid, other.grid
        if not callable(a) or not callable(b):
            return a == b
        if a is b:
            return True
        if getattr(a, "__code__", None) is None or a.__code__ is not getattr(b, "__code__", None):
            return False
        try:
            pairs = list(zip(a.__closure__ or (), b.__closure__ or ()))
            if len(pairs) != len(a.__closure__ or ()) or a.__defaults__ != b.__defaults__:
                return False
            for ca, cb in pairs:
                x, y = ca.cell_contents, cb.cell_contents
                same = x is y if isinstance(x, Tensor) or isinstance(y, Tensor) else type(x) is type(y) and x == y
                if not same:
                    return False
            return True
        except Exception:  # noqa: BLE001 - an empty cell, or values that do not compare: not the same
            return False

    def __eq__(self, other: object) -> bool:
        return type(other) is KernelLaunch and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return self.__name__


def _python_function(kernel: Any) -> Any:
    """The Python function under a Triton kernel object (through autotuners and heuristics)."""
    fn = kernel
    for _ in range(8):
        inner = getattr(fn, "fn", None)
        if inner is None:
            break
        fn = inner
    return fn


_constexpr_cache: dict[int, tuple[tuple[str, ...], frozenset[str]]] = {}


def _signature_of(kernel: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """(argument names, names of the constexpr ones) of a kernel, cached per kernel object."""
    found = _constexpr_cache.get(id(kernel))
    if found is None:
        fn = _python_function(kernel)
        try:
            names = tuple(inspect.signature(fn).parameters)
            notes = inspect.get_annotations(fn)
        except (TypeError, ValueError):
            names, notes = (), {}
        consts = frozenset(n for n, a in notes.items() if "constexpr" in (a if isinstance(a, str) else repr(a)))
        found = _constexpr_cache[id(kernel)] = (names, consts)
    return found


def launch_constants(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The constexpr arguments of a launch as sorted ``(name, value)`` pairs."""
    names, consts = _signature_of(kernel)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return tuple(sorted((n, v) for n, v in bound.items() if n in consts and not isinstance(v, Tensor)))


_static_cache: dict[tuple, frozenset[str] | None] = {}


def written_by_analysis(kernel: Any, args: tuple, kwargs: dict) -> frozenset[str] | None:
    """Names of the tensor arguments a launch writes, from PyTorch's analysis of the kernel's
    Triton IR (what ``torch.compile`` uses for user-defined Triton kernels); None when it cannot
    run (no GPU driver, Triton's interpreter, an unsupported kernel): the caller then compares
    the arguments' bytes before and after the launch."""
    names, consts = _signature_of(kernel)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    found = None
    try:
        # Through autotuners (their first config: the analysis reads which pointers are
        # stored to, not the tuning) and heuristics (the values they add), to the JIT function.
        inner = kernel
        while type(inner).__name__ in ("Autotuner", "Heuristics"):
            if type(inner).__name__ == "Heuristics":
                bound.update({name: rule(dict(bound)) for name, rule in inner.values.items()})
            elif inner.configs:
                bound = {**bound, **inner.configs[0].kwargs}
            inner = inner.fn
    except Exception:  # noqa: BLE001 - a heuristic that needs more than the arguments
        return None
    key = (id(kernel), tuple(sorted((n, v) for n, v in bound.items() if n in consts)),
           tuple(sorted(n for n, v in bound.items() if v is None)))
    if key in _static_cache:
        return _static_cache[key]
    try:
        import triton

        triton.runtime.driver.active.get_current_target()  # raises without a driver
        from torch._higher_order_ops import triton_kernel_wrap as wrap

        hop_log = logging.getLogger(wrap.__name__)
        level = hop_log.level
        hop_log.setLevel(logging.ERROR)  # it warns and assumes everything is written on failure
        try:
            accesses = wrap.identify_accessed_tensors(inner, bound, {})
        finally:
            hop_log.setLevel(level)
        tensors = {n for n, v in bound.items() if isinstance(v, Tensor)}
        written = frozenset(getattr(d, "name", None) for d in accesses.read_writes.writes) & tensors
        # Its fallback on failure is "every tensor": our byte comparison is tighter then.
        found = None if written == tensors and len(tensors) > 1 else written
    except Exception:  # noqa: BLE001 - any failure means: measure instead
        found = None
    _static_cache[key] = found
    return found


# The launch hook -----------------------------------------------------------------------------------

_lock = threading.Lock()
_installed: dict[type, Callable] = {}
_users = 0
_current: Callable[[], Any] = lambda: None  # noqa: E731


def install(current_recorder: Callable[[], Any]) -> None:
    """Route Triton launches through ``current_recorder()`` (the recorder of the block forward
    running on this thread, or None). Reference-counted: every :func:`install` is undone by one
    :func:`uninstall`; the last puts Triton's classes back as they were. Without Triton, nothing."""
    global _users, _current
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return
    with _lock:
        _users += 1
        _current = current_recorder
        if _installed:
            return
        pending = [KernelInterface]
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            run = cls.__dict__.get("run")
            if run is None or getattr(run, "__tapesac_original__", None) is not None:
                continue
            if not cls.__module__.startswith("triton."):  # e.g. inductor's launchers: another protocol
                continue
            if cls is KernelInterface:  # abstract: its subclasses define the real one
                continue
            _installed[cls] = run
            cls.run = _hooked(run)


def uninstall() -> None:
    """Undo one :func:`install`."""
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users:
            return
        for cls, run in _installed.items():
            cls.run = run
        _installed.clear()


def installed() -> int:
    """How many handles route Triton launches to recorders now (0: Triton's classes are as
    they were)."""
    return _users if _installed else 0


def _hooked(run: Callable) -> Callable:
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _current()
        if rec is None or kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        return rec.launch_kernel(self, run, args, kwargs)

    launch.__tapesac_original__ = run
    launch.__name__ = getattr(run, "__name__", "run")
    launch.__doc__ = run.__doc__
    return launch
