"""Qwen3.5 under torch.compile: fla's kernels as ``torch.library`` custom ops.

torchtitan 0.3 compiles each block with ``fullgraph=True``, and fla-core 0.6.0's gated delta rule
is ``torch.compiler.disable``d: dynamo refuses the DeltaNet blocks while tracing, before any kernel
runs, on any device. Wrapping the kernels as custom ops is what makes them compile. On CPU,
``torchtitan03_ext.fla_cpu.use_custom_ops`` runs the stand-ins that way; these tests check that
the custom ops compute exactly what the opaque stand-ins compute, that they compile whole, and
that TapeSAC, eager and compiled, trains through them exactly as without it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")
if not torchtitan.__version__.startswith("0.3."):
    pytest.skip(f"torchtitan {torchtitan.__version__}: these tests need 0.3.x", allow_module_level=True)
pytest.importorskip("fla", reason="Qwen3.5 needs flash-linear-attention (fla-core)")

import tapesac  # noqa: E402
from tapesac.compiled import MappingWarning, TapePolicy  # noqa: E402
from tapesac.tape import UNSEEN  # noqa: E402
from torchtitan03_ext import fla_cpu  # noqa: E402

from . import qwen35  # noqa: E402
from .test_qwen35_blocks import SHAPES, STEPS, assert_same  # noqa: E402

DELTA_RULE = torch.ops.tapesac_fla.chunk_gated_delta_rule.default
CONV = torch.ops.tapesac_fla.causal_conv1d.default


@pytest.fixture
def custom_ops():
    fla_cpu.use_custom_ops()
    try:
        yield
    finally:
        fla_cpu.use_custom_ops(False)


def _inputs(seed: int = 0, T: int = 45, H: int = 2, K: int = 8, V: int = 6):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, H, V, generator=g)
    gate, beta = -torch.rand(1, T, H, generator=g), torch.rand(1, T, H, generator=g)
    w = torch.randn(H * V, 4, generator=g)
    return [t.requires_grad_() for t in (q, k, v, gate, beta, w)]


def _delta_rule_then_conv(rule, conv, q, k, v, gate, beta, w, cu):
    o, _ = rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu)
    y, _ = conv(o.flatten(2), w, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu)
    return y


def test_fla_s_own_gated_delta_rule_stops_a_fullgraph_compile():
    """What torchtitan 0.3 meets with ``--compile.enable`` on Qwen3.5 and fla-core 0.6.0: dynamo
    refuses the compile-disabled kernel while tracing (no kernel runs: the device plays no part)."""
    from torchtitan.models.qwen3_5 import model as qwen35_model

    fla_rule = getattr(qwen35_model._fla_chunk_gated_delta_rule, "__wrapped__", qwen35_model._fla_chunk_gated_delta_rule)
    q, k, v, gate, beta, _w = _inputs()

    def block(q, k, v, gate, beta):
        return fla_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)[0]

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch\.compiler\.disable"):
        torch.compile(block, fullgraph=True, backend="eager")(q, k, v, gate, beta)


def test_the_custom_ops_compute_what_the_opaque_stand_ins_compute_bit_for_bit():
    inputs, cu = _inputs(), torch.tensor([0, 17, 40, 45], dtype=torch.int32)
    opaque = _delta_rule_then_conv(fla_cpu.chunk_gated_delta_rule, fla_cpu.causal_conv1d, *inputs, cu)
    ops = _delta_rule_then_conv(fla_cpu.chunk_gated_delta_rule_op, fla_cpu.causal_conv1d_op, *inputs, cu)
    assert torch.equal(opaque, ops)
    for a, b in zip(torch.autograd.grad(opaque.square().sum(), inputs), torch.autograd.grad(ops.square().sum(), inputs)):
        assert torch.equal(a, b), (a - b).abs().max()


def test_the_custom_ops_compile_whole_with_fullgraph():
    inputs, cu = _inputs(1), torch.tensor([0, 30, 45], dtype=torch.int32)
    ops = (fla_cpu.chunk_gated_delta_rule_op, fla_cpu.causal_conv1d_op)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    eager = _delta_rule_then_conv(*ops, *inputs, cu)
    compiled = torch.compile(lambda *a: _delta_rule_then_conv(*ops, *a), fullgraph=True, backend=backend)(*inputs, cu)
    assert DELTA_RULE.overloadpacket in seen or DELTA_RULE in seen, seen
    assert torch.equal(eager, compiled)
    for a, b in zip(torch.autograd.grad(eager.sum(), inputs), torch.autograd.grad(compiled.sum(), inputs)):
        assert torch.equal(a, b)


def test_the_custom_ops_refuse_what_they_do_not_compute():
    t = torch.zeros(1, 4, 1, 2)
    with pytest.raises(NotImplementedError, match="run this model on a GPU"):
        fla_cpu.chunk_gated_delta_rule_op(t, t, t, t[..., 0], t[..., 0], use_qk_l2norm_in_kernel=False)
    with pytest.raises(ValueError, match="batch size 1"):
        cu = torch.tensor([0, 4])
        fla_cpu.causal_conv1d_op(torch.zeros(2, 4, 2), torch.zeros(2, 4), cu_seqlens=cu, cu_seqlens_cpu=cu)


def _midpoint_limit(rows: int, seq: int, flavor: str = "debugmodel") -> int:
    """Halfway between the smallest and the largest useful predicted step peak (eager)."""
    net = qwen35.model(flavor)
    handle = tapesac.wrap(qwen35.blocks(net), memory_limit_bytes=1 << 40)
    try:
        qwen35.train(net, 3, rows, seq)
        lo, hi = handle.plan.smallest_peak_bytes, handle.plan.largest_useful_peak_bytes
    finally:
        handle.remove()
    assert hi > lo
    return int(lo + 0.5 * (hi - lo))


def test_planned_with_the_kernels_as_custom_ops_is_exact_and_replays_them(custom_ops):
    """The kernels are ops the dispatcher sees: nothing is written unseen, and a plan may
    recompute them like any op."""
    limit = _midpoint_limit(*SHAPES["debugmodel"])
    expected = qwen35.train(qwen35.model("debugmodel"), STEPS, *SHAPES["debugmodel"])
    net = qwen35.model("debugmodel")
    handle = tapesac.wrap(qwen35.blocks(net), memory_limit_bytes=limit)
    try:
        actual = qwen35.train(net, STEPS, *SHAPES["debugmodel"])
        tapes, plan = handle.tapes(), handle.plan
    finally:
        handle.remove()
    assert_same(expected, actual)
    for i, tape in tapes.items():
        assert not [op for op in tape.ops if op.keep_only == UNSEEN], f"block {i}: an op wrote unseen"
        if i < qwen35.BLOCKS - 1:  # gated DeltaNet
            assert {DELTA_RULE, CONV} <= {op.func for op in tape.ops}
    assert plan.allocation.recompute_s > 0, "the plan recomputes nothing at a limit below its top"


@pytest.mark.parametrize("flavor", sorted(SHAPES))
def test_compiled_mode_maps_the_deltanet_blocks_and_trains_as_compile_without_ac(custom_ops, monkeypatch, flavor):
    """Compiled mode on Qwen3.5 with its kernels as custom ops: every block's plan maps onto its
    compiled trace (the DeltaNet's CPU offsets, ``torch.tensor(list)``, trace as one
    ``scalar_tensor`` per value once their values are symbolic: compiled invariant 1d), and the
    losses stay within compile's tolerance of compile without activation checkpointing."""
    from torchtitan03_ext.activation_checkpoint import _compile_like_torchtitan

    lifts = []
    spell = TapePolicy._lift_on
    monkeypatch.setattr(TapePolicy, "_lift_on", lambda self, run, func, *a: lifts.append(func) or spell(
        self, run, func, *a))
    steps = 6
    # As the trainer's compiled mode: torchtitan's dynamo settings, and RoPE's eager-only check
    # of positions skipped in eager forwards too.
    options = _compile_like_torchtitan(qwen35.model(flavor), {"backend": "inductor"})
    reference = qwen35.model(flavor)
    for block in qwen35.blocks(reference):
        block.compile()
    expected = qwen35.train(reference, steps, *SHAPES[flavor])
    limit = _midpoint_limit(*SHAPES[flavor], flavor)
    net = qwen35.model(flavor)
    handle = tapesac.wrap(qwen35.blocks(net), memory_limit_bytes=limit, compile=True, compile_options=options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", MappingWarning)
            actual = qwen35.train(net, steps, *SHAPES[flavor])
        stats = handle.stats()
        plan = handle.plan.policy.blocks
        broken = [b.index for b in handle.blocks if b.compiled is not None and b.compiled.broken]
    finally:
        handle.remove()
    assert not broken
    assert any(plan[b].keep and not plan[b].passthrough for b in range(qwen35.BLOCKS - 1)), \
        "no DeltaNet block runs a plan that keeps some values and recomputes others: nothing mapped"
    assert all(s["compiled"] for s in stats.values()), stats
    assert torch.ops.aten.stack.default in lifts, "no trace spelled the offsets as scalars: 1d not shown"
    diffs = [abs(le - la).item() for (le, _), (la, _) in zip(expected, actual)]
    assert max(diffs) <= 1e-4, diffs
