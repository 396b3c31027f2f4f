"""Everything TapeSAC cannot do safely is a clear error or a documented safe fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tapesac
from tapesac.policy import BlockPolicy, Policy

from .blocks import CASES, FrozenBlock, SquareBlock, assert_identical, grads


def test_wrapping_a_block_twice_is_an_error():
    blocks = [SquareBlock(), SquareBlock()]
    tapesac.wrap(blocks)
    with pytest.raises(tapesac.WrapError, match="already wrapped"):
        tapesac.wrap(blocks[1:])


def test_wrapping_nested_blocks_is_an_error():
    inner = SquareBlock()
    outer = nn.Sequential(inner, SquareBlock())
    with pytest.raises(tapesac.WrapError, match="nested inside block 0"):
        tapesac.wrap([outer, inner])


@pytest.mark.parametrize("bad", [[], [torch.zeros(2)]])
def test_wrap_rejects_bad_arguments(bad):
    with pytest.raises(tapesac.WrapError):
        tapesac.wrap(bad)


def test_block_already_under_torch_activation_checkpointing_is_rejected():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    with pytest.raises(tapesac.WrapError, match="activation_checkpoint.mode"):
        tapesac.wrap([checkpoint_wrapper(SquareBlock())])


def test_running_inside_non_reentrant_checkpoint_is_an_error():
    block = SquareBlock()
    tapesac.wrap([block])
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(tapesac.TapeSACError, match="another saved-tensor hook"):
        checkpoint(block, x, use_reentrant=False)


def test_inside_reentrant_checkpoint_gradients_stay_exact():
    torch.manual_seed(0)
    ref = SquareBlock()
    x = torch.randn(4, 16, requires_grad=True)
    checkpoint(ref, x, use_reentrant=True).sum().backward()
    expected = [p.grad.clone() for p in ref.parameters()] + [x.grad.clone()]
    torch.manual_seed(0)
    block = SquareBlock()
    x.grad = None
    tapesac.wrap([block])
    checkpoint(block, x, use_reentrant=True).sum().backward()
    for e, a in zip(expected, [p.grad for p in block.parameters()] + [x.grad]):
        assert torch.equal(e, a)


def test_compiled_module_is_rejected_at_wrap():
    block = SquareBlock()
    block.compile()
    with pytest.raises(tapesac.WrapError, match="compile"):
        tapesac.wrap([block])


def test_under_torch_compile_blocks_run_eagerly_with_exact_gradients():
    """Documented fallback: the wrapped forward is excluded from compilation (a graph break)."""
    expected, _ = grads(CASES["frozen_lora"]())
    case = CASES["frozen_lora"]()
    handle = tapesac.wrap(case.blocks)
    torch._dynamo.reset()
    case.run = torch.compile(case.run, backend="aot_eager")
    actual, _ = grads(case)
    assert_identical(expected, actual)
    assert all(s["ops_replayed"] > 0 for s in handle.stats().values())


_sin_plus_one = torch.compile(lambda t: t.sin() + 1, backend="eager")


class CallsCompiledBlock(nn.Module):
    """A block that calls compiled code itself (as one using compiled flex attention does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _sin_plus_one(self.lin(x)) * x


def test_compiled_code_called_while_recording_never_traces_into_tapesac():
    """Dynamo must not trace TapeSAC's dispatch mode (it would graph-break on TapeSAC's own
    code, or compile it); recording and following forwards stay exact."""
    torch.manual_seed(0)
    ref, block = CallsCompiledBlock(), CallsCompiledBlock()
    block.load_state_dict(ref.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    expected = []
    for _ in range(3):
        ref.zero_grad()
        ref(x).sum().backward()
        expected.append([p.grad.clone() for p in ref.parameters()])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    handle = tapesac.wrap([block])
    for step in range(3):  # records, records again (verified), then follows
        block.zero_grad()
        block(x).sum().backward()
        assert all(torch.equal(e, p.grad) for e, p in zip(expected[step], block.parameters()))
    assert handle.stats()[0]["followed"]
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


class NumpyBlock(nn.Module):
    """An op the dispatcher never sees: its result cannot be replayed, so it is held as is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        scale = torch.from_numpy(np.abs(h.detach().numpy()) + 1.0)
        return x + torch.tanh(h) * scale


def test_values_made_outside_the_dispatcher_are_held_not_replayed():
    torch.manual_seed(0)
    ref = NumpyBlock()
    x = torch.randn(3, 8, requires_grad=True)
    ref(x).sum().backward()
    torch.manual_seed(0)
    block = NumpyBlock()
    x2 = x.detach().clone().requires_grad_()
    handle = tapesac.wrap([block])
    block(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(ref.lin.weight.grad, block.lin.weight.grad)
    assert handle.stats()[0]["input_bytes"] >= 3 * 8 * 4  # the numpy result is held


def test_block_input_modified_after_forward_is_an_error_not_garbage():
    torch.manual_seed(0)
    block = FrozenBlock()
    x = torch.randn(2, 4, 32, requires_grad=True)
    h = x * 1.0
    y = block(h)
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # without TapeSAC autograd refuses too
    tapesac.wrap([block])
    h = x * 1.0
    y = block(h)
    h.mul_(2.0)
    with pytest.raises(tapesac.ReplayError, match="modified by an inplace operation"):
        y.sum().backward()


def test_policy_for_another_tape_is_an_error_not_applied():
    block = SquareBlock()
    handle = tapesac.wrap([block])
    block(torch.randn(4, 16, requires_grad=True)).sum().backward()
    tape = handle.tapes()[0]
    handle.set_policy(Policy({0: BlockPolicy(tape.signature(), [tape.position(tape.read_vids()[0])])}))
    block(torch.randn(4, 16, requires_grad=True)).sum().backward()  # same shapes: fine
    with pytest.raises(tapesac.PolicyError, match="not the one the policy was made for"):
        block(torch.randn(5, 16, requires_grad=True))


def test_policy_without_an_entry_for_a_block_is_an_error():
    handle = tapesac.wrap([SquareBlock(), SquareBlock()])
    with pytest.raises(tapesac.PolicyError, match="no entry for block 1"):
        handle.set_policy(Policy({0: BlockPolicy("abc", [])}))


def test_policy_json_round_trip_and_version_check(tmp_path):
    p = Policy({0: BlockPolicy("s0", [(1, 0), (4, 2)], 128, 0.5), 3: BlockPolicy("s3", [])},
               limit_bytes=10, predicted_peak_bytes=9, predicted_recompute_s=0.1, meta={"world_size": 2})
    path = tmp_path / "policy.json"
    p.save(path)
    q = Policy.load(path)
    assert q == p
    data = p.to_json()
    data["version"] = 99
    with pytest.raises(tapesac.PolicyError, match="version 99"):
        Policy.from_json(data)
    path.write_text("{not json")
    with pytest.raises(tapesac.PolicyError, match="not valid JSON"):
        Policy.load(path)
