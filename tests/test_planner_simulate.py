"""The replay simulation counts what replay really holds, op by op."""

from __future__ import annotations

from tapesac.planner.graph import BlockGraph
from tapesac.planner.simulate import simulate_replay


def test_an_op_holds_its_last_used_input_and_its_output_together():
    """x (external) -> a = f(x) -> b = g(a) -> c = h(b); backward reads c only. Rebuilding c runs
    f, g and h; while g runs, a (its input, dead after g) and b are both alive: 100 + 300."""
    g = BlockGraph(op_time_s=[1.0, 1.0, 1.0], op_deps=[[0], [1], [2]], value_op=[-1, 0, 1, 2],
                   value_storage=[0, 1, 2, 3], storage_bytes=[8.0, 100.0, 300.0, 50.0], read=[3])
    peaks, afters = simulate_replay(g, [], [3])
    assert peaks[0] == 400.0  # g: a and b; h: b and c (350)
    assert afters[0] == 0.0


def test_keeping_the_input_of_a_chain_does_not_hide_its_intermediates():
    """With a kept, rebuilding c runs g and h: b (300) and c (50) together while h runs, plus a
    (kept, 100) until g has read it for the last time."""
    g = BlockGraph(op_time_s=[1.0, 1.0, 1.0], op_deps=[[0], [1], [2]], value_op=[-1, 0, 1, 2],
                   value_storage=[0, 1, 2, 3], storage_bytes=[8.0, 100.0, 300.0, 50.0], read=[3])
    peaks, _afters = simulate_replay(g, [1], [3])
    assert peaks[0] == 400.0
