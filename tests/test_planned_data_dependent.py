"""The step model and sizes that depend on the data (MoE tokens per expert, a boolean mask).

A plan is made from one profiled step's storage sizes. Where a block's sizes depend on the data
(how many tokens a router picks), the planned step's kept values, held keep-only outputs and
replay transients are as large as that step's routing makes them, not the profiled step's. The
2-rank expert-parallel qwen3 job under-predicts its step peak this way (docs/limits.md, "MoE routing"); these
tests show the same thing on one CPU process, in seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from tapesac.autoplan import PlanConfig

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


def planned_history(shares: list[float], limit_bytes: float) -> tuple[list[dict], object]:
    model = RoutedModel()
    # No safety margin: the plan's predicted peak is the model's own claim.
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=int(limit_bytes),
                                                               safety_margin=0.0))
    try:
        train(model, routed_loop(shares), [64] * len(shares), handle)
    finally:
        handle.remove()
    assert handle.planner.history, "no plan was made and measured"
    return handle.planner.history, handle.plan


# Step 0 warms up, step 1 is profiled, step 2 is the first under the plan (measured), step 3 planned.
SAME = [0.5, 0.5, 0.5, 0.5]


def test_routing_that_repeats_is_predicted_at_or_above_the_measured_peak():
    _h, plan = planned_history(SAME, 1e12)
    lo, hi = plan.smallest_peak_bytes, plan.largest_useful_peak_bytes
    for limit in (lo + 0.5 * (hi - lo), 1e12):
        history, _plan = planned_history(SAME, limit)
        first = history[0]
        assert first["measured_peak_bytes"] <= first["predicted_peak_bytes"]


@pytest.mark.xfail(strict=True, reason="the plan uses the profiled step's data-dependent sizes; a step "
                                       "that routes more tokens holds more than predicted (docs/limits.md)")
def test_more_tokens_routed_than_in_the_profiled_step_is_still_predicted_at_or_above_the_measured_peak():
    history, _plan = planned_history([0.5, 0.25, 0.9, 0.9], 1e12)
    first = history[0]
    assert first["measured_peak_bytes"] <= first["predicted_peak_bytes"]
