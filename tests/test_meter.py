"""The CPU storage counter: what it counts, and that it leaves other dispatch modes alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _python_dispatch as python_dispatch
from torch.utils.flop_counter import FlopCounterMode

from tapesac.errors import TapeSACError
from tapesac.meter import CpuMeter, StorageCounter

MIB = 2**20


def _mode_stack() -> list:
    return [python_dispatch._get_dispatch_stack_at(i) for i in range(python_dispatch._len_torch_dispatch_stack())]


@pytest.fixture(autouse=True)
def _empty_mode_stack():
    """A failed test must not leave its modes to the next one."""
    yield
    while python_dispatch._len_torch_dispatch_stack():
        python_dispatch._pop_torch_dispatch_stack(None)


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def _flops(model, x) -> int:
    with FlopCounterMode(display=False) as fc:
        _step(model, x)
    return fc.get_total_flops()


def test_a_flop_counter_entered_inside_a_meter_run_counts_as_without_it():
    """The meter starts at one step boundary and stops at a later one; a FlopCounterMode around
    the step in between sees every op and leaves nothing on the stack."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    expected = _flops(model, x)
    assert expected > 0

    meter = CpuMeter()
    meter.start()
    fc = FlopCounterMode(display=False)
    fc.__enter__()
    _step(model, x)
    meter.stop()  # while the flop counter is still on the stack, above the meter
    assert _mode_stack() == [fc.mode]
    _step(model, x)  # still counted: the flop counter stayed
    fc.__exit__(None, None, None)

    assert fc.get_total_flops() == 2 * expected
    assert _mode_stack() == []
    assert not python_dispatch.is_in_torch_dispatch_mode()
    assert not python_dispatch.is_in_torch_dispatch_mode(include_infra_modes=False)
    assert meter.peak() > 0


def test_interleaved_counters_each_count_every_allocation_once():
    """Two planned handles' meters overlap without nesting: neither counts the other, each
    counts the real allocations made while it is active."""
    a, b = StorageCounter(), StorageCounter()
    a.__enter__()
    x = torch.empty(MIB, dtype=torch.uint8)  # a only
    b.__enter__()
    y = torch.empty(2 * MIB, dtype=torch.uint8)  # both
    assert (a.live_bytes, b.live_bytes) == (3 * MIB, 2 * MIB)
    a.__exit__(None, None, None)  # a leaves from under b
    assert _mode_stack() == [b]
    z = torch.empty(4 * MIB, dtype=torch.uint8)  # b only
    del y
    assert (a.live_bytes, b.live_bytes) == (MIB, 4 * MIB)
    assert (a.peak_bytes, b.peak_bytes) == (3 * MIB, 6 * MIB)
    assert (a.allocated_bytes, b.allocated_bytes) == (3 * MIB, 6 * MIB)
    b.__exit__(None, None, None)
    assert _mode_stack() == []
    assert not python_dispatch.is_in_torch_dispatch_mode()
    del x, z
    assert (a.live_bytes, b.live_bytes) == (0, 0)


def test_nested_counters_count_only_real_allocations():
    """An inner counter's bookkeeping allocates nothing the outer one could see."""
    outer, inner = StorageCounter(), StorageCounter()
    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with outer:
        _step(model, x)
    alone = outer.allocated_bytes
    model.zero_grad(set_to_none=True)
    x.grad = None
    outer = StorageCounter()
    with outer, inner:
        _step(model, x)
    assert outer.allocated_bytes == inner.allocated_bytes == alone
    assert _mode_stack() == []


def test_storages_that_grow_by_resize_are_counted_seen_before_or_not():
    """FSDP2's unshard: ``resize_(n)`` of a storage made before the counter started, an
    all-gather into it, and ``resize_(0)`` after use."""
    unsharded = torch.empty(MIB, dtype=torch.uint8)
    unsharded.untyped_storage().resize_(0)
    untracked = torch.empty(MIB, dtype=torch.uint8)
    counter = StorageCounter()
    with counter:
        unsharded.untyped_storage().resize_(2 * MIB)
        assert counter.live_bytes == counter.counted_bytes(unsharded.untyped_storage()) == 2 * MIB
        untracked.untyped_storage().resize_(0)  # never counted: nothing to subtract
        assert counter.live_bytes == 2 * MIB
        unsharded.untyped_storage().resize_(0)
        assert counter.live_bytes == 0
        unsharded.untyped_storage().resize_(2 * MIB)  # the next unshard of the same storage
    assert (counter.live_bytes, counter.peak_bytes, counter.allocated_bytes) == (2 * MIB, 2 * MIB, 4 * MIB)
    del unsharded
    assert counter.live_bytes == 0


