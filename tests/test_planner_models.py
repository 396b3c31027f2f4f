"""Planned mode on recorded torchtitan blocks: exact gradients, peak under the limit, accurate model."""

from __future__ import annotations

import json

import pytest
import torch

import tapesac
from tapesac.autoplan import PlanConfig
from tapesac.planner.simulate import simulate_replay

from .blocks import CASES, DEEP, assert_identical, grads

STEPS = 5  # 1 warm-up, 1 profiled, then planned steps (the first one verified)


def _train(kind: str, limit: float | None, **config):
    """Gradients of STEPS steps without any checkpointing, and the same under planned TapeSAC."""
    ref = DEEP[kind]()
    expected = [grads(ref, seed=s)[0] for s in range(STEPS)]
    case = DEEP[kind]()
    handle = None
    if limit is not None:
        handle = tapesac.wrap(case.blocks, plan_config=PlanConfig(memory_limit_bytes=int(limit), **config))
    actual = []
    try:
        for s in range(STEPS):
            actual.append(grads(case, seed=s)[0])
            if handle is not None:
                handle.step()
    finally:
        if handle is not None:
            handle.remove()  # a trace started at the last step boundary ends here
    return expected, actual, handle


def _span(kind: str) -> tuple[float, float]:
    """(smallest, largest useful) predicted step peak for this model, from a first plan."""
    _e, _a, handle = _train(kind, 1e12)
    return handle.plan.smallest_peak_bytes, handle.plan.largest_useful_peak_bytes


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("where", [0.25, 0.6, 1.0])
def test_plan_under_a_limit_is_exact_fits_and_is_predicted(kind, where):
    lo, hi = _span(kind)
    assert hi > lo
    limit = lo + where * (hi - lo)
    expected, actual, handle = _train(kind, limit)
    for e, a in zip(expected, actual):
        assert_identical(e, a)
    plan = handle.plan
    assert plan.policy.limit_bytes == int(limit)
    assert plan.allocation.predicted_peak_bytes <= limit
    assert any(b.keep for b in plan.policy.blocks.values())  # the plan keeps something
    record = handle.planner.history[0]
    measured, predicted = record["measured_peak_bytes"], record["predicted_peak_bytes"]
    assert measured <= limit
    assert abs(predicted - measured) <= 0.05 * measured
    # Keeping values makes replay cheaper than replay-only.
    stats = handle.stats()
    assert sum(s["kept_bytes"] for s in stats.values()) > 0


def test_infeasible_limit_names_the_smallest_peak():
    lo, _hi = _span("llama3")
    with pytest.raises(tapesac.PlanError, match=r"infeasible.*predicted step peak is .* \((\d+) bytes\)") as e:
        _train("llama3", lo * 0.9)  # the same loop as _span's, so the same smallest peak
    assert f"({lo:.0f} bytes)" in str(e.value)


def test_plan_is_saved_and_loaded_without_profiling(tmp_path):
    lo, hi = _span("qwen3")
    path = tmp_path / "policy.json"
    frontier = tmp_path / "frontier.json"
    limit = (lo + hi) / 2
    _e, _a, handle = _train("qwen3", limit, policy_path=str(path), frontier_path=str(frontier))
    saved = json.loads(path.read_text())
    assert saved["version"] == 1 and saved["limit_bytes"] == int(limit)
    data = json.loads(frontier.read_text())
    assert len(data["frontier"]) >= 2 and frontier.with_suffix(".png").exists()
    mems = [p["memory"] for p in data["frontier"]]
    assert mems == sorted(mems)
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "frontier.py"
    png = tmp_path / "again.png"
    out = subprocess.run([sys.executable, str(tool), "--saved", str(frontier), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and png.exists() and "recompute time" in out.stdout
    # A new run loads the policy, records with it from the first step, and never profiles.
    expected, actual, handle2 = _train("qwen3", limit, policy_path=str(path))
    for e, a in zip(expected, actual):
        assert_identical(e, a)
    assert handle2.plan is None and handle2.planner.phase == "planned"
    assert all(s.expected_signature for s in handle2.blocks)
    assert handle2.planner.history[0]["measured_peak_bytes"] <= limit


def test_policy_from_another_shape_is_dropped_and_replanned(tmp_path):
    lo, hi = _span("llama3")
    path = tmp_path / "policy.json"
    _train("llama3", (lo + hi) / 2, policy_path=str(path))
    data = json.loads(path.read_text())
    for b in data["blocks"].values():
        b["signature"] = "0" * 16  # as if recorded on other shapes
    path.write_text(json.dumps(data))
    expected, actual, handle = _train("llama3", (lo + hi) / 2, policy_path=str(path))
    for e, a in zip(expected, actual):
        assert_identical(e, a)
    assert handle.plan is not None  # profiled and planned afresh


def test_simulated_replay_only_memory_matches_the_engine():
    """The planner's simulation of replay's cache equals what the engine really holds."""
    from tapesac.meter import StorageCounter
    from tapesac.profile import block_graph

    case = CASES["qwen3"]()
    handle = tapesac.wrap(case.blocks)
    order: list[int] = []
    counter = StorageCounter()
    seen: list[float] = []

    loss = case.run(case.model)
    replayer = handle.blocks[1].last_replayer()

    def hook(vid):
        order.append(vid)
        seen.append(sum({id(t.untyped_storage()): t.untyped_storage().nbytes()
                         for v, t in replayer.cache.items() if v not in replayer.pinned}.values()))

    replayer.on_unpack = hook
    with counter:
        loss.backward()
    g = block_graph(handle.tapes()[1], unpack_order=order)
    _peak, after = simulate_replay(g, (), order)
    # cache bytes seen at the start of unpack k+1 are those held after unpack k
    assert seen[1:] == [float(a) for a in after[:-1]]


def test_frontier_tool_reads_a_measured_block_graph(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    lo, hi = _span("llama3")
    _train("llama3", (lo + hi) / 2, graph_dir=str(tmp_path))
    graphs = sorted(tmp_path.glob("block*.json"))
    assert len(graphs) == 1  # identical blocks: one kind
    tool = Path(__file__).resolve().parents[1] / "tools" / "frontier.py"
    out = subprocess.run([sys.executable, str(tool), "--graph", str(graphs[0]), "--json", "--max-points", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert 2 <= len(result["frontier"]) <= 8
    assert result["frontier"][0]["memory"] == 0
    assert result["replay_only_time"] == result["frontier"][0]["recompute_time"] > 0
    assert result["block_replay_time"] > 0  # the whole block's op time (what full AC reruns)


def test_blocks_that_keep_everything_run_as_plain_autograd():
    expected, actual, handle = _train("llama3", 1e12)  # room for everything: nothing to recompute
    for e, a in zip(expected, actual):
        assert_identical(e, a)
    assert all(b.passthrough for b in handle.plan.policy.blocks.values())
    stats = handle.stats()
    assert all(s["passthrough"] and s["ops_recorded"] == 0 for s in stats.values())
