"""The MILP frontier is exactly the brute-force Pareto frontier; the frontier tool's contract."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tapesac.errors import PlanError
from tapesac.planner.bruteforce import brute_force_frontier
from tapesac.planner.graph import BlockGraph
from tapesac.planner.milp import evaluate, frontier

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "data" / "worked_example.json"


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "frontier.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_worked_example_gives_exactly_its_frontier():
    out = _tool("--graph", str(EXAMPLE), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "block_replay_time": 32,
        "replay_only_time": 23,
        "frontier": [
            {"kept": [], "recompute_time": 23, "memory": 0},
            {"kept": ["x5"], "recompute_time": 16, "memory": 5},
            {"kept": ["x2"], "recompute_time": 10, "memory": 6},
            {"kept": ["x4"], "recompute_time": 7, "memory": 8},
            {"kept": ["x2", "x5"], "recompute_time": 3, "memory": 11},
            {"kept": ["x4", "x5"], "recompute_time": 0, "memory": 13},
        ],
    }


def test_frontier_tool_prints_a_table_and_plots(tmp_path):
    png = tmp_path / "f.png"
    out = _tool("--graph", str(EXAMPLE), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "replay-only time:       23" in out.stdout and "x2, x5" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worked_example_prints_a_readable_table():
    """README's first command: whole numbers, each row's kept set, and what the ends are."""
    out = _tool("--graph", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == [
        "full block replay time: 32  (every op: what full AC reruns)",
        "replay-only time:       23  (only what backward reads)",
        "        memory  recompute time  kept",
        "             0              23  nothing (replay-only: keeps nothing)",
        "             5              16  x5",
        "             6              10  x2",
        "             8               7  x4",
        "            11               3  x2, x5",
        "            13               0  x4, x5 (keeps everything useful: no replay)",
    ]
    assert out.stdout.startswith(f"block frontier of {EXAMPLE} (units as in the file)")


@pytest.mark.parametrize("bad, message", [
    ({"ops": {"a": {"time": 1, "bytes": 1, "deps": ["b"]}}, "read": ["a"]}, "unknown dependency"),
    ({"ops": {"a": {"time": 1, "bytes": 1, "deps": ["b"]}, "b": {"time": 1, "bytes": 1, "deps": ["a"]}},
      "read": ["a"]}, "cycle"),
    ({"ops": {"a": {"time": -1, "bytes": 1, "deps": []}}, "read": ["a"]}, "non-negative"),
    ({"ops": {"a": {"time": 1, "bytes": 1}}, "read": ["zz"]}, "unknown op"),
    ({"ops": {}}, "non-empty"),
])
def test_bad_graphs_are_clear_errors(tmp_path, bad, message):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(bad))
    out = _tool("--graph", str(path), "--json")
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


def random_abstract(rng: random.Random, n: int, integral: bool) -> dict:
    def num(hi):
        return rng.randint(0, hi) if integral else round(rng.uniform(0, hi), 3)

    ops = {}
    for i in range(n):
        deps = [f"v{j}" for j in range(i) if rng.random() < 0.35]
        ops[f"v{i}"] = {"time": num(9), "bytes": num(12), "deps": deps}
    read = [f"v{i}" for i in range(n) if rng.random() < 0.5] or [f"v{n - 1}"]
    return {"ops": ops, "read": read}


def assert_same_points(actual, expected: list[tuple[float, float]]) -> None:
    """Same number of frontier points, each (memory, time) equal up to float rounding.

    pytest.approx compares flat sequences only (pytest 9 refuses nested ones), so the points are
    flattened: [m0, t0, m1, t1, ...].
    """
    got = [(p.memory, p.time) for p in actual]
    assert len(got) == len(expected), (got, expected)
    assert [x for pt in got for x in pt] == pytest.approx([x for pt in expected for x in pt])


@pytest.mark.parametrize("seed", range(40))
def test_random_dags_agree_with_brute_force(seed):
    rng = random.Random(seed)
    g = BlockGraph.from_abstract(random_abstract(rng, rng.randint(2, 11), integral=seed % 2 == 0))
    expected = [(p.memory, p.time) for p in brute_force_frontier(g)]
    actual = frontier(g)
    assert_same_points(actual, expected)
    for p in actual:  # reported costs are the executor's, for the reported keep set
        e = evaluate(g, p.kept)
        assert (e.memory, e.time) == (p.memory, p.time)


def random_block(rng: random.Random) -> BlockGraph:
    """Engine-shaped graphs: multi-output ops, aliasing storages, always-available values,
    values that may not be kept (clobbered later by an in-place write)."""
    n_ops = rng.randint(2, 7)
    value_op, value_storage, deps = [], [], []
    n_ext = rng.randint(1, 2)
    for _ in range(n_ext):
        value_op.append(-1)
        value_storage.append(len(value_storage))
    for o in range(n_ops):
        deps.append(sorted({rng.randrange(len(value_op)) for _ in range(rng.randint(1, 2))}))
        for _ in range(rng.randint(1, 2)):
            alias = value_op and rng.random() < 0.25
            value_storage.append(rng.choice(value_storage) if alias else max(value_storage) + 1)
            value_op.append(o)
    n_storages = max(value_storage) + 1
    read = sorted({v for v in range(len(value_op)) if rng.random() < 0.5} | {len(value_op) - 1})
    return BlockGraph(
        op_time_s=[rng.choice([0.0, rng.uniform(0.1, 5)]) for _ in range(n_ops)],
        op_deps=deps, value_op=value_op, value_storage=value_storage,
        storage_bytes=[float(rng.randint(1, 64)) for _ in range(n_storages)], read=read,
        keepable=[rng.random() < 0.85 for _ in value_op],
    )


@pytest.mark.parametrize("seed", range(40))
def test_engine_shaped_graphs_agree_with_brute_force(seed):
    g = random_block(random.Random(1000 + seed))
    expected = [(p.memory, p.time) for p in brute_force_frontier(g)]
    assert_same_points(frontier(g), expected)


def test_capped_frontier_points_are_pareto_optimal():
    g = BlockGraph.from_abstract(random_abstract(random.Random(7), 11, integral=True))
    exact = {(p.memory, p.time) for p in brute_force_frontier(g)}
    capped = frontier(g, max_points=4)
    assert 2 <= len(capped) <= 4
    assert {(p.memory, p.time) for p in capped} <= exact


def test_graph_json_round_trip():
    g = random_block(random.Random(3))
    assert BlockGraph.from_json(json.loads(json.dumps(g.to_json()))) == g


def test_abstract_graph_needs_ops():
    with pytest.raises(PlanError):
        BlockGraph.from_abstract({"read": []})
