"""In-place updates around and inside a wrapped block: exact gradients, or autograd's own error.

Autograd skips its saved-tensor version check when saved-tensor hooks are active, so TapeSAC does
it: every saved tensor is checked as autograd would, and everything replay reads (block inputs,
their views and bases, kept values the caller can reach) is checked before it is used. Each test
runs the same program without TapeSAC and expects the same outcome: equal gradients bit for bit,
or a RuntimeError with autograd's wording.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tapesac
from tapesac.policy import BlockPolicy, Policy

AUTOGRAD = "one of the variables needed for gradient computation has been modified by an inplace operation"


class Lin(nn.Module):
    """Linear saves its input for the weight gradient: autograd itself reads the block input."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class ExpOfScaled(nn.Module):
    """Autograd saves only exp's result: the block input is needed by replay alone."""

    def forward(self, x):
        return torch.exp(x * 2.0)


class TwoOutputs(nn.Module):
    """Returns an intermediate (``h``) that replay rebuilds the other output's saved value from."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.tanh(h * 2.0)


class ExpOut(nn.Module):
    """Returns a value autograd saved (exp saves its result)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.exp(self.lin(x))


class WritesItsInput(nn.Module):
    """Reads its (non-leaf) input, updates it in place, uses it again: legal, no saved version is
    overwritten (the version replay needs is copied before the write)."""

    def __init__(self, d: int = 8, through_view: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.through_view = through_view

    def forward(self, x):
        a = torch.exp(x * 2.0)  # replay rebuilds this from the version before the write
        if self.through_view:
            x[:, :2].mul_(2.0)
        else:
            x.add_(1.0)
        return torch.tanh(self.lin(x)) + a


class DeadInput(nn.Module):
    """Its second input feeds only a branch whose gradient node never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.d = None

    def forward(self, x, y):
        self.d = torch.tanh(y)  # saved, never unpacked: the loss does not use it
        return torch.exp(x * 2.0)  # replayed


def _keep(op_name: str, slot: int = 0):
    """A keep function for :func:`outcome`: the first value made by an op whose name contains op_name."""

    def keep(tape):
        for i in range(len(tape.ops)):
            if op_name in tape.op_name(i):
                return [(i, slot)]
        raise AssertionError(f"no {op_name} on the tape: {[tape.op_name(i) for i in range(len(tape.ops))]}")

    return keep


def outcome(make, program, *, wrap: bool, keep=None, n_inputs: int = 1):
    """Run ``program(block, *leaves)`` and backward: ('ok', grads) or ('error', exception).

    The program returns the loss, or (loss, tensors the caller still holds during backward).
    """
    torch.manual_seed(0)
    block = make()
    leaves = [torch.randn(4, 16 if n_inputs == 1 else 8, requires_grad=True) for _ in range(n_inputs)]
    if wrap:
        handle = tapesac.wrap([block])
        if keep is not None:
            first = program(block, *[x.detach().clone().requires_grad_() for x in leaves])
            try:  # only the tape matters here
                (first[0] if isinstance(first, tuple) else first).backward()
            except RuntimeError:
                pass
            tape = handle.tapes()[0]
            handle.set_policy(Policy({0: BlockPolicy(tape.signature(), keep(tape))}))
            block.zero_grad(set_to_none=True)
    try:
        loss = program(block, *leaves)
        if isinstance(loss, tuple):  # (loss, tensors the caller still holds during backward)
            loss, _alive = loss[0], loss[1:]
        loss.backward()
    except RuntimeError as e:
        return "error", e
    grads = [x.grad for x in leaves] + [p.grad for p in block.parameters()]
    return "ok", grads


def assert_same_outcome(make, program, keep=None, n_inputs: int = 1):
    kind, expected = outcome(make, program, wrap=False, n_inputs=n_inputs)
    got_kind, actual = outcome(make, program, wrap=True, keep=keep, n_inputs=n_inputs)
    if kind == "error":
        assert AUTOGRAD in str(expected)
        assert got_kind == "error", "autograd refuses this program, TapeSAC computed gradients"
        assert isinstance(actual, tapesac.ReplayError), repr(actual)
        # The same words and the same versions as autograd's message.
        assert str(actual).startswith(AUTOGRAD), str(actual)
        assert _versions(str(actual)) == _versions(str(expected)), (str(actual), str(expected))
    else:
        assert got_kind == "ok", f"autograd computes this program, TapeSAC raised: {actual!r}"
        assert len(expected) == len(actual)
        for e, a in zip(expected, actual):
            assert (e is None) == (a is None)
            if e is not None:
                assert torch.equal(e, a), f"max abs diff {(e - a).abs().max().item()}"


def _versions(msg: str) -> str:
    return msg[msg.index(" is at version"):msg.index(" instead.")]


# Block inputs, their views and bases --------------------------------------------------------

def view_input_base_changed(block, leaf):
    base = leaf * 1.0
    y = block(base[:, :8])  # a temporary view: nothing but its base outlives the forward
    base.mul_(2.0)
    return y.sum()


def view_input_base_changed_twice(block, leaf):
    base = leaf * 1.0
    v = base[:, 8:]
    y = block(v)
    base.mul_(2.0)
    base.add_(1.0)
    return y.sum()


@pytest.mark.parametrize("program", [view_input_base_changed, view_input_base_changed_twice])
def test_view_input_whose_base_changes_after_forward_raises_like_autograd(program):
    assert_same_outcome(Lin, program)


def test_input_only_replay_reads_is_an_error_not_garbage():
    """Autograd never reads this input, replay must: the one place TapeSAC refuses what autograd
    allows (as torch.utils.checkpoint does). Never silently wrong."""
    kind, _ = outcome(ExpOfScaled, view_input_base_changed, wrap=False)
    assert kind == "ok"
    kind, err = outcome(ExpOfScaled, view_input_base_changed, wrap=True)
    assert kind == "error" and isinstance(err, tapesac.ReplayError)
    assert str(err).startswith(AUTOGRAD) and "is at version 1; expected version 0" in str(err)
    assert "TapeSAC block 0" in str(err) and "clone" in str(err)


def test_block_input_modified_after_forward_raises_like_autograd():
    def program(block, leaf):
        h = leaf[:, :8] * 1.0
        y = block(h)
        h.mul_(2.0)
        return y.sum()

    assert_same_outcome(Lin, program)


def test_inputs_backward_never_reads_may_change_after_forward():
    def program(block, x, y):
        x1, y1 = x * 1.0, y * 1.0
        out = block(x1, y1)
        y1.mul_(2.0)  # only the dead branch read it
        return out.sum(), y1

    assert_same_outcome(DeadInput, program, n_inputs=2)


# Values the block returns --------------------------------------------------------------------

def update_first_output(block, leaf):
    h, t = block(leaf[:, :8])
    h.add_(1.0)  # legal: autograd saved no version of h
    return (h * h).sum() + t.sum()


def test_kept_output_updated_after_forward_is_rebuilt_not_read():
    assert_same_outcome(TwoOutputs, update_first_output, keep=_keep("addmm"))


def update_output(block, leaf):
    y = block(leaf[:, :8])
    y.add_(1.0)  # autograd saved y (exp's result): it refuses
    return y.sum()


@pytest.mark.parametrize("keep", [None, _keep("exp")], ids=["replayed", "kept"])
def test_saved_output_updated_after_forward_raises_like_autograd(keep):
    assert_same_outcome(ExpOut, update_output, keep=keep)


# The block writes its own input -------------------------------------------------------------

@pytest.mark.parametrize("through_view", [False, True])
@pytest.mark.parametrize("keep", [None, _keep("addmm")], ids=["replay", "keep"])
def test_block_writing_its_own_input_in_place_matches_autograd(through_view, keep):
    def program(block, leaf):
        h = leaf[:, :8] * 1.0
        return (h + block(h)).sum(), h  # a residual, and the caller still holds the input

    assert_same_outcome(lambda: WritesItsInput(through_view=through_view), program, keep=keep)


@pytest.mark.parametrize("through_view", [False, True])
def test_input_written_inside_and_after_forward_raises_like_autograd(through_view):
    def program(block, leaf):
        h = leaf[:, :8] * 1.0
        y = block(h)
        h.mul_(3.0)  # the version the block wrote was saved by autograd
        return y.sum()

    assert_same_outcome(lambda: WritesItsInput(through_view=through_view), program)
