"""Gradients under TapeSAC are bit-identical to training without any checkpointing."""

from __future__ import annotations

import random

import pytest
import torch

import tapesac
from tapesac.policy import BlockPolicy, Policy
from tapesac.tape import PRODUCED

from .blocks import CASES, assert_identical, grads

ALL = sorted(CASES)


@pytest.mark.parametrize("kind", ALL)
def test_replay_only_gradients_are_bit_identical(kind):
    expected, buffers = grads(CASES[kind]())
    case = CASES[kind]()
    actual, actual_buffers = grads(case, wrap=lambda c: tapesac.wrap(c.blocks))
    assert_identical(expected, actual)
    # Buffers updated in the forward (batch-norm stats, router load) are updated exactly once.
    assert_identical(buffers, actual_buffers)


@pytest.mark.parametrize("kind", ALL)
def test_replay_only_replays_and_keeps_nothing_produced(kind):
    case = CASES[kind]()
    handle = tapesac.wrap(case.blocks)
    grads(case)
    for s in handle.stats().values():
        assert s["ops_recorded"] > 0 and s["values_read"] > 0
        assert 0 < s["ops_replayed"] <= s["ops_in_closure"] <= s["ops_recorded"]
        if kind not in ("inplace",):  # nonzero's indices are data-dependent: kept, by design
            assert s["kept_bytes"] == 0


def _random_policy(tapes: dict, rng: random.Random, p: float) -> Policy:
    blocks = {}
    for i, tape in tapes.items():
        positions = [(v.op, v.slot) for v in tape.values if v.kind == PRODUCED and v.op >= 0]
        keep = {pos for pos in positions if rng.random() < p}
        keep.add(tape.position(rng.choice(tape.read_vids())))  # at least one value backward reads
        blocks[i] = BlockPolicy(tape.signature(), sorted(keep))
    return Policy(blocks)


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_keep_set_gives_bit_identical_gradients(kind, seed):
    expected, _ = grads(CASES[kind]())
    case = CASES[kind]()
    handle = tapesac.wrap(case.blocks)
    grads(case)  # records the tapes the keep sets refer to
    rng = random.Random(seed)
    policy = _random_policy(handle.tapes(), rng, p=[0.1, 0.5, 0.9][seed])
    handle.set_policy(policy)
    actual, _ = grads(case)
    assert_identical(expected, actual)
    stats = handle.stats()
    assert any(s["kept_bytes"] > 0 for s in stats.values())
    # A second step with the same policy records the same tape (signatures are checked).
    again, _ = grads(case)
    assert_identical(expected, again)


def test_keeping_everything_read_replays_nothing():
    case = CASES["llama3"]()
    handle = tapesac.wrap(case.blocks)
    grads(case)
    policy = Policy({i: BlockPolicy(t.signature(), [t.position(v) for v in t.read_vids()])
                     for i, t in handle.tapes().items()})
    handle.set_policy(policy)
    grads(case)
    for s in handle.stats().values():
        assert s["ops_replayed"] == 0 and s["kept_bytes"] > 0


def test_autocast_bf16_matches_autocast_without_checkpointing():
    def run_autocast(case):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grads(case)

    def under_autocast(make, wrap=None):
        case = make()
        if wrap:
            wrap(case)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grads(case)

    expected, _ = under_autocast(CASES["llama3"])
    actual, _ = under_autocast(CASES["llama3"], wrap=lambda c: tapesac.wrap(c.blocks))
    assert_identical(expected, actual)
    # The casts are on the tape: the recorded ops include bf16 copies.
    case = CASES["llama3"]()
    handle = tapesac.wrap(case.blocks)
    under_autocast(lambda: case)
    tape = handle.tapes()[0]
    assert any(v.dtype == torch.bfloat16 for v in tape.values)


def test_autograd_grad_for_a_subset_of_inputs_with_frozen_weights():
    def partial(case):
        loss = case.run(case.model)
        adapters = [p for n, p in case.model.named_parameters() if n.endswith(".a")]
        return torch.autograd.grad(loss, [case.inputs[0], *adapters])

    expected = partial(CASES["frozen_lora"]())
    case = CASES["frozen_lora"]()
    handle = tapesac.wrap(case.blocks)
    actual = partial(case)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)
    # Frozen weights get no gradient, and nothing was accumulated into .grad.
    assert all(p.grad is None for p in case.model.parameters())
    assert all(s["ops_replayed"] > 0 for s in handle.stats().values())


