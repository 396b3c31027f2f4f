"""Compiled mode (``tapesac.wrap(..., compile=True)``): the plan runs as a checked SAC policy
under ``torch.compile`` (``tapesac/compiled.py``).

Compiled numerics are not eager's, so the promise here is against ``torch.compile`` without
activation checkpointing (same inductor config): the loss curve over 10 steps agrees within
``LOSS_TOL``. Measured on CPU (torch 2.13, inductor): the largest difference over the 10 steps
was 4.8e-7 (one float32 ulp at a loss of 4.3), the same as between eager and compiled without
AC. ``LOSS_TOL`` = 1e-5 (about 20 ulp) leaves room for other CPUs' kernels while a wrong
gradient (one step of AdamW at lr 1e-3 moves the loss by ~1e-2) fails it by orders of magnitude.

Compiling on CPU is slow: blocks are tiny, and each test compiles at most three graphs.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tapesac
from tapesac.autoplan import PlanConfig, RAISE_HEADROOM, RAISE_MARGIN
from tapesac.compiled import MappingWarning, TapePolicy
from tapesac.errors import WrapError
from tapesac.policy import BlockPolicy, Policy

from .loops import Block, Model, tokens

LOSS_TOL = 1e-5
GRAD_TOL = 1e-6
"""Largest measured gradient difference against compiled without AC: 1.7e-8."""


class UnbindBlock(Block):
    """``loops.Block`` with its q, k, v split by ``unbind``: eager and compiled traces run the
    same ops. (``Block`` unpacks a tensor, which eager runs as ``unbind`` and dynamo traces as
    three ``select``: a spelling the mapping accepts, ``tests/test_compiled_mapping.py``.)"""

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Departing(torch.nn.Module):
    """Runs another program under compile than eagerly; ``how`` says which."""

    def __init__(self, how: str = "another op") -> None:
        super().__init__()
        self.how = how
        self.lin = torch.nn.Linear(32, 96)

    def forward(self, x):
        t = self.lin(x).view(*x.shape[:-1], 3, 32).movedim(-2, 0)
        compiling = torch.compiler.is_compiling()
        if self.how == "another op":
            q, k, v = t
            h = q + q if compiling else q * 2
        else:  # the same values, but not how dynamo spells unpacking (selects out of order)
            if compiling:
                k, q, v = t[1], t[0], t[2]
            else:
                q, k, v = t
            h = q
        return torch.tanh(h) * k + v


def unbind_model(blocks: int = 2) -> Model:
    model = Model(blocks=blocks)
    torch.manual_seed(0)
    model.layers = torch.nn.ModuleList(UnbindBlock() for _ in range(blocks))
    return model


def assert_runs_a_plan_measured_within(handle, limit: int) -> None:
    """Every plan was measured; the one steps run under now measured within ``limit`` (a plan
    over it is re-planned tighter; one raised into measured slack may overshoot on its one
    measured step, and is then dropped)."""
    history = handle.planner.history
    within = [h for h in history if h["measured_peak_bytes"] <= limit]
    if all(e.verified for e in handle.planner.plans.values()):  # else a re-plan awaits its measure
        assert handle.plan.policy.predicted_peak_bytes == within[-1]["predicted_peak_bytes"], history


def train(model: Model, steps: int, seq: int = 32) -> list[tuple[torch.Tensor, dict]]:
    """(loss, gradients) per step. No storage counter around the steps: dynamo does not compile
    under a dispatch mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(tokens(step, 0, seq))
        loss.backward()
        opt.step()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def recorded_tape(block: torch.nn.Module, x: torch.Tensor):
    handle = tapesac.wrap([block])
    block(x).sum().backward()
    tape = handle.tapes()[0]
    handle.remove()
    return tape


