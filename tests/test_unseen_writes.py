"""Kernels the dispatcher cannot see: gradients stay exact, or the step fails loudly once.

Each block writes memory without an ATen op (numpy, ctypes, or a real Triton kernel under
Triton's interpreter), as GPU kernels do. Each is trained for several optimizer steps in
replay-only mode and in planned mode at a limit that forces recompute, and every step's loss
and gradients are compared bit for bit with the same model unwrapped.
"""

from __future__ import annotations

import pytest
import torch

import tapesac
from tapesac.errors import ReplayError
from tapesac.tape import UNSEEN

from . import unseen
from .unseen import BLOCKS, LOUD_BLOCKS, TRITON_BLOCKS, model, train

STEPS = 5
EXACT = sorted(set(BLOCKS) - LOUD_BLOCKS)


def _needs(kind: str) -> None:
    if kind in TRITON_BLOCKS and unseen.triton is None:
        pytest.skip("triton is not installed")


def assert_same(expected, actual) -> None:
    assert len(expected) == len(actual)
    for step, (e, a) in enumerate(zip(expected, actual)):
        if e is None:
            assert isinstance(a, ReplayError), f"step {step}: the reference skipped it, TapeSAC did not fail"
            continue
        assert not isinstance(a, Exception), f"step {step} raised {a!r}"
        (le, ge), (la, ga) = e, a
        assert torch.equal(le, la), f"step {step}: loss {la.item()} != {le.item()}"
        for n in ge:
            diff = (ge[n] - ga[n]).abs().max().item()
            assert torch.equal(ge[n], ga[n]), f"step {step}: grad of {n} differs by up to {diff}"


def _limit(kind: str, flat_ok: bool = False) -> int:
    """A limit halfway between the smallest and the largest useful predicted peak (``flat_ok``:
    or the one peak there is, for a block whose only saved value ends up kept)."""
    net = model(kind)
    handle = tapesac.wrap(net.layers, memory_limit_bytes=1 << 40)
    try:
        train(net, 4, skip_errors=True)  # an unseen in-place update fails its first step
        plan = handle.plan
        assert plan is not None
        lo, hi = plan.smallest_peak_bytes, plan.largest_useful_peak_bytes
    finally:
        handle.remove()
    assert hi > lo or flat_ok, "nothing to choose: the test block keeps nothing worth choosing"
    return int(lo + 0.5 * (hi - lo))


def _run(kind: str, mode: str, steps: int = STEPS, skip_errors: bool = False):
    net = model(kind)
    if mode == "replay_only":
        handle = tapesac.wrap(net.layers)
    else:
        handle = tapesac.wrap(net.layers, memory_limit_bytes=_limit(kind, flat_ok=kind in LOUD_BLOCKS))
    try:
        return handle, train(net, steps, skip_errors=skip_errors)
    finally:
        handle.remove()


@pytest.mark.parametrize("mode", ["replay_only", "planned"])
@pytest.mark.parametrize("kind", EXACT)
def test_unseen_writes_give_exact_gradients(kind, mode):
    _needs(kind)
    expected = train(model(kind), STEPS)
    handle, actual = _run(kind, mode)
    assert_same(expected, actual)
    stats = handle.stats()
    # Later forwards follow the verified tape, launches included. Recorded every forward: a held
    # buffer written later in the block (it needs a snapshot: a dead sibling view's, or a
    # scatter's own target), a saved tensor a launch rewrote (its handle reads the storage
    # through a step of the recorder's own).
    if mode == "replay_only" and kind not in ("dead_sibling_view", "unpermute_new_empty", "triton_writes_saved"):
        assert all(s["followed"] for s in stats.values()), stats
    if mode == "planned":
        assert handle.plan is not None and any(b.keep for b in handle.plan.policy.blocks.values())
    if kind in TRITON_BLOCKS:  # launches are recorded steps (a pass-through block records nothing)
        assert any(s["kernel_launches"] > 0 for s in stats.values())
        assert any(s["ops_replayed"] > 0 for s in stats.values())


@pytest.mark.parametrize("kind", ["function_empty_like", "plain_empty", "strided_data_ptr_view", "deltanet_numpy"])
def test_values_no_recorded_op_wrote_are_kept_not_rebuilt(kind):
    net = model(kind)
    handle = tapesac.wrap(net.layers)
    train(net, 1)
    for i, tape in handle.tapes().items():
        unseen_ops = [op for op in tape.ops if op.keep_only == UNSEEN]
        assert unseen_ops, f"block {i}: nothing kept as written outside the dispatcher"
        assert handle.stats()[i]["unseen_bytes"] > 0
    handle.remove()