def test_a_release_on_another_thread_is_counted():
    """A gloo worker thread may drop the last reference to a collective's buffer."""
    import threading

    counter = StorageCounter()
    with counter:
        held = [torch.empty(MIB, dtype=torch.uint8)]
    assert counter.live_bytes == MIB
    worker = threading.Thread(target=held.clear)
    worker.start()
    worker.join()
    assert counter.live_bytes == 0


def test_leaving_a_counter_twice_is_an_error():
    counter = StorageCounter()
    other = StorageCounter()
    other.__enter__()
    counter.__enter__()
    counter.__exit__(None, None, None)
    with pytest.raises(TapeSACError, match="not on this thread's dispatch mode stack"):
        counter.__exit__(None, None, None)
    other.__exit__(None, None, None)
    assert _mode_stack() == []


def test_allocator_step_meter_reads_what_the_counter_reads_on_eager_code():
    """The allocator meter that measures compiled steps reads at least the storage
    counter's peak (it also sees kernel temporaries) and no more than small temporaries above
    it, also when the step frees what existed before it (gradients set to None mid-step), a
    free the profiler itself does not report."""
    from tapesac.meter import AllocatorPeak, AllocatorStepMeter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(128, 64)
    for existing_grads in (None, "unprofiled", "profiled"):
        peaks = []
        for meter in ("allocator", "counter"):
            model.zero_grad(set_to_none=True)
            if existing_grads == "unprofiled":  # as at an optimizer-step boundary
                _step(model, x)
            elif existing_grads == "profiled":  # made in an earlier measured step: the profiler
                with AllocatorPeak():           # reports their free itself (subtract it once)
                    _step(model, x)
            track = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
            m = AllocatorStepMeter(track) if meter == "allocator" else CpuMeter(track)
            del track  # the meters hold no tensor alive: zero_grad below frees the gradients
            m.start()
            model.zero_grad(set_to_none=True)
            _step(model, x)
            m.stop()
            peaks.append(m.peak())
        allocator_peak, counter_peak = peaks
        # 32 KiB of kernel temporaries measured above the counter, with or without old gradients;
        # counting the freed gradients would add their 129 KiB.
        assert counter_peak <= allocator_peak <= counter_peak + 64 * 1024, (existing_grads, peaks)


@pytest.mark.parametrize("meter", ["allocator", "counter"])
def test_every_meter_starts_a_new_peak_window_at_a_mark(meter):
    """Every step meter (``StepMeter``) reads the peak since its last mark: a large tensor freed
    before the mark is not in the window after it, a smaller one made after it is."""
    from tapesac.meter import AllocatorStepMeter

    m = AllocatorStepMeter() if meter == "allocator" else CpuMeter()
    m.start()
    big = torch.ones(1 << 20)
    del big
    m.mark()
    small = torch.ones(1 << 10)
    m.stop()
    assert 4 * (1 << 10) <= m.peak() < 4 * (1 << 20), m.peak()
    del small


def _event_names(results) -> set[str]:
    names, stack = set(), list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        names.add(node.name)
    return names


def test_a_record_function_open_across_two_allocator_windows_is_recorded_by_neither():
    """Step boundaries run inside ``optimizer.step``'s record_function: one allocator window
    stops there and the next may start before it closes. A window that had recorded its start
    would take its end into freed memory when it closes (heap corruption, torch 2.13), so
    windows record no Python-scope record function; what they measure by (allocations, the free
    marks of watched storages, ops) is still recorded."""
    from tapesac.meter import _mark_free, _start_session, _stop_session

    _start_session()
    handle = torch.ops.profiler._record_function_enter_new("straddles two windows", None)
    kept = torch.ones(1024)
    _mark_free(kept.data_ptr(), kept.untyped_storage().nbytes())(None)
    first = _event_names(_stop_session())
    _start_session()
    torch.ops.profiler._record_function_exit._RecordFunction(handle)
    second = _event_names(_stop_session())
    assert "straddles two windows" not in first | second
    assert {"[memory]", "aten::ones", f"tapesac.freed:{kept.data_ptr()},4096"} <= first, first