def saved_activation_bytes(out: torch.Tensor, block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages the compiled forward saved for backward, parameters and input left
    out (the compiled graph's backward node holds them all)."""
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward", "the block did not run compiled"
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in out.grad_fn.saved_tensors if t.untyped_storage().data_ptr() not in skip}
    return sum(storages.values())


def compiled_forward(block, x, keep, signature):
    """Wrap ``block`` in compiled mode with a fixed policy; the first forward records the tape
    eagerly, the second runs compiled. Returns (eager kept bytes, compiled saved bytes, grad of x,
    warnings of the compiled forward)."""
    handle = tapesac.wrap([block], policy=Policy({0: BlockPolicy(signature, keep)}), compile=True)
    try:
        out = block(x)
        assert not handle.stats()[0]["compiled"]
        kept = handle.stats()[0]["kept_bytes"]
        out.sum().backward()
        x.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MappingWarning)
            out = block(x)
        assert handle.stats()[0]["compiled"]
        saved = saved_activation_bytes(out, block, x)
        out.sum().backward()
        return kept, saved, x.grad.clone(), [w for w in caught if w.category is MappingWarning], handle
    finally:
        handle.remove()


def test_compiled_forward_saves_exactly_what_the_plan_keeps():
    torch.manual_seed(0)
    block, x = UnbindBlock(), torch.randn(4, 32, 32, requires_grad=True)
    tape = recorded_tape(block, x)
    matmuls = [(i, 0) for i, op in enumerate(tape.ops) if op.func is torch.ops.aten.addmm.default]
    assert len(matmuls) == 4
    _, nothing, grad_nothing, warned, _ = compiled_forward(block, x, [], tape.signature())
    assert not warned
    kept, saved, grad_kept, warned, _ = compiled_forward(block, x, matmuls, tape.signature())
    assert not warned
    # The plan keeps the addmm outputs backward reads (the last one's is never read): eager
    # TapeSAC holds exactly those bytes, and the compiled forward saves exactly them on top of
    # what it saves when the plan keeps nothing.
    assert kept == (128 * 96 + 128 * 32 + 128 * 128) * 4
    assert saved - nothing == kept
    torch.testing.assert_close(grad_kept, grad_nothing, rtol=0, atol=GRAD_TOL)


def test_a_trace_that_departs_from_the_tape_warns_and_runs_full_ac():
    torch.manual_seed(0)
    block, x = Departing(), torch.randn(4, 32, 32, requires_grad=True)
    tape = recorded_tape(block, x)
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    matmuls = [(i, 0) for i, op in enumerate(tape.ops) if op.func is torch.ops.aten.addmm.default]
    handle = tapesac.wrap([block], policy=Policy({0: BlockPolicy(tape.signature(), matmuls)}), compile=True)
    try:
        block(x).sum().backward()  # eager: records the tape the plan refers to
        with pytest.warns(MappingWarning, match=r"block 0: .*aten\.add\.Tensor where the tape has aten\.mul\.Tensor"):
            out = block(x)
        x.grad = None
        out.sum().backward()
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=GRAD_TOL)  # the departing forward is exact
        with warnings.catch_warnings():
            warnings.simplefilter("error", MappingWarning)  # warned once, not every forward
            out = block(x)
        fallback_saved = saved_activation_bytes(out, block, x)
        x.grad = None
        out.sum().backward()
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=GRAD_TOL)
    finally:
        handle.remove()
    # Full AC from then on: the forward saves what torch's own full AC under compile saves.
    full_ac = torch.compile(lambda t: checkpoint(block, t, use_reentrant=False))
    assert fallback_saved == saved_activation_bytes(full_ac(x), block, x)


