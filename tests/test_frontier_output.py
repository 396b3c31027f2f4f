"""What people see of a frontier: kept-set summaries, units, the limit and the chosen plan,
in ``frontier.json``, in ``tools/frontier.py --saved`` and in the PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tapesac.planner import Plan
from tapesac.planner.allocate import Allocation
from tapesac.planner.graph import BlockGraph
from tapesac.planner.milp import frontier
from tapesac.policy import BlockPolicy, Policy
from tapesac.report import bytes_unit, frontier_axes, short_op_name, summarise_keep

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

# A llama-like block's value names as the profiler writes them ("%op.slot overload").
NAMES = ["%ext0", "%0.0 aten.mm.default", "%1.0 aten.mm.default", "%2.0 aten.mm.default",
         "%3.0 aten._scaled_dot_product_flash_attention_for_cpu.default",
         "%3.1 aten._scaled_dot_product_flash_attention_for_cpu.default",
         "%4.0 aten.silu.default", "%5.0 aten.mul.Tensor", "%6.0 aten._fused_rms_norm.default"]


def test_summary_groups_kept_values_by_op_in_tape_order():
    assert summarise_keep(NAMES, kept=[4, 1, 2, 3], read=[1, 2, 3, 4, 5, 6, 7, 8]) == \
        "keeps: mm x3, sdpa; recomputes: sdpa[1], silu, mul, fused_rms_norm"


@pytest.mark.parametrize("kept, read, summary", [
    ([], [6, 7], "keeps: nothing; recomputes: silu, mul"),
    ([6, 7], [6, 7], "keeps: silu, mul; recomputes: nothing"),
    ([1], [6], "keeps: mm; recomputes: silu"),  # kept upstream of what backward reads
])
def test_summary_says_nothing_when_a_side_is_empty(kept, read, summary):
    assert summarise_keep(NAMES, kept, read) == summary


def test_summary_of_abstract_and_unnamed_graphs():
    assert summarise_keep(["x1", "x2", "x3"], [0], [0, 2]) == "keeps: x1; recomputes: x3"
    assert summarise_keep(None, [0], [0, 2]) == "keeps: value 0; recomputes: value 2"


@pytest.mark.parametrize("name, short", [
    ("%3.1 aten._scaled_dot_product_flash_attention_for_cpu.default", ("sdpa", 1)),
    ("%0.0 aten.mm.default", ("mm", 0)),
    ("%12.0 aten._unsafe_view.default", ("unsafe_view", 0)),
    ("x4", ("x4", 0)),
])
def test_short_op_names(name, short):
    assert short_op_name(name) == short


@pytest.mark.parametrize("largest, unit", [(512, "B"), (3 * 2**10, "KiB"), (300 * MiB, "MiB"),
                                           (1.5 * 2**30, "GiB"), (80 * 2**30, "GiB")])
def test_byte_unit_follows_the_range(largest, unit):
    assert bytes_unit(largest)[0] == unit


def _graph(signature: str) -> BlockGraph:
    """The worked example at MiB and ms scale, with profiler-style names."""
    data = json.loads((ROOT / "tests" / "data" / "worked_example.json").read_text())
    for op in data["ops"].values():
        op["bytes"] *= MiB
        op["time"] *= 1e-3
    g = BlockGraph.from_abstract(data)
    g.names = ["%0.0 aten.mm.default", "%1.0 aten.silu.default", "%2.0 aten.mm.default",
               "%3.0 aten.mul.Tensor", "%4.0 aten.mm.default"]
    g.signature = signature
    return g


def _plan() -> tuple[Plan, dict[int, BlockGraph]]:
    """Four blocks of one kind: blocks 0-2 keep x2 (6 MiB), block 3 keeps x4 and x5 (13 MiB)."""
    graphs = {b: _graph("abc123def456") for b in range(4)}
    pts = frontier(graphs[0])
    by_kept = {tuple(graphs[0].value_name(v) for v in p.kept): p for p in pts}
    chosen = {0: by_kept[("%1.0 aten.silu.default",)], 1: by_kept[("%1.0 aten.silu.default",)],
              2: by_kept[("%1.0 aten.silu.default",)],
              3: by_kept[("%3.0 aten.mul.Tensor", "%4.0 aten.mm.default")]}
    alloc = Allocation(chosen, predicted_peak_bytes=90 * MiB, recompute_s=0.030, status="optimal")
    policy = Policy({b: BlockPolicy("abc123def456", []) for b in range(4)}, limit_bytes=95 * MiB)
    # The greedy sweep; its fourth point is the chosen plan.
    sweep = [{"predicted_peak_bytes": m * MiB, "recompute_s": t}
             for m, t in [(60, 0.092), (70, 0.069), (80, 0.046), (90, 0.030), (100, 0.0)]]
    plan = Plan(policy, alloc, sweep, {"abc123def456": pts}, 60 * MiB, 100 * MiB, 0.1)
    return plan, graphs


def test_frontier_json_says_what_the_chosen_plan_keeps_per_kind():
    plan, graphs = _plan()
    data = plan.frontier_json(graphs=graphs)
    assert (data["memory_unit"], data["time_unit"], data["limit_bytes"]) == ("bytes", "s", 95 * MiB)
    assert (data["chosen"]["memory"], data["chosen"]["status"]) == (90 * MiB, "optimal")
    keeps = data["chosen"]["keeps"]
    assert [k["blocks"] for k in keeps] == [[0, 1, 2], [3]]
    assert keeps[0]["kind"] == "abc123def456" and keeps[0]["kept"] == ["%1.0 aten.silu.default"]
    assert keeps[0]["kept_bytes"] == 6 * MiB and keeps[0]["recompute_time"] == pytest.approx(0.010)
    assert keeps[0]["summary"] == "keeps: silu; recomputes: mul, mm"
    assert keeps[1]["summary"] == "keeps: mul, mm; recomputes: nothing"
    json.dumps(data)  # plain JSON


def test_frontier_json_without_graphs_has_value_indices():
    plan, _graphs = _plan()
    keeps = plan.frontier_json()["chosen"]["keeps"]
    assert keeps[0]["kept"] == [1] and "summary" not in keeps[0]


def _saved(tmp_path, data: dict) -> str:
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps(data))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "frontier.py"), "--saved", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_saved_frontier_prints_units_limit_and_the_chosen_row(tmp_path):
    plan, graphs = _plan()
    lines = _saved(tmp_path, plan.frontier_json(graphs=graphs)).splitlines()
    assert "limit: 95 MiB" in lines
    assert "predicted step peak (MiB)" in lines[3] and "predicted recompute time per step (ms)" in lines[3]
    rows = lines[4:lines.index("chosen plan (*), per block kind:")]
    marked = [line for line in rows if line.startswith("*")]
    assert len(marked) == 1 and marked[0].split()[1:3] == ["90", "30"]  # MiB, ms
    assert lines[2] == "chosen plan (*): predicted step peak 90 MiB, predicted recompute time per step 30 ms"
    assert rows[0].split()[:2] == ["60", "92"] and rows[0].endswith("replay-only (full-AC memory)")
    assert rows[-1].endswith("keep everything useful (no-AC-like memory)")
    # The limit is a rule between the last row under it and the first over it.
    rule = next(i for i, line in enumerate(rows) if "limit 95 MiB" in line)
    assert rows[rule - 1].split()[1] == "90" and rows[rule + 1].split()[0] == "100"
    assert "  kind abc123de, blocks 0-2 (3 blocks): 6 MiB kept and 10 ms recompute per block; " \
           "keeps: silu; recomputes: mul, mm" in lines
    assert "  kind abc123de, block 3 (1 block): 13 MiB kept and 0 ms recompute per block; " \
           "keeps: mul, mm; recomputes: nothing" in lines


def test_saved_frontier_inserts_a_chosen_plan_that_is_off_the_sweep(tmp_path):
    plan, graphs = _plan()
    plan.frontier[3] = {"predicted_peak_bytes": 90 * MiB, "recompute_s": 0.040}  # greedy did worse
    out = _saved(tmp_path, plan.frontier_json(graphs=graphs))
    marked = [line for line in out.splitlines() if line.startswith("* ")]
    assert len(marked) == 1 and marked[0].split()[1:3] == ["90", "30"]
    assert marked[0].endswith(
        "chosen plan (solved for this limit alone, status optimal; other rows: one greedy sweep over limits)")


def _old_format(plan: Plan) -> dict:
    """frontier.json as written before units, ends and kept sets had fields of their own."""
    return {"title": "TapeSAC step frontier", "memory_label": "predicted step peak (bytes)",
            "time_label": "predicted recompute time per step (s)", "limit_bytes": plan.policy.limit_bytes,
            "chosen": {"memory": plan.allocation.predicted_peak_bytes,
                       "recompute_time": plan.allocation.recompute_s},
            "frontier": [{"kept": [], "memory": p["predicted_peak_bytes"], "recompute_time": p["recompute_s"]}
                         for p in plan.frontier]}


def test_old_saved_frontier_still_prints_with_units(tmp_path):
    out = _saved(tmp_path, _old_format(_plan()[0]))
    assert "limit: 95 MiB" in out and "(MiB)" in out and "(ms)" in out
    assert " -\n" not in out and "kept" not in out  # no column of "-" for kept sets it never had
    assert sum(line.startswith("* ") for line in out.splitlines()) == 1


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


@pytest.mark.parametrize("old", [False, True], ids=["current", "old-format"])
def test_plot_marks_the_limit_the_chosen_plan_and_the_ends(old):
    pytest.importorskip("matplotlib")
    from tapesac.plot import frontier_figure

    plan, graphs = _plan()
    fig = frontier_figure(_old_format(plan) if old else plan.frontier_json(graphs=graphs))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "predicted step peak (MiB)"
    assert ax.get_ylabel() == "predicted recompute time per step (ms)"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["memory limit"].get_xdata()) == [95, 95]  # a vertical line at the limit, in MiB
    assert list(lines["chosen plan"].get_xdata()) == [90]
    assert list(lines["chosen plan"].get_ydata()) == pytest.approx([30])
    texts = _texts(fig)
    assert "limit 95 MiB" in texts
    assert "chosen plan: peak 90 MiB,\nrecompute 30 ms" in texts
    assert "replay-only (full-AC memory)" in texts and "keep everything useful (no-AC-like memory)" in texts
    fig.canvas.draw()  # renders: no offset text like "1e8" on either axis
    assert ax.xaxis.get_offset_text().get_text() == "" and ax.yaxis.get_offset_text().get_text() == ""


def test_plot_unit_follows_the_range():
    pytest.importorskip("matplotlib")
    from tapesac.plot import frontier_figure

    fig = frontier_figure({"memory_label": "peak", "memory_unit": "bytes", "time_label": "t", "time_unit": "s",
                           "frontier": [{"memory": 20 * 2**30, "recompute_time": 0.5},
                                        {"memory": 30 * 2**30, "recompute_time": 0.0}]})
    assert fig.axes[0].get_xlabel() == "peak (GiB)" and list(fig.axes[0].get_lines()[1].get_xdata()) == [20, 30]


def test_frontier_axes_reads_units_from_old_labels():
    axes = frontier_axes({"memory_label": "predicted step peak (bytes)", "time_label": "recompute (s)",
                          "frontier": [{"memory": 300 * MiB, "recompute_time": 0.1}]})
    assert (axes.memory_title(), axes.time_title()) == ("predicted step peak (MiB)", "recompute (ms)")
    assert (axes.memory(300 * MiB), axes.time(0.1)) == (300, pytest.approx(100))


def test_plot_draws_further_frontiers_and_sizes_its_axes_for_them():
    pytest.importorskip("matplotlib")
    from tapesac.plot import frontier_figure

    fig = frontier_figure({"memory_label": "peak", "memory_unit": "bytes", "time_label": "t", "time_unit": "s",
                           "frontier": [{"memory": 20 * MiB, "recompute_time": 0.5}],
                           "frontiers": [{"label": "compiled", "points": [{"memory": 3 * 2**30, "recompute_time": 0.2},
                                                                          {"memory": 4 * 2**30, "recompute_time": 0.1}]}]})
    ax = fig.axes[0]
    assert ax.get_xlabel() == "peak (GiB)"
    (compiled,) = [line for line in ax.get_lines() if line.get_label() == "compiled"]
    assert list(compiled.get_xdata()) == [3, 4] and list(compiled.get_ydata()) == [200, 100]