@pytest.mark.parametrize("mode", ["replay_only", "planned"])
@pytest.mark.parametrize("kind", sorted(LOUD_BLOCKS))
def test_an_unseen_inplace_update_fails_loudly_once_then_is_exact(kind, mode):
    handle, actual = _run(kind, mode, skip_errors=True)
    failed = frozenset(i for i, r in enumerate(actual) if isinstance(r, Exception))
    assert failed, "an unseen in-place update of a replayed value went unnoticed"
    for i in failed:
        err = actual[i]
        assert isinstance(err, ReplayError), repr(err)
        assert "invariant R2" not in str(err)
        msg = str(err)
        assert "TapeSAC block" in msg and "torch.library custom op" in msg
        if kind == "inplace_scale":
            assert "addmm" in msg  # the view's producer is named
    # Loud once per block that replays it (planned mode may profile it once more), then exact.
    assert max(failed) < STEPS - 2
    expected = train(model(kind), STEPS, skip_steps=failed)
    assert_same(expected, actual)
    assert any(b.keep_only_ops for b in handle.blocks), "the producer that differed is kept from then on"


def test_triton_launch_is_a_tape_step_with_its_constexprs_and_written_outputs():
    _needs("triton_in_function")
    from tapesac import kernels

    net = model("triton_outside_function", layers=1)
    users = kernels.installed()
    handle = tapesac.wrap(net.layers)
    assert kernels.installed() == users + 1
    train(net, 1)
    tape = handle.tapes()[0]
    launches = [op for op in tape.ops if type(op.func).__name__ == "KernelLaunch"]
    assert [len(op.writes) for op in launches] == [2, 1, 1]  # split (lo, hi), affine, scale in place
    assert all("BLOCK=64" in op.func.__name__ for op in launches)
    assert all(op.keep_only is None for op in launches)
    handle.remove()
    assert kernels.installed() == users
    if users == 0:  # the last handle gone: Triton's classes are as they were
        from triton.runtime.jit import KernelInterface

        pending, patched = [KernelInterface], []
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            patched += [cls] if getattr(cls.__dict__.get("run"), "__tapesac_original__", None) else []
        assert not patched


def test_the_planner_weighs_a_triton_kernels_measured_cost():
    """An expensive kernel with a small output (a chunked linear-attention state pass): its
    measured time is on the profile, replay-only recomputes it, and the plan does not."""
    _needs("deltanet_triton")
    net = model("deltanet_triton")
    handle = tapesac.wrap(net.layers, memory_limit_bytes=_limit("deltanet_triton"))
    try:
        train(net, 5)
        entry = next(iter(handle.planner.plans.values()))
        for b, graph in entry.graphs.items():
            launch = [i for i, name in enumerate(graph.op_names) if name.startswith("triton:")]
            assert len(launch) == 1, graph.op_names
            times = graph.op_time_s
            # Its measured time, not its output's bytes (a preempted small op may read longer once).
            median = sorted(times)[len(times) // 2]
            assert times[launch[0]] > 100 * median, f"the kernel is costlier than the block's other ops: {times}"
            assert launch[0] in graph.closure(()), "replay-only recomputes the kernel"
            keep = set(handle.plan.policy.blocks[b].keep)
            kept = [v for v, pos in enumerate(graph.positions) if pos in keep]
            assert launch[0] not in graph.closure(kept), f"block {b}'s plan recomputes the kernel"
    finally:
        handle.remove()


def test_the_plan_log_names_what_is_kept_because_unseen(caplog):
    import logging

    net = model("plain_empty")
    with caplog.at_level(logging.INFO, logger="tapesac"):
        handle = tapesac.wrap(net.layers, memory_limit_bytes=1 << 40)
        try:
            train(net, 3)
        finally:
            handle.remove()
    lines = [r.getMessage() for r in caplog.records if "TapeSAC plan:" in r.getMessage()]
    assert any("kept: written outside the dispatcher" in line for line in lines), lines


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_a_bad_verify_every_is_refused_before_any_block_is_wrapped(bad):
    from tapesac.errors import WrapError

    net = model("plain_empty")
    with pytest.raises(WrapError, match="verify_every"):
        tapesac.wrap(net.layers, verify_every=bad)
    assert all("forward" not in layer.__dict__ for layer in net.layers)


def test_a_bad_verify_every_in_the_torchtitan_section_is_a_config_error():
    config = pytest.importorskip("torchtitan_ext.config")
    from tapesac.errors import ConfigError

    with pytest.raises(ConfigError, match="tapesac.verify_every must be an int >= 0"):
        config.TapeSAC(verify_every=-1)
    assert config.TapeSAC(verify_every=3).verify_every == 3