def test_planned_compiled_loss_curve_matches_compile_without_ac():
    steps = 10
    reference = unbind_model()
    for block in reference.layers:
        block.compile()
    expected = train(reference, steps)

    model = unbind_model()
    # A limit at which the plans keep some values, not all (asserted below); the first compiled
    # plan measured 989,300 bytes here.
    limit = 1_100_000
    handle = tapesac.wrap(model.layers, memory_limit_bytes=limit, compile=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", MappingWarning)
            actual = train(model, steps)
        stats = handle.stats()
        plan = handle.plan.policy.blocks
        history = handle.planner.history
        assert_runs_a_plan_measured_within(handle, limit)
    finally:
        handle.remove()
    assert any(plan[b].keep and not plan[b].passthrough for b in plan), "the plan should keep some values"
    assert all(s["compiled"] for s in stats.values()), "planned steps should run compiled"
    assert history
    diffs = [abs(le - la).item() for (le, _), (la, _) in zip(expected, actual)]
    assert max(diffs) <= LOSS_TOL, diffs
    for name, grad in expected[-1][1].items():
        torch.testing.assert_close(actual[-1][1][name], grad, rtol=0, atol=GRAD_TOL)


def test_accumulated_micro_batches_run_compiled_under_one_plan():
    """A step of two micro-batches (forwards first, then backwards) is planned as one step."""
    def train_accumulating(model: Model, steps: int) -> list[torch.Tensor]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            micro = [model(tokens(step, m, 32)) / 2 for m in range(2)]
            for loss in micro:
                loss.backward()
            opt.step()
            losses.append(sum(loss.detach() for loss in micro))
        return losses

    reference = unbind_model()
    for block in reference.layers:
        block.compile()
    expected = train_accumulating(reference, 6)
    model = unbind_model()
    # Mid-frontier for this loop (eager planned mode measured 982140 to 1803380 bytes).
    limit = 1_550_000
    handle = tapesac.wrap(model.layers, memory_limit_bytes=limit, compile=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", MappingWarning)
            actual = train_accumulating(model, 6)
        plan = handle.plan.policy.blocks
        assert any(plan[b].keep and not plan[b].passthrough for b in plan), "the plan should keep some values"
        assert_runs_a_plan_measured_within(handle, limit)
        assert handle.planner.last_step_mode in ("planned", "verified")  # under the plan
        assert all(s["compiled"] for s in handle.stats().values())
        assert len(handle.planner.plans) == 1  # one step shape, one plan
    finally:
        handle.remove()
    diffs = [abs(e - a).item() for e, a in zip(expected, actual)]
    assert max(diffs) <= LOSS_TOL, diffs


def test_compile_settings_are_checked_when_wrapping():
    model = Model(blocks=1)
    with pytest.raises(WrapError, match="compile_options given without compile=True"):
        tapesac.wrap(model.layers, compile_options={"backend": "eager"})
    with pytest.raises(WrapError, match="debug=True"):
        tapesac.wrap(model.layers, compile=True, debug=True)
    model.layers[0].compile()
    with pytest.raises(WrapError, match=r"compile=True"):
        tapesac.wrap(model.layers)


class InplaceBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)
        return torch.tanh(y) * x


def test_a_kept_value_written_in_place_later_is_recomputed_not_saved():
    torch.manual_seed(0)
    block, x = InplaceBlock(), torch.randn(4, 8, requires_grad=True)
    tape = recorded_tape(block, x)
    keep_all = {tape.position(v.vid) for v in tape.values if v.op >= 0}
    policy = TapePolicy(0, tape, keep_all)
    saved = dict(zip(map(str, policy.expected), policy.save))
    # addmm's output is written by mul_ afterwards: SAC would refuse it in backward ("Tensor
    # cached during selective activation checkpoint has been mutated"), so neither is saved.
    assert saved == {"aten.t.default": True, "aten.addmm.default": False, "aten.mul_.Tensor": False,
                     "aten.tanh.default": True, "aten.mul.Tensor": True}
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    out = checkpoint(block, x, use_reentrant=False, context_fn=policy.context_fn)  # eager SAC
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected)
    assert policy.check() is None


