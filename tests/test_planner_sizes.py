"""Identical blocks share keep sets, not sizes: each block's plan is costed with its own bytes."""

from __future__ import annotations

from tapesac.planner import make_plan
from tapesac.planner.graph import BlockGraph
from tapesac.stepmodel import StepMemory, Window


def routed_block(expert_bytes: float) -> BlockGraph:
    """x (external) -> h = up(x) -> y = act(h); backward reads h and y. ``expert_bytes`` is the
    size of h and y: rows = tokens the router sent here, which differs from layer to layer."""
    return BlockGraph(op_time_s=[1.0, 1.0], op_deps=[[0], [1]], value_op=[-1, 0, 1], value_storage=[0, 1, 2],
                      storage_bytes=[64.0, expert_bytes, expert_bytes], read=[1, 2], signature="moe")


def two_layer_step() -> StepMemory:
    """Forwards of blocks 0 and 1, then their backwards; 1000 bytes outside the blocks throughout."""
    return StepMemory([
        Window("forward of block 0", 1000.0, [0]),
        Window("forward of block 1", 1000.0, [0, 1]),
        Window("after forward of block 1", 1000.0, [0, 1]),
        Window("backward of block 1", 1000.0, [0], replay_block=1),
        Window("backward of block 0", 1000.0, [], replay_block=0),
    ])


def test_a_layer_that_routes_more_tokens_is_costed_with_its_own_sizes():
    graphs = {0: routed_block(100.0), 1: routed_block(400.0)}
    plan = make_plan(graphs, two_layer_step(), 1e9, points_per_block=12, solver_time_limit_s=0.0,
                     frontier_points=0, margin=0.0)
    points = plan.allocation.points
    assert points[0].kept == points[1].kept and points[1].kept  # keep everything: the limit is loose
    assert points[0].memory == 200.0 and points[1].memory == 800.0
    # After both forwards, both blocks' kept values are alive: 1000 + 200 + 800.
    assert plan.allocation.predicted_peak_bytes >= 2000.0
    assert plan.policy.blocks[1].kept_bytes == 800


def test_the_first_layer_routing_more_tokens_costs_the_others_no_more_than_their_own():
    graphs = {0: routed_block(400.0), 1: routed_block(100.0)}
    plan = make_plan(graphs, two_layer_step(), 1e9, points_per_block=12, solver_time_limit_s=0.0,
                     frontier_points=0, margin=0.0)
    assert [plan.allocation.points[b].memory for b in (0, 1)] == [800.0, 200.0]
    assert plan.allocation.predicted_peak_bytes == 2000.0
