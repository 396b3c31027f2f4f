"""Pure module calls that followed forwards run with the dispatch mode off (tapesac.segments).

Every test compares gradients with plain autograd bit for bit at every step, and checks from the
blocks' stats (``ops_unobserved``) that the steps it is about really ran calls unobserved, or
really did not, so none can pass without taking the path it tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from tapesac import segments

from .blocks import CASES, assert_identical, grads
from .test_follow import _keep_every_other, _one_thread  # noqa: F401 (an autouse fixture)

STEPS = 5


def _unobserved(handle) -> list[int]:
    return [s.get("ops_unobserved", 0) for s in handle.stats().values()]


@pytest.mark.parametrize("name", ["llama3", "qwen3", "encoder_dropout", "frozen_lora"])
def test_pure_calls_run_unobserved_and_stay_exact(name):
    plain, wrapped = CASES[name](), CASES[name]()
    handle = tapesac.wrap(wrapped.blocks)
    for step in range(STEPS):
        assert_identical(grads(plain, seed=step)[0], grads(wrapped, seed=step)[0])
    assert all(n > 0 for n in _unobserved(handle)), _unobserved(handle)


def test_pure_calls_run_unobserved_under_a_keep_set():
    """A keep set holds values the calls make (what autograd saves there): held the same."""
    plain, wrapped = CASES["llama3"](), CASES["llama3"]()
    handle = tapesac.wrap(wrapped.blocks)
    grads(wrapped)
    handle.set_policy(_keep_every_other(handle))
    kept = []
    for step in range(STEPS):
        assert_identical(grads(plain, seed=step)[0], grads(wrapped, seed=step)[0])
        kept.append([s["kept_bytes"] for s in handle.stats().values()])
    assert all(n > 0 for n in _unobserved(handle))
    assert kept[-1] == kept[1] and all(b > 0 for b in kept[-1])


class Changing(nn.Module):
    """A block whose pure calls change from call to call with every shape unchanged."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        odd = self.calls in CHANGED_CALLS  # after the tape is followed, then back
        h = x  # (no op before the calls: a change must reach them unseen by the recorder)
        if self.change == "eps":
            self.norm.eps = 1e-1 if odd else 1e-5
        if self.change == "frozen":
            self.lin.weight.requires_grad_(not odd)
        if self.change == "new_weight" and odd:
            self.lin.weight = nn.Parameter(self.lin.weight.detach() * 1.5)
        if self.change == "grad_mode" and odd:
            with torch.no_grad():
                y = self.lin(h)
        else:
            y = self.lin(h)
        return x + torch.tanh(self.norm(y))


CHANGES = ["strides", "eps", "frozen", "new_weight", "grad_mode"]
CHANGED_CALLS = (5, 6)
"""Calls (steps, counted from 1) that change: forwards follow from the third."""


def _assert_same_grads(plain: nn.Module, wrapped: nn.Module, what: str) -> None:
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {n}"
        assert p.grad is None or torch.equal(p.grad, q.grad), f"{what}: {n} differs"


@pytest.mark.parametrize("change", CHANGES)
def test_a_call_that_changes_is_not_run_from_a_stale_tape(change):
    """Each change alters what the calls dispatch or save (the input's strides, a constant,
    which tensors autograd saves, grad mode) or what they read (a new parameter object), with no
    op before the call that could show it: exact every step, and calls still run unobserved in
    the steps where nothing changed since the tape."""
    torch.manual_seed(0)
    plain = nn.Sequential(Changing(change), Changing(change))
    wrapped = copy.deepcopy(plain)
    handle = tapesac.wrap(list(wrapped))
    unobserved = []
    for step in range(8):
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(step))
        if change == "strides" and step + 1 in CHANGED_CALLS:  # same shape and values, other strides
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        for m in (plain, wrapped):
            m.zero_grad(set_to_none=True)
            m(x.detach().requires_grad_()).pow(2).sum().backward()
        _assert_same_grads(plain, wrapped, f"{change}, step {step}")
        unobserved.append(_unobserved(handle)[0])
    assert all(unobserved[2:4]), f"{change}: no call ran unobserved before the change: {unobserved}"
    if change != "new_weight":  # a new parameter object is bound where the tape met the old one
        # The changed call runs op by op (and so does what follows it when the program departs).
        assert max(unobserved[4:6]) < min(unobserved[2:4]), f"{change}: {unobserved}"