def test_compiled_steps_are_measured_compiled_and_plans_grow_into_the_slack():
    """On CPU the first step under each plan compiles it and the second, compiled too, is
    measured from the allocator's events; a step well under the limit re-plans for the limit
    raised by its slack, so the next plan keeps more; the plan kept was measured within."""
    model = unbind_model()
    # Sequences of 256 tokens. Compiled mode's predicted frontier spans 3.30 to 6.33 MB; the first
    # plan at this limit (predicted 3.93 MB) measured 3,418,996 bytes (fused kernels make fewer
    # transients than the eager memory model counts), so there is slack to raise into.
    limit = 4_000_000
    torch._dynamo.reset()  # compiled code of earlier tests must not change what this one compiles
    handle = tapesac.wrap(model.layers, compile=True,
                          plan_config=PlanConfig(memory_limit_bytes=limit, compiled_raise_into_slack=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured_ran_compiled = []
    try:
        for step in range(8):
            opt.zero_grad(set_to_none=True)
            model(tokens(step, 0, 256)).backward()
            verifies = len(handle.planner.history)
            opt.step()
            if len(handle.planner.history) > verifies:  # this step was the one measured
                measured_ran_compiled.append(all(s["compiled"] for s in handle.stats().values()))
        history = handle.planner.history
        assert_runs_a_plan_measured_within(handle, limit)
    finally:
        handle.remove()
    assert history and all(measured_ran_compiled), ([h["measured_peak_bytes"] for h in history], measured_ran_compiled)
    # The plan depends on the profiled op times: run alone, the first plan measured 4191860 bytes
    # (16% under the limit) and was raised; after the other tests of this file, another first
    # plan measured 4987252 (no room). Where the first left room, the second was solved for more
    # and keeps more.
    if history[0]["measured_peak_bytes"] < (1 - 2 * RAISE_HEADROOM) * limit:
        assert len(history) >= 2, history
        assert history[1]["planned_limit_bytes"] > history[0]["planned_limit_bytes"]
        assert history[1]["predicted_peak_bytes"] > history[0]["predicted_peak_bytes"]


class FusingBlock(torch.nn.Module):
    """A cheap, large transient (``repeat``, ``tanh``) reduced at once: eager code makes it in
    the forward and in every replay; inductor fuses it into one kernel and never makes it. The
    eager memory model's smallest step peak is about five times compiled replay-only's."""

    def __init__(self, d: int = 32, repeats: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.repeats = repeats

    def forward(self, x):
        h = self.lin(x)
        big = torch.tanh(h.repeat(1, 1, self.repeats))
        return x + big.view(*h.shape[:-1], self.repeats, -1).mean(-2)


@pytest.mark.parametrize("limit, slack, error", [
    (2_000_000, True, None),  # under the eager floor (6.8 MB), over compiled replay-only (1.3 MB)
    (2_000_000, False, "is infeasible: even recomputing everything"),  # the eager floor, not tried
    (500_000, True, "is infeasible: step 4 kept nothing"),  # under compiled replay-only too
])
def test_a_limit_under_the_eager_floor_is_tried_compiled_replay_only_and_kept_if_measured_within(
        limit, slack, error):
    """With ``compiled_raise_into_slack``, a limit the eager memory model calls infeasible runs
    replay-only compiled, and its measured compiled step decides: within the limit, the run goes
    on; over it, a PlanError naming the measured peak. Without the option, the predicted floor
    refuses the limit before any compiled step."""
    model = Model(blocks=2)
    torch.manual_seed(0)
    model.layers = torch.nn.ModuleList(FusingBlock() for _ in range(2))
    torch._dynamo.reset()
    handle = tapesac.wrap(model.layers, compile=True,
                          plan_config=PlanConfig(memory_limit_bytes=limit, compiled_raise_into_slack=slack))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        with pytest.raises(tapesac.PlanError, match=error) if error else contextlib.nullcontext():
            for step in range(7):
                opt.zero_grad(set_to_none=True)
                model(tokens(step, 0, 256)).backward()
                opt.step()
        history, stats = handle.planner.history, handle.stats()
        entries = list(handle.planner.plans.values())
    finally:
        handle.remove()
    if error is not None and not slack:
        assert not history  # refused at the profiled step's end, before any step under a plan
        return
    assert [e.policy.predicted_peak_bytes for e in entries] == [None]  # replay-only, no plan made
    assert not any(b.keep for b in entries[0].policy.blocks.values())
    assert len(history) == 1 and history[0]["compiled"] and history[0]["meter"] == "allocator events"
    if error is None:
        assert history[0]["measured_peak_bytes"] <= limit and all(s["compiled"] for s in stats.values())
    else:
        assert history[0]["measured_peak_bytes"] > limit


def test_raising_into_slack_bisects_between_plans_measured_within_and_over():
    """The raise is blind (the eager memory model over-counts compiled transients by different
    amounts for different plans), so a raised plan measured over the limit goes back to the one
    measured within and the next raise is solved halfway between the two; the plan steps keep
    running under is always one measured within. Measurements are given, not run: the sequence
    of planned limits is what is checked."""
    model = unbind_model()
    limit = 4_000_000  # compiled mode's predicted frontier: 3.30 to 6.33 MB
    handle = tapesac.wrap(model.layers, compile=True,
                          plan_config=PlanConfig(memory_limit_bytes=limit, compiled_raise_into_slack=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        for step in range(4):  # warm-up and the (eager) profiled step, which plans
            if handle.planner.plans:
                break
            opt.zero_grad(set_to_none=True)
            model(tokens(step, 0, 256)).backward()
            opt.step()
        planner = handle.planner
        (entry,) = planner.plans.values()
        first_plan, first_limit = entry.plan, entry.limit_bytes

        planner._verify(entry, 0.7 * limit)  # 30% of slack: raised for the limit plus the slack less 3%
        raised = entry.limit_bytes
        assert raised == pytest.approx(first_limit + 0.3 * limit - RAISE_HEADROOM * limit)
        assert not entry.verified and entry.plan is not first_plan
        raised_predicted = entry.policy.predicted_peak_bytes

        # Within the limit, but inside the margin a raised plan must leave (measured steps of one
        # compiled plan differ by tens of KiB): as over. Back to the first plan, then halfway.
        planner._verify(entry, (1 - RAISE_MARGIN / 2) * limit)
        over = min(raised, raised_predicted)
        assert entry.over == over
        assert entry.limit_bytes == pytest.approx((first_limit + over) / 2)
        assert not entry.verified and entry.policy.predicted_peak_bytes < raised_predicted

        middle_plan, middle = entry.plan, entry.limit_bytes
        planner._verify(entry, 0.9 * limit)  # within, 10% slack: a raise, if any, stays under `over`
        if not entry.verified:
            assert middle < entry.limit_bytes <= (middle + over) / 2 + 1
            planner._verify(entry, 1.2 * limit)  # over again: back to the middle plan, raises spent
        assert entry.verified and entry.plan is middle_plan and entry.within == (middle_plan, middle)
        assert [h["planned_limit_bytes"] for h in planner.history][:3] == [first_limit, raised, middle]
    finally:
        handle.remove()


def test_alternating_shapes_and_a_shared_block_are_each_planned_and_measured_compiled():
    """Sequence lengths alternating step by step, block 1 applied twice: each shape is profiled
    (a step without a plan asks for a trace that can profile, not the allocator's), each plan
    is measured on a compiled step of its own (not eagerly under the storage counter, and not on
    the step that compiles it), and from then on every block runs compiled; the losses agree
    with compile without activation checkpointing."""
    steps, most_steps, seqs, order = 10, 16, (64, 96), [0, 1, 2, 1]

    def run(tapesac_limit):
        torch._dynamo.reset()
        model = unbind_model(blocks=3)
        model.order = order
        handle = None
        if tapesac_limit is None:
            for block in model.layers:
                block.compile()
        else:
            handle = tapesac.wrap(model.layers, compile=True,
                                  plan_config=PlanConfig(memory_limit_bytes=tapesac_limit))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, compiled = [], []
        try:
            for step in range(most_steps):
                # A plan measured with room to spare is raised and measured again (one more
                # compile): how many steps that takes depends on the measured op times, so a run
                # goes on past ``steps``, up to ``most_steps``, until every plan is measured.
                if handle is not None and step >= steps and all(e.verified for e in handle.planner.plans.values()):
                    break
                opt.zero_grad(set_to_none=True)
                loss = model(tokens(step, 0, seqs[step % 2]))
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                if handle is not None:
                    compiled.append(all(s["compiled"] for s in handle.stats().values()))
            planner = handle.planner if handle is not None else None
            result = (losses, compiled, planner and list(planner.history),
                      planner and [e.verified for e in planner.plans.values()])
        finally:
            if handle is not None:
                handle.remove()
        return result

    expected, _, _, _ = run(None)
    # Between the smallest peak eager planned mode reaches here (1.9 MB) and no AC's (4.2 MB).
    limit = 2_600_000
    losses, compiled, history, verified = run(limit)
    assert verified == [True, True], "\n".join(map(str, history))  # both shapes planned, both measured
    assert len({h["step_key"] for h in history}) == 2
    assert all(h["meter"] == "allocator events" for h in history), history
    assert_runs_within = [h for h in history if h["measured_peak_bytes"] <= limit]
    assert len(assert_runs_within) == len(history), history
    assert compiled[-2:] == [True, True], compiled
    diffs = [abs(a - b).item() for a, b in zip(expected, losses)]
    assert max(diffs) <= LOSS_TOL, diffs


def test_compiled_plans_cost_fused_ops_at_a_fraction_and_carry_no_replay_overheads():
    """Under compile, fused ops recompute inside the kernels around them: compiled mode's block
    graphs cost them at ``FUSED_COST`` of their eager time, matmuls and attention at theirs, and
    carry no replay or recording overhead (compiled blocks neither record nor replay)."""
    from tapesac.planner.compiled_cost import EXTERN_OPS, FUSED_COST, compiled_costs
    from tapesac.profile import block_graph

    torch.manual_seed(0)
    block = UnbindBlock()
    tape = recorded_tape(block, torch.randn(2, 16, 32, requires_grad=True))
    g = block_graph(tape, [1e-3] * len(tape.ops))
    g.op_overhead_s, g.record_overhead_s = 1e-5, 1e-4
    keepable = [v for v in range(len(g.value_op)) if g.is_keepable(v)]
    compiled_costs(g)
    kinds = [name.split(".")[1] for name in g.op_names]
    assert [v for v in range(len(g.value_op)) if g.is_keepable(v)] == keepable
    assert g.op_time_s == [1e-3 if k in EXTERN_OPS else 1e-3 * FUSED_COST for k in kinds]
    assert "addmm" in kinds and any(k not in EXTERN_OPS for k in kinds)
    assert (g.op_overhead_s, g.record_overhead_s) == (0.0, 0.0)
    closure = g.closure(())
    assert g.recompute_time(()) == pytest.approx(sum(g.op_time_s[o] for o in closure))


@torch.library.custom_op("tapesac_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_doubled.register_fake(lambda x: torch.empty_like(x))
_doubled.register_autograd(lambda ctx, grad: grad * 2)


class CustomOpBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(_doubled(self.lin(x)))


def test_compiled_plans_cost_ops_outside_aten_at_their_eager_time():
    """A custom op (or a Triton launch) is a kernel of its own under compile: inductor calls it,
    never fuses it, so its recompute costs what it costs eagerly. (Priced as fused, an expensive
    kernel with a small output would look cheap to recompute: the mistake compile's FLOP-priced
    budget makes with kernels it has no formula for.)"""
    from tapesac.planner.compiled_cost import FUSED_COST, compiled_costs
    from tapesac.profile import block_graph

    torch.manual_seed(0)
    tape = recorded_tape(CustomOpBlock(), torch.randn(2, 16, 32, requires_grad=True))
    g = block_graph(tape, [1e-3] * len(tape.ops))
    compiled_costs(g)
    times = dict(zip(g.op_names, g.op_time_s))
    assert times["tapesac_test.doubled.default"] == 1e-3
    assert times["aten.addmm.default"] == 1e-3 and times["aten.tanh.default"] == 1e-3 * FUSED_COST
