"""Forwards that follow a verified tape (VerifiedTape) instead of recording stay exact, and any
change of program, even one that keeps every shape, is recorded, never replayed from a stale tape.

Every test trains several steps with TapeSAC and without, compares the gradients bit for bit at
every step, and checks from the blocks' stats that the steps it is about really followed (or
really departed), so none of them can pass by never taking the path it tests.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import tapesac

from .blocks import CASES, Case, assert_identical, grads
from .unseen import host

STEPS = 5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _followed(handle) -> list[bool]:
    return [bool(s.get("followed")) for s in handle.stats().values()]


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe", "encoder_dropout", "inplace", "param_views",
                                  "nograd_branch", "frozen_lora", "multi_io", "custom_function"])
def test_followed_steps_match_plain_autograd(name):
    """Step after step on the engine's block kinds (dropout draws new numbers every step, MoE
    routes tokens differently every step): bit-identical, and the later steps follow."""
    plain, wrapped = CASES[name](), CASES[name]()
    handle = tapesac.wrap(wrapped.blocks)
    followed = []
    for step in range(STEPS):
        expected, _ = grads(plain, seed=step)
        actual, _ = grads(wrapped, seed=step)
        assert_identical(expected, actual)
        followed.append(_followed(handle))
    assert not any(followed[0]) and not any(followed[1])  # recorded twice before following
    # Recorded every step by design (VerifiedTape.eligible): "inplace" writes a tensor through
    # another alias. qwen3_moe's routing changes split sizes, so its blocks may depart.
    if name not in ("inplace", "qwen3_moe"):
        assert all(followed[-1]), f"{name}: the last step did not follow: {followed}"


def test_followed_steps_match_under_a_keep_set():
    """Planned mode's fixed keep set, applied as a policy: followed forwards hold what the
    recorded ones held and replay the rest, bit for bit."""
    plain, wrapped = CASES["llama3"](), CASES["llama3"]()
    handle = tapesac.wrap(wrapped.blocks)
    grads(wrapped)
    policy = _keep_every_other(handle)
    handle.set_policy(policy)
    kept = []
    for step in range(STEPS):
        assert_identical(grads(plain, seed=step)[0], grads(wrapped, seed=step)[0])
        kept.append([s["kept_bytes"] for s in handle.stats().values()])
    assert all(_followed(handle))
    assert kept[-1] == kept[1] and all(b > 0 for b in kept[-1])


def _keep_every_other(handle) -> tapesac.policy.Policy:
    from tapesac.policy import BlockPolicy, Policy
    from tapesac.tape import PRODUCED

    blocks = {}
    for i, tape in handle.tapes().items():
        read = [tape.position(v.vid) for v in tape.values if v.reads and v.kind == PRODUCED and not v.free]
        blocks[i] = BlockPolicy(tape.signature(), read[::2])
    return Policy(blocks)


def test_shapes_that_alternate_follow_each_its_own_tape():
    """Two sequence lengths in turn: each gets its own verified tape and follows it."""
    from .loops import Block  # attention + MLP, as the planned-loop tests use

    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block())
    wrapped = copy.deepcopy(plain)
    handle = tapesac.wrap(list(wrapped))
    for step in range(8):
        x = torch.randn(2, 8 if step % 2 else 12, 32)
        for m in (plain, wrapped):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {n}"
        if step >= 4:
            assert all(_followed(handle)), f"step {step} did not follow"


class Branchy(nn.Module):
    """A block whose program depends on the data while every shape stays the same.

    ``kind`` picks what changes when the input's mean changes sign:
    * ``op``: which comparison makes the mask autograd saves (``gt`` or ``lt``);
    * ``wiring``: which of two intermediate tensors a product reads;
    * ``constant``: a scale read from the data with ``.item()``;
    * ``length``: how many ops run (one more ``tanh``);
    * ``random``: dropout applied or not.
    """

    def __init__(self, kind: str, d: int = 8) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        flag = bool(x.mean() > 0)
        if self.kind == "op":
            mask = h > 0 if flag else h < 0
            return torch.where(mask, h * h, self.b(h))
        if self.kind == "wiring":
            u, v = h.sin(), h.cos()
            return self.b(h * (u if flag else v))
        if self.kind == "constant":
            scale = x.abs().mean().item()
            return self.b((h * scale).tanh())
        if self.kind == "length":
            g = h.tanh()
            if flag:
                g = g.tanh()
            return self.b(g * h)
        if self.kind == "random":
            g = nn.functional.dropout(h, 0.5) if flag else h * 1.0
            return self.b(g.tanh())
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["op", "wiring", "constant", "length", "random"])
def test_a_program_that_changes_with_the_data_is_recorded_not_replayed_stale(kind):
    torch.manual_seed(0)
    plain = nn.Sequential(Branchy(kind), Branchy(kind))
    wrapped = copy.deepcopy(plain)
    handle = tapesac.wrap(list(wrapped))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    signs = [1, 1, 1, -1, -1, 1, -1, 1, 1, -1]  # the branch flips with shapes unchanged
    departed = followed = 0
    for step, sign in enumerate(signs):
        x = (torch.rand(4, 8) + 0.1) * sign
        for m, opt in zip((plain, wrapped), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            m(x).pow(2).sum().backward()
        for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(p.grad, q.grad), f"{kind}, step {step}: {n} differs"
        for opt in opts:
            opt.step()
        f = _followed(handle)
        followed += f[0]
        if step and sign != signs[step - 1] and kind != "constant":
            departed += not f[0]
    assert followed > 0, f"{kind}: no step followed, so nothing was tested"
    if kind != "constant":  # a new constant is data: followed, and replayed with the new value
        assert departed > 0, f"{kind}: the branch flipped, yet every forward followed the old tape"


def test_a_departure_mid_block_keeps_what_was_followed():
    """The program departs after many followed ops: the forward hands its followed prefix over
    to a recording (same values, same holds) and is exact."""
    kind = "length"
    torch.manual_seed(1)
    plain = nn.Sequential(Branchy(kind), Branchy(kind))
    wrapped = copy.deepcopy(plain)
    handle = tapesac.wrap(list(wrapped))
    # Optimizer steps move the parameters' versions between forwards: the recording a departure
    # starts holds this forward's versions of the weights' transposes (their tensors are gone by
    # then, only the held aliases remain), not the verified forward's.
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    for step, sign in enumerate([1, 1, 1, 1, -1, -1, -1, 1]):
        x = (torch.rand(3, 8) + 0.1) * sign
        for m, opt in zip((plain, wrapped), opts):
            opt.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
        for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {n}"
        for opt in opts:
            opt.step()
    assert all(s["ops_recorded"] > 0 for s in handle.stats().values())


def test_debug_mode_never_follows():
    case = CASES["llama3"]()
    handle = tapesac.wrap(case.blocks, debug=True)
    for step in range(4):
        grads(case, seed=step)
    assert not any(_followed(handle))


def test_moe_routing_that_changes_every_step_stays_exact():
    """qwen3 MoE whose router changes every step (the same random nudge in both models): tokens
    per expert, hence split sizes, change from step to step; data, not a new program."""
    plain, wrapped = CASES["qwen3_moe"](), CASES["qwen3_moe"]()
    handle = tapesac.wrap(wrapped.blocks)
    gen = torch.Generator().manual_seed(3)

    class Nudge:
        def step(self):
            for b in range(len(plain.blocks)):
                noise = torch.randn(plain.blocks[b].moe.router.gate.weight.shape, generator=gen)
                with torch.no_grad():
                    for c in (plain, wrapped):
                        c.blocks[b].moe.router.gate.weight.add_(noise)

    opts = [Nudge()]
    followed, splits = [], set()
    load = wrapped.blocks[0].moe.tokens_per_expert  # accumulated over steps
    for step in range(6):
        before = load.clone()
        expected, _ = grads(plain, seed=step)
        actual, _ = grads(wrapped, seed=step)
        assert_identical(expected, actual)
        followed.append(_followed(handle))
        splits.add(tuple((load - before).tolist()))
        for opt in opts:
            opt.step()
    assert len(splits) > 2, "tokens per expert never changed: nothing was tested"
    # New split sizes are data, not a new program: after two recordings every forward follows.
    assert all(all(f) for f in followed[2:]), followed



def test_planned_steps_follow_their_verified_plan():
    """Planned mode: once a plan is verified, its recorded blocks follow (the exactness of the
    whole run is asserted by ``planned`` against unwrapped training)."""
    from .loops import LOOPS
    from .test_planned_loops import planned, span

    loop, model_fn = LOOPS["accumulate_interleaved"]
    lo, hi = span(model_fn, loop, 48)
    handle, _ = planned(model_fn, loop, [48] * 7, lo + 0.5 * (hi - lo))
    assert handle.plan is not None and any(b.keep for b in handle.plan.policy.blocks.values())
    recorded = [s for s in handle.stats().values() if not s["passthrough"]]
    assert recorded and all(s["followed"] for s in recorded), handle.stats()


class _DTensorBlock(nn.Module):
    """DTensor code that builds and reads DTensors outside the dispatcher (recorder invariant 8)."""

    def __init__(self, variant: str, mesh) -> None:
        super().__init__()
        self.variant, self.mesh = variant, mesh
        self.w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 0.3)

    def forward(self, h):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.variant == "redistribute":  # Shard -> Replicate: a functional all-gather
            d = DTensor.from_local(h, self.mesh, [Shard(1)], run_check=False).redistribute(self.mesh, [Replicate()])
            return h + (torch.relu(d) * d).to_local() @ self.w
        if self.variant == "unseen_local":  # a kernel on the local shard (local_map), its output wrapped
            local = (h @ self.w).tanh()
            out = torch.empty_like(local)
            np.multiply(host(local), 3.0, out=host(out))  # written where no dispatcher sees
            wrapped = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
            return (h @ self.w) * wrapped.to_local().view(h.shape)
        d = DTensor.from_local(h @ self.w, self.mesh, [Replicate()], run_check=False)
        if self.variant == "to_from_local":
            return h + (torch.tanh(d) * d).to_local()
        a = torch.sigmoid(d)
        with torch.no_grad():  # to_local() is the shard itself here; d's own counter does not move
            d.to_local().mul_(2.0)
        return (a * d).to_local()


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["to_from_local", "shard_write", "redistribute", "unseen_local"])
def test_dtensor_steps_are_followed_exactly(one_rank_mesh, variant):
    """The recorder's DTensor steps (to_local, from_local, redistribute) are followed, and a
    DTensor read again after a write through its shard maps to its new value, as recorded. A
    buffer written unseen stays unwritten through a DTensor's wrap and unwrap: what is read of it
    is held, never rebuilt from the allocation (recorder invariants 8 and 10)."""
    def run(wrapped: bool):
        block = _DTensorBlock(variant, one_rank_mesh)
        pre = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
        handle = tapesac.wrap([block]) if wrapped else None
        out, followed = [], []
        for step in range(STEPS):
            x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
            block(x @ pre).pow(2).sum().backward()
            out.append((pre.grad.clone(), block.w.grad.clone()))
            pre.grad = block.w.grad = None
            if handle is not None:
                followed += _followed(handle)
        return out, followed

    expected, _ = run(False)
    actual, followed = run(True)
    for (ep, ew), (ap, aw) in zip(expected, actual):
        assert torch.equal(ep, ap) and torch.equal(ew, aw)
    assert followed[2:] == [True] * (STEPS - 2), followed


class _SavedBeforeRead(nn.Module):
    """Autograd saves an op's inputs before the op reaches the dispatcher: here the block's own
    weight and a tensor that is neither an input nor a parameter (a plain attribute) are saved
    before any op binds them, and the attribute is off the tape's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = torch.randn(8)  # not a parameter, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