def test_a_module_class_whose_forward_changes_runs_op_by_op(monkeypatch):
    """The guard names the class's ``forward``: patched between steps, calls run op by op and
    the new program is recorded."""
    plain, wrapped = CASES["llama3"](), CASES["llama3"]()
    handle = tapesac.wrap(wrapped.blocks)
    for step in range(3):
        assert_identical(grads(plain, seed=step)[0], grads(wrapped, seed=step)[0])
    assert all(_unobserved(handle))

    def doubled(self, x):
        return F.linear(x, self.weight * 2, self.bias)

    before = _unobserved(handle)
    monkeypatch.setattr(nn.Linear, "forward", doubled)
    for step in range(3, 6):
        assert_identical(grads(plain, seed=step)[0], grads(wrapped, seed=step)[0])
        if step == 3:  # the norms before the first linear still run unobserved, nothing after
            assert all(a < b for a, b in zip(_unobserved(handle), before)), (_unobserved(handle), before)


def test_results_that_differ_from_the_tape_are_dropped_and_the_call_runs_again(monkeypatch):
    """Defence in depth: were the guard to miss a change (here it is told to ignore every
    metadata), the call's results are checked against the tape (saved-tensor count, shapes,
    dtypes); on a difference they are dropped and the call runs again under the mode."""
    torch.manual_seed(0)
    plain = nn.Sequential(Changing("grad_mode"), Changing("grad_mode"))
    wrapped = copy.deepcopy(plain)
    handle = tapesac.wrap(list(wrapped))
    monkeypatch.setattr(segments, "call_key", lambda module, args, params: ("same",))
    linears = [0]
    real_linear = F.linear

    def counting(*args, **kwargs):
        linears[0] += 1
        return real_linear(*args, **kwargs)

    monkeypatch.setattr(F, "linear", counting)
    reruns = 0
    for step in range(8):
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(step))
        for m in (plain, wrapped):
            m.zero_grad(set_to_none=True)
            before = linears[0]
            m(x.requires_grad_()).pow(2).sum().backward()
            if m is wrapped:
                reruns += linears[0] - before - 2  # two blocks, one call each
        _assert_same_grads(plain, wrapped, f"step {step}")
    assert reruns > 0, "no call's results differed from the tape, so nothing was tested"
    assert any(_unobserved(handle))


def test_calls_under_another_dispatch_mode_are_observed():
    """Another mode (TapeSAC's storage counter in measured steps, a user's) must see every op:
    no call runs unobserved while one is active."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    case = CASES["llama3"]()
    handle = tapesac.wrap(case.blocks)
    for step in range(3):
        grads(case, seed=step)
    with Count():
        grads(case, seed=3)
    assert not any(_unobserved(handle)) and Count.n > 0
    grads(case, seed=4)
    assert all(_unobserved(handle))


def test_a_deep_copy_of_a_wrapped_model_computes_with_its_own_parameters():
    """TapeSAC replaces the ``forward`` of blocks and of the pure modules in them; a deep copy
    (an EMA or teacher model made after wrapping) must run the copy, not the original, and is
    not wrapped (it can be)."""
    case = CASES["llama3"]()
    handle = tapesac.wrap(case.blocks)
    for step in range(3):
        grads(case, seed=step)
    copied = copy.deepcopy(case.model)
    reference = CASES["llama3"]().model  # the same weights, never wrapped
    with torch.no_grad():
        for p, q in zip(copied.parameters(), reference.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(copied(tokens), reference(tokens))
    assert not torch.equal(case.model(tokens), reference(tokens))
    copy_handle = tapesac.wrap(list(copied.layers.values()))
    copied(tokens).float().pow(2).mean().backward()
    assert all(s["ops_recorded"] > 0 for s in copy_handle.stats().values())
    assert all(s["ops_recorded"] > 0 for s in handle.stats().values())


def test_pure_calls_can_be_turned_off_per_block():
    """``BlockState.pure_calls = False`` (what tools/bench_pure_calls.py compares against)."""
    plain, wrapped = CASES["llama3"](), CASES["llama3"]()
    handle = tapesac.wrap(wrapped.blocks)
    handle.blocks[0].pure_calls = False
    for step in range(4):
        assert_identical(grads(plain, seed=step)[0], grads(wrapped, seed=step)[0])
    stats = handle.stats()
    assert stats[0]["followed"] and stats[0]["ops_unobserved"] == 0
    assert all(s["ops_unobserved"] > 0 for i, s in stats.items() if i > 0)
