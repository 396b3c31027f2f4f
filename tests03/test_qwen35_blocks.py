"""Qwen3.5's blocks (torchtitan 0.3) with flash-linear-attention's kernels as opaque as on a GPU.

On CPU the gated delta rule and the causal conv run as stand-ins whose forwards write their
outputs where no dispatcher sees (``torchtitan03_ext.fla_cpu``), as fla's Triton kernels do on a
GPU: TapeSAC must hold those outputs, never rebuild them. Each model trains for several AdamW
steps, replay-only and planned at a limit that forces recompute, with document boundaries
that move every step, and every loss and gradient is compared bit for bit with the same model
without TapeSAC.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torchtitan = pytest.importorskip("torchtitan")
if not torchtitan.__version__.startswith("0.3."):
    pytest.skip(f"torchtitan {torchtitan.__version__}: these tests need 0.3.x", allow_module_level=True)
pytest.importorskip("fla", reason="Qwen3.5 needs flash-linear-attention (fla-core)")

import tapesac  # noqa: E402
from tapesac.tape import UNSEEN  # noqa: E402
from torchtitan03_ext import fla_cpu  # noqa: E402

from . import qwen35  # noqa: E402

STEPS = 4
SHAPES = {"debugmodel": (4, 128), "debugmodel_moe": (4, 256)}
"""(rows, sequence) per flavor: enough tokens that activations, not the optimizer's state, set
the step peak, so the frontier has room between its ends."""


def assert_same(expected, actual) -> None:
    assert len(expected) == len(actual)
    for step, ((le, ge), (la, ga)) in enumerate(zip(expected, actual)):
        assert torch.equal(le, la), f"step {step}: loss {la.item()} != {le.item()}"
        assert ge.keys() == ga.keys()
        for n in ge:
            assert torch.equal(ge[n], ga[n]), f"step {step}: grad of {n} differs by {(ge[n] - ga[n]).abs().max()}"


def _train(flavor: str, handle_for=None):
    net = qwen35.model(flavor)
    handle = handle_for(qwen35.blocks(net)) if handle_for else None
    try:
        return handle, qwen35.train(net, STEPS, *SHAPES[flavor])
    finally:
        if handle is not None:
            handle.remove()


def _midpoint_limit(flavor: str) -> tuple[int, float, float]:
    """A limit halfway between the smallest and the largest useful predicted step peak."""
    net = qwen35.model(flavor)
    handle = tapesac.wrap(qwen35.blocks(net), memory_limit_bytes=1 << 40)
    try:
        qwen35.train(net, 3, *SHAPES[flavor])
        lo, hi = handle.plan.smallest_peak_bytes, handle.plan.largest_useful_peak_bytes
    finally:
        handle.remove()
    assert hi > lo, f"nothing to choose: {lo} = {hi}"
    return int(lo + 0.5 * (hi - lo)), lo, hi


@pytest.mark.parametrize("flavor", sorted(SHAPES))
def test_replay_only_is_exact_and_holds_what_the_kernels_wrote(flavor):
    expected = _train(flavor)[1]
    handle, actual = _train(flavor, tapesac.wrap)
    assert_same(expected, actual)
    stats = handle.stats()
    for i, tape in handle.tapes().items():
        unseen = [op for op in tape.ops if op.keep_only == UNSEEN]
        if i < qwen35.BLOCKS - 1:  # gated DeltaNet: q, k, v convs and the delta rule write unseen
            assert unseen and stats[i]["unseen_bytes"] > 0, f"block {i}: the kernels' outputs were not held"
            assert stats[i]["ops_replayed"] > 0
        else:  # full attention: every op is seen
            assert not unseen and stats[i]["unseen_bytes"] == 0


@pytest.mark.parametrize("flavor", sorted(SHAPES))
def test_planned_at_a_limit_that_forces_recompute_is_exact(flavor):
    limit, lo, hi = _midpoint_limit(flavor)
    expected = _train(flavor)[1]
    handle, actual = _train(flavor, lambda b: tapesac.wrap(b, memory_limit_bytes=limit))
    assert_same(expected, actual)
    plan = handle.plan
    assert plan is not None
    kept = [b.keep for b in plan.policy.blocks.values()]
    assert any(kept), "the plan keeps nothing"
    assert plan.allocation.recompute_s > 0, "the plan recomputes nothing at a limit below its top"


def test_moe_routing_moves_no_bytes_without_expert_parallelism():
    """torchtitan 0.3's MoE permutes the step's tokens x top-k into one tensor of fixed rows and
    runs the experts as one grouped_mm with offsets: what the router picks changes no value's
    size, so a plan made on one step's bytes holds on every step (docs/limits.md, "MoE routing").
    Two forwards of other tokens, each recorded afresh, route differently (checked) and make
    values of equal float sizes, with no data-dependent op on their tapes."""
    net = qwen35.model("debugmodel_moe")
    tokens, positions = qwen35.batch(0, rows=2, seq=128)
    first = _record_moe_step(net, tokens, positions)
    second = _record_moe_step(net, (tokens * 3 + 1) % qwen35.VOCAB, positions)
    assert any(not torch.equal(a, b) for a, b in zip(first[1], second[1])), "both routed alike: nothing shown"
    assert all(first[0].values()) and first[0] == second[0]


def _record_moe_step(net, tokens: torch.Tensor, positions: torch.Tensor):
    """(float value sizes per block, tokens routed per expert per block) of one forward and
    backward, recorded by a fresh TapeSAC handle."""
    moe_blocks = qwen35.blocks(net)
    before = [b.moe.tokens_per_expert_E.clone() for b in moe_blocks]
    handle = tapesac.wrap(moe_blocks)
    try:
        with qwen35._PartialDTensor():
            logits = net(tokens, attention_masks=net.get_attention_masks(positions), positions=positions,
                         special_tokens=dict(qwen35.TEXT_ONLY_SPECIAL_TOKENS))
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten()).backward()
        tapes = handle.tapes()
    finally:
        handle.remove()
    for i, tape in tapes.items():
        dependent = [tape.op_name(j) for j, op in enumerate(tape.ops) if op.keep_only not in (None, UNSEEN)]
        assert not dependent, f"block {i}: data-dependent ops {dependent}"
    sizes = {i: [(tuple(v.shape), v.nbytes) for v in tape.values
                 if isinstance(v.dtype, torch.dtype) and v.dtype.is_floating_point] for i, tape in tapes.items()}
    return sizes, [b.moe.tokens_per_expert_E - t for b, t in zip(moe_blocks, before)]


def test_the_stand_ins_compute_fla_s_reference_per_document():
    """Against fla's recurrent reference run on each document alone, with the L2 norm outside."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    T, H, K, V = 37, 2, 8, 6
    cu = torch.tensor([0, 10, 30, 37])
    q, k = torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, H, V, generator=g)
    gate, beta = -torch.rand(1, T, H, generator=g), torch.rand(1, T, H, generator=g)
    inputs = [t.requires_grad_() for t in (q, k, v, gate, beta)]
    out, final = fla_cpu.chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                                cu_seqlens_cpu=cu)
    assert final is None
    ref = torch.cat([naive_recurrent_gated_delta_rule(F.normalize(q[:, s:e], dim=-1), F.normalize(k[:, s:e], dim=-1),
                                                      v[:, s:e], beta[:, s:e], gate[:, s:e])[0]
                     for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad((out * out).sum(), inputs), torch.autograd.grad((ref * ref).sum(), inputs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    x, w = torch.randn(1, T, 5, generator=g), torch.randn(5, 4, generator=g)
    y, _ = fla_cpu.causal_conv1d(x, w, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each document from a zero state
        alone = F.silu(F.conv1d(F.pad(x[:, s:e].transpose(1, 2), [3, 0]), w.unsqueeze(1), groups=5)).transpose(1, 2)
        torch.testing.assert_close(y[:, s:e], alone)


def test_the_stand_ins_refuse_what_they_do_not_compute():
    t = torch.zeros(1, 4, 1, 2)
    with pytest.raises(NotImplementedError, match="run this model on a GPU"):
        fla_cpu.chunk_gated_delta_rule(t, t, t, t[..., 0], t[..., 0], initial_state=torch.zeros(1, 1, 2, 2))
    with pytest.raises(NotImplementedError, match="run this model on a GPU"):
        fla_cpu.causal_conv1d(torch.zeros(1, 4, 2), torch.zeros(2, 4), bias=torch.zeros(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fla's Triton kernels")
@pytest.mark.parametrize("flavor", sorted(SHAPES))
def test_cuda_fla_kernels_are_recorded_launches_and_replay_only_is_exact(flavor):
    """On a GPU the real fla kernels run: their launches are tape steps (recorder invariant 11),
    replay relaunches them, and every step is bit-identical to plain autograd."""
    def run(wrap: bool):
        net = qwen35.model(flavor, device="cuda")
        handle = tapesac.wrap(qwen35.blocks(net)) if wrap else None
        try:
            return handle, qwen35.train(net, STEPS, *SHAPES[flavor])
        finally:
            if handle is not None:
                handle.remove()

    expected = run(False)[1]
    handle, actual = run(True)
    assert_same(expected, actual)
    stats = handle.stats()
    assert all(stats[i]["kernel_launches"] > 0 for i in range(qwen35.BLOCKS - 1)), stats