@pytest.mark.parametrize("name", ["llama3", "saved_before_read"])
def test_followed_forwards_report_what_recorded_ones_do(name):
    """A followed forward counts the same off-tape bytes (saved tensors on no tape value, not
    the block's own parameters) and keeps the same bytes as a forward recorded in full."""

    def make():
        if name == "llama3":
            return CASES[name]()
        torch.manual_seed(0)
        model = nn.Sequential(_SavedBeforeRead(), _SavedBeforeRead())
        x = torch.randn(4, 8, requires_grad=True)
        return Case(model, list(model), lambda m: m(x).pow(2).sum(), [x])

    stats = {}
    for follow in (True, False):
        model = make()
        handle = tapesac.wrap(model.blocks)
        for state in handle.blocks:
            state.follow = follow
        for step in range(4):
            grads(model, seed=step)
        stats[follow] = handle.stats()
    for index, s in stats[True].items():
        assert s["followed"] and not stats[False][index]["followed"]
        for key in ("off_tape_bytes", "kept_bytes", "input_bytes", "ops_recorded", "values_read"):
            assert s[key] == stats[False][index][key], (index, key)
    if name == "saved_before_read":  # the attribute and the block's input count, the weight does not
        assert all(s["off_tape_bytes"] == 8 * 4 + 4 * 8 * 4 for s in stats[True].values())