def test_retain_graph_allows_a_second_backward():
    def twice(case):
        loss = case.run(case.model)
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in case.model.parameters()]
        loss.backward()
        return first, [p.grad.clone() for p in case.model.parameters()]

    e1, e2 = twice(CASES["qwen3"]())
    case = CASES["qwen3"]()
    handle = tapesac.wrap(case.blocks)
    a1, a2 = twice(case)
    for e, a in zip(e1 + e2, a1 + a2):
        assert torch.equal(e, a)
    assert all(s["ops_replayed"] > 0 for s in handle.stats().values())


@pytest.mark.parametrize("mode", ["no_grad", "eval", "inference_mode"])
def test_no_grad_and_eval_forwards_record_nothing(mode):
    case = CASES["encoder_dropout" if mode == "eval" else "llama3"]()
    handle = tapesac.wrap(case.blocks)
    if mode == "eval":
        case.model.eval()
        with torch.no_grad():
            expected = case.run(case.model)
        handle.remove()
        with torch.no_grad():
            plain = case.run(case.model)
        assert torch.equal(expected, plain)
    else:
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with ctx:
            case.run(case.model)
    assert all(s["ops_recorded"] == 0 for s in handle.stats().values())
    assert all(s.last_tape is None for s in handle.blocks)


def test_eval_mode_with_grad_enabled_is_plain_autograd():
    case = CASES["encoder_dropout"]()
    case.model.eval()
    expected, _ = grads(case)
    case = CASES["encoder_dropout"]()
    case.model.eval()
    handle = tapesac.wrap(case.blocks)
    actual, _ = grads(case)
    assert_identical(expected, actual)
    assert all(s["ops_recorded"] == 0 for s in handle.stats().values())


def test_remove_restores_blocks_exactly():
    case = CASES["multi_io"]()
    before = [dict(b.__dict__) for b in case.blocks]
    handle = tapesac.wrap(case.blocks)
    assert all("forward" in b.__dict__ for b in case.blocks)
    handle.remove()
    handle.remove()  # idempotent
    assert [dict(b.__dict__) for b in case.blocks] == before
    expected, _ = grads(CASES["multi_io"]())
    actual, _ = grads(case)
    assert_identical(expected, actual)
    tapesac.wrap(case.blocks).remove()  # can be wrapped again after removal


def _plain_and_wrapped(kind: str, program, policy_p: float | None = None, seed: int = 0):
    """``program(case)`` -> list of tensors, without TapeSAC and wrapped (with a random policy)."""
    expected = program(CASES[kind]())
    case = CASES[kind]()
    handle = tapesac.wrap(case.blocks)
    if policy_p is not None:
        grads(case)
        handle.set_policy(_random_policy(handle.tapes(), random.Random(seed), p=policy_p))
        case.model.zero_grad(set_to_none=True)
        for x in case.inputs:
            x.grad = None
    actual = program(case)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert torch.equal(e, a), f"max abs diff {(e - a).abs().max().item()}"
    return handle


def _backward_twice(case):
    torch.manual_seed(0)
    loss = case.run(case.model)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in case.model.parameters() if p.grad is not None]
    loss.backward()
    return first + [p.grad.clone() for p in case.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["qwen3", "square", "inplace", "encoder_dropout", "custom_function"])
@pytest.mark.parametrize("policy_p", [0.3, 0.9])
def test_retain_graph_twice_with_kept_values(kind, policy_p):
    _plain_and_wrapped(kind, _backward_twice, policy_p=policy_p)


