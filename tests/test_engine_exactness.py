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
