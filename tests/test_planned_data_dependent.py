"""The step model and sizes that depend on the data (MoE tokens per expert, a boolean mask).

A plan is made from one profiled step's storage sizes. Where a block's sizes depend on the data
(how many tokens a router picks), the planned step's kept values, held keep-only outputs and
replay transients are as large as that step's routing makes them, not the profiled step's. The
planner therefore plans such storages at their upper bounds (``tapesac.bounds``: a boolean mask
picks at most every row), so a step that routes more than the profiled one stays under the limit
(docs/limits.md, "MoE routing"). Without the bounds (``data_dependent_sizes="profiled"``) such a
step exceeds the prediction; these tests show both on one CPU process, in seconds.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from tapesac.autoplan import PlanConfig
from tapesac.bounds import SizeBounds, check_recordings, moved, size_bounds
from tapesac.profile import block_graph

from .loops import train


class Routed(nn.Module):
    """The tokens ``mask`` picks go through an MLP: its activations have one row per picked token,
    a count only the data knows (as an MoE expert's do)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 8 * d), nn.Linear(8 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x)[mask])))
        return x + torch.zeros_like(x).masked_scatter(mask.unsqueeze(-1), h)


class RoutedModel(nn.Module):
    def __init__(self, blocks: int = 3, d: int = 32, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Routed(d) for _ in range(blocks))
        self.head = nn.Linear(d, vocab)
        self.share = 0.5
        """Fraction of the vocabulary routed through the MLPs (the step's routing)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens < int(64 * self.share)
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h, mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), tokens.roll(-1, 1).flatten())


def routed_loop(shares: list[float]):
    """One micro-batch per step, the same tokens every step; step k routes ``shares[k]`` of the
    vocabulary (input shapes never change, so every step runs under the same plan)."""
    def run(model: RoutedModel, step: int, seq: int) -> list[torch.Tensor]:
        tokens = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(7))
        model.share = shares[step]
        loss = model(tokens)
        loss.backward()
        return [loss]
    return run


def planned_run(shares: list[float], limit_bytes: float, sizes: str = "bound"):
    """(planner history, plan, per-step results of ``loops.train``)."""
    model = RoutedModel()
    # No safety margin: the plan's predicted peak is the model's own claim.
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=int(limit_bytes),
                                                               safety_margin=0.0, data_dependent_sizes=sizes))
    try:
        results = train(model, routed_loop(shares), [64] * len(shares), handle)
    finally:
        handle.remove()
    assert handle.planner.history, "no plan was made and measured"
    return handle.planner.history, handle.plan, results


def planned_history(shares: list[float], limit_bytes: float, sizes: str = "bound") -> tuple[list[dict], object]:
    history, plan, _results = planned_run(shares, limit_bytes, sizes)
    return history, plan


def midway(shares: list[float]) -> float:
    """A limit halfway up the step frontier of a plan profiled with ``shares``."""
    _h, plan = planned_history(shares, 1e12)
    lo, hi = plan.smallest_peak_bytes, plan.largest_useful_peak_bytes
    return lo + 0.5 * (hi - lo)


# Step 0 warms up, step 1 is profiled, step 2 is the first under the plan (measured), step 3 planned.
SAME = [0.5, 0.5, 0.5, 0.5]


def test_routing_that_repeats_is_predicted_at_or_above_the_measured_peak():
    _h, plan = planned_history(SAME, 1e12)
    lo, hi = plan.smallest_peak_bytes, plan.largest_useful_peak_bytes
    for limit in (lo + 0.5 * (hi - lo), 1e12):
        history, _plan = planned_history(SAME, limit)
        first = history[0]
        assert first["measured_peak_bytes"] <= first["predicted_peak_bytes"]


@pytest.mark.parametrize("verified", [0.9, 1.0])
@pytest.mark.parametrize("where", ["midway", "everything kept"])
def test_more_tokens_routed_than_in_the_profiled_step_is_still_predicted_at_or_above_the_measured_peak(where, verified):
    """Profiled at 25% of the tokens routed, verified at 90% or at every token."""
    shares = [0.5, 0.25, verified, verified]
    limit = midway(shares) if where == "midway" else 1e12
    history, _plan = planned_history(shares, limit)
    first = history[0]
    assert first["measured_peak_bytes"] <= first["predicted_peak_bytes"] <= limit


def test_planned_at_the_profiled_sizes_a_step_that_routes_more_exceeds_the_prediction():
    """What the bounds are for: the same run planned at the profiled step's sizes."""
    history, _plan = planned_history([0.5, 0.25, 0.9, 0.9], 1e12, sizes="profiled")
    first = history[0]
    assert first["measured_peak_bytes"] > first["predicted_peak_bytes"]


@pytest.mark.parametrize("seed", range(3))
def test_routing_that_moves_every_step_never_takes_a_planned_step_over_its_limit(seed):
    """Seeded random routing, a new share every step, at a limit that forces recompute: every
    step after the plan stays under the limit, and losses and gradients are plain autograd's."""
    rng = random.Random(seed)
    shares = [0.5, rng.uniform(0.1, 0.6)] + [rng.uniform(0.0, 1.0) for _ in range(5)]
    limit = midway(shares)
    history, plan, results = planned_run(shares, limit)
    assert any(b.keep for b in plan.policy.blocks.values()) and plan.allocation.recompute_s > 0, seed
    for step in history:  # TapeSAC's own meter, on the first step under each plan
        assert step["measured_peak_bytes"] <= step["predicted_peak_bytes"] <= limit, (seed, shares, step)
    for k, (_losses, _grads, peak, _a) in enumerate(results[2:], start=2):  # the test's meter, every step
        assert peak <= limit, (seed, shares, k, peak)
    plain = train(RoutedModel(), routed_loop(shares), [64] * len(shares))
    for k, ((losses, grads, _p, _a), (want_losses, want_grads, _q, _b)) in enumerate(zip(results, plain)):
        assert [l.item() for l in losses] == [l.item() for l in want_losses], (seed, k)
        assert grads.keys() == want_grads.keys()
        assert all(torch.equal(grads[n], want_grads[n]) for n in grads), (seed, k)


class HostSized(nn.Module):
    """Runs on the first ``mask.sum()`` rows, a count read on the host: a size no recorded op
    explains, as torchtitan 0.2.x's MoE cuts its tokens after ``tolist``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = int(mask.sum())
        return self.up(x.flatten(0, 1)[:n]).relu().sum() + x.sum()


def recorded(block: nn.Module, *args):
    handle = tapesac.wrap([block])
    try:
        out = block(*args)
        out.sum().backward()
        return handle.tapes()[0]
    finally:
        handle.remove()


def test_a_boolean_mask_bounds_the_rows_it_picks_and_everything_computed_on_them():
    torch.manual_seed(0)
    block = Routed(32)
    x = torch.randn(4, 64, 32, requires_grad=True)
    mask = torch.rand(4, 64) < 0.3
    tape = recorded(block, x, mask)
    bounds = size_bounds(tape)
    assert bounds.unbounded is None
    rows, cap = int(mask.sum()), mask.numel()
    by_name = {}
    for v in tape.values:
        if v.sid in bounds.bytes and v.op >= 0:
            by_name.setdefault(tape.op_name(v.op), set()).add((v.shape, bounds.bytes[v.sid]))
    # The picked rows, the MLP on them: at most every row; the scatter back is x-shaped, fixed.
    assert by_name.pop("aten.index.Tensor") == {((rows, 32), cap * 32 * 4)}
    assert ((rows, 256), cap * 256 * 4) in by_name.pop("aten.addmm.default")
    assert by_name.pop("aten.gelu.default") == {((rows, 256), cap * 256 * 4)}
    assert not by_name, by_name
    assert all(tape.values[v].sid not in bounds.bytes for v in range(len(tape.values))
               if tape.values[v].shape == (4, 64, 32) and tape.values[v].op >= 0)


def test_a_size_computed_on_the_host_that_moves_between_recordings_is_reported_unbounded():
    torch.manual_seed(0)
    block = HostSized()
    x = torch.randn(2, 8, 16, requires_grad=True)
    tapes = [recorded(block, x, torch.arange(16).view(2, 8) < n) for n in (5, 11)]
    alone = size_bounds(tapes[0])
    assert alone.unbounded is None and not alone.bytes  # one recording cannot tell
    checked = check_recordings(tapes, alone)
    assert checked.unbounded and "changes size between recordings" in checked.unbounded
    same = [recorded(block, x, torch.arange(16).view(2, 8) < 7) for _ in range(2)]
    assert check_recordings(same, size_bounds(same[0])).unbounded is None


class RoutedAndCut(nn.Module):
    """:class:`Routed`'s MLP on the rows ``mask`` picks (bounded), a ``Linear`` on the first
    ``mask.sum()`` rows read on the host (no bound follows), and ``docs``, an input of the block
    whose length the data sets (as Qwen3.5's document boundaries, one per packed document)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.routed = Routed(d)
        self.cut = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        n = int(mask.sum())
        return self.routed(x, mask).sum() + self.cut(x.flatten(0, 1)[:n]).relu().sum() + docs.sum()


def test_a_size_no_bound_follows_is_planned_at_its_largest_recording_and_the_other_bounds_stand():
    torch.manual_seed(0)
    block = RoutedAndCut(32)
    x = torch.randn(2, 32, 32, requires_grad=True)
    rows = (5, 12)  # under 16: the rerun does not take the host's count for the mask's size
    tapes = [recorded(block, x, torch.arange(64).view(2, 32) < n, torch.zeros(d)) for n, d in zip(rows, (3, 5))]
    alone = [size_bounds(t) for t in tapes]
    assert all(b.unbounded is None and b.bytes for b in alone)
    merged = alone[0].merge(alone[1])
    checked = check_recordings(tapes, merged)
    assert checked.unbounded and "changes size between recordings" in checked.unbounded
    assert "largest size recorded" in checked.unbounded
    # The mask's bounds stand; the host-cut Linear's output is planned at its larger recording.
    assert {s: checked.bytes[s] for s in merged.bytes} == merged.bytes
    tape = tapes[0]
    cut = {v.sid for v in tape.values if v.op >= 0 and tape.op_name(v.op) == "aten.addmm.default"
           and v.shape == (rows[0], 64)}
    assert cut and all(checked.bytes[s] == rows[1] * 64 * 4 for s in cut)
    # The block's input is the caller's, never counted as kept: its length moving is not blamed.
    docs = {v.sid for v in tape.values if v.op < 0 and v.shape == (3,)}
    assert docs and not docs & set(checked.bytes)
    g = block_graph(tape, bounds=checked)
    assert g.data_dependent == checked.unbounded
    assert all(g.storage_bound_bytes[s] == rows[1] * 64 * 4 for s in cut)
    # Only the input's length moving: nothing to bound, nothing to warn of.
    plain = [recorded(block, x, torch.arange(64).view(2, 32) < 10, torch.zeros(d)) for d in (3, 5)]
    bounds = size_bounds(plain[0]).merge(size_bounds(plain[1]))
    assert check_recordings(plain, bounds) == bounds


class SideInput(nn.Module):
    """Reads ``y`` before anything else, then :class:`HostSized`'s cut: where ``y`` is ``x`` the
    tape numbers one storage fewer before the cut's, as tensor parallelism's first block does."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = (y * 2).sum()
        n = int(mask.sum())
        return self.up(x.flatten(0, 1)[:n]).relu().sum() + s


def test_recordings_are_compared_value_by_value_where_their_storages_are_numbered_otherwise():
    torch.manual_seed(0)
    block = SideInput()
    x = torch.randn(2, 8, 16, requires_grad=True)

    def record(y, n):
        return recorded(block, x, y, torch.arange(16).view(2, 8) < n)

    same = [record(x, 5), record(x.detach().clone().requires_grad_(), 5)]
    cut = [[v for v in t.values if v.op >= 0 and t.op_name(v.op) == "aten.addmm.default"][0] for t in same]
    assert cut[0].sid != cut[1].sid  # the same value, in storages numbered otherwise
    assert check_recordings(same, size_bounds(same[0])) == SizeBounds()  # nothing moved: no warning
    moving = [record(x, 5), record(x.detach().clone().requires_grad_(), 12)]
    checked = check_recordings(moving, size_bounds(moving[0]))
    assert "aten.addmm.default" in checked.unbounded and "(640 to 1536 bytes)" in checked.unbounded
    assert checked.bytes[cut[0].sid] == 12 * 32 * 4
    # Bounds move between tapes by the same values.
    assert moved(SizeBounds({cut[0].sid: 7}), same[0], same[1]).bytes == {cut[1].sid: 7}


def test_an_unknown_data_dependent_sizes_setting_is_refused_with_the_choices():
    with pytest.raises(tapesac.ConfigError, match="data_dependent_sizes must be one of bound, profiled"):
        PlanConfig(memory_limit_bytes=10**9, data_dependent_sizes="largest")