class _DeadBranch(torch.nn.Module):
    """Saves a value (``d``) whose gradient node never runs, so its unpack never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.d = None

    def forward(self, x):
        a = torch.sin(self.lin(x))
        self.d = torch.tanh(a)
        return torch.exp(a + a.cos())  # rebuilding exp's result reads the cached a twice


@pytest.mark.parametrize("policy", [False, True])
def test_retain_graph_twice_with_a_dead_branch(policy):
    def program(model, handle=None):
        torch.manual_seed(0)
        x = torch.randn(4, 8, requires_grad=True)
        loss = model(x).sum()
        out = []
        for _ in range(3):
            loss.backward(retain_graph=True)
            out += [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        return out

    torch.manual_seed(0)
    expected = program(_DeadBranch())
    torch.manual_seed(0)
    block = _DeadBranch()
    handle = tapesac.wrap([block])
    if policy:
        block(torch.randn(4, 8, requires_grad=True)).sum().backward()
        tape = handle.tapes()[0]
        cos = next(i for i in range(len(tape.ops)) if "cos" in tape.op_name(i))
        handle.set_policy(Policy({0: BlockPolicy(tape.signature(), [(cos, 0)])}))
        block.zero_grad(set_to_none=True)
    actual = program(block)
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)


def _twice_per_forward(case):
    """Weight sharing: every block is applied twice in one forward."""
    torch.manual_seed(0)
    h = case.inputs[0]
    for b in case.blocks:
        h = b(b(h))
    h.pow(2).sum().backward()
    return [p.grad for p in case.model.parameters() if p.grad is not None] + [case.inputs[0].grad]


@pytest.mark.parametrize("kind", ["square", "inplace", "encoder_dropout", "frozen_lora"])
@pytest.mark.parametrize("policy_p", [None, 0.5])
def test_block_applied_twice_per_forward(kind, policy_p):
    _plain_and_wrapped(kind, _twice_per_forward, policy_p=policy_p)


def _micro_batches(case):
    """Several forwards before their backwards (gradient accumulation, pipeline schedules)."""
    losses = []
    for seed in range(3):
        torch.manual_seed(seed)
        losses.append(case.run(case.model))
    for loss in reversed(losses[1:]):
        loss.backward()
    losses[0].backward()
    return [p.grad for p in case.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["llama3", "inplace", "encoder_dropout"])
@pytest.mark.parametrize("policy_p", [None, 0.5])
def test_micro_batch_forwards_before_their_backwards(kind, policy_p):
    _plain_and_wrapped(kind, _micro_batches, policy_p=policy_p)


def _gradient_penalty(case):
    """Double backward: a loss on the gradients themselves (create_graph=True)."""
    torch.manual_seed(0)
    params = [p for p in case.model.parameters() if p.requires_grad]
    loss = case.run(case.model)
    gs = torch.autograd.grad(loss, params + case.inputs, create_graph=True)
    penalty = sum((g * g).sum() for g in gs)
    penalty.backward()
    return list(gs) + [p.grad for p in params] + [x.grad for x in case.inputs]


@pytest.mark.parametrize("kind", ["square", "frozen_lora", "param_views", "custom_function", "multi_io"])
@pytest.mark.parametrize("policy_p", [None, 0.5])
def test_double_backward_matches_autograd(kind, policy_p):
    handle = _plain_and_wrapped(kind, _gradient_penalty, policy_p=policy_p)
    assert all(s["ops_replayed"] > 0 for s in handle.stats().values()) or policy_p is not None


def test_calibrating_overheads_draws_from_no_generator_the_model_uses(monkeypatch):
    from tapesac.profile import calibrate_overheads

    def no_public_api(*args, **kwargs):
        raise AssertionError("calibrate_overheads must not go through the public wrap()")

    monkeypatch.setattr(tapesac, "wrap", no_public_api)
    monkeypatch.setattr(tapesac.api, "wrap", no_public_api)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    record_s, replay_s = calibrate_overheads(torch.device("cpu"), ops=4, repeats=1)
    assert record_s >= 0 and replay_s >= 0
    assert torch.equal(torch.get_rng_state(), state)


def test_profiling_forwards_draw_the_same_random_numbers():
    """Timing repeats restore the generator: a dropout model's step and the next draws are unchanged."""
    from tapesac.profile import OpTimer

    expected, _ = grads(CASES["encoder_dropout"]())
    after = torch.get_rng_state()
    case = CASES["encoder_dropout"]()
    handle = tapesac.wrap(case.blocks)
    for s in handle.blocks:
        s.time_ops(OpTimer(repeats=3))
    actual, _ = grads(case)
    assert_identical(expected, actual)
    assert torch.equal(torch.get_rng_state(), after)
    assert all(op.time_s is not None for op in handle.tapes()[0].ops)
