"""tools/bench.py judges the evaluation targets from per-round ratios, and --report re-reads a run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def _bench():
    name = "tapesac_tools_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def _rec(policy, peak_mib, times, limit_mib=None):
    return {"model": "m", "policy": policy, "peak_bytes": int(peak_mib * MiB), "step_s_all": times,
            "step_s": sorted(times)[len(times) // 2], "limit_bytes": limit_mib and int(limit_mib * MiB),
            "predicted_peak_bytes": None}


def _records():
    drift = [2.0, 1.0, 1.0]  # the machine speeds up after round 0
    recs = [
        _rec("no AC", 400, [1.00 * d for d in drift]),
        # The machine slowed down within round 0, between full AC's step and replay-only's: by
        # medians replay-only is slower (2.1 s vs 2.0 s), round by round it is 3.3% faster.
        _rec("full AC", 100, [1.0, 2.0, 3.0]),
        _rec("op SAC", 200, [1.30 * d for d in drift]),
        _rec("TapeSAC replay-only", 100, [2.1, 1.9, 2.9]),
        _rec("TapeSAC @ op SAC peak", 190, [1.20 * d for d in drift], limit_mib=200),
        _rec("TapeSAC @ midpoint peak", 250, [1.05 * d for d in drift], limit_mib=250),
    ]
    by = {x["policy"]: x for x in recs}
    for r in recs:
        r["vs_no_ac"] = _bench().paired_ratio(r, by["no AC"])
        r["vs_full_ac"] = _bench().paired_ratio(r, by["full AC"])
        r["vs_op_sac"] = _bench().paired_ratio(r, by["op SAC"])
    return recs


def test_targets_are_judged_from_per_round_ratios():
    bench = _bench()
    recs = _records()
    lines = bench.check_targets(recs)
    assert lines[0].startswith("MISSED: TapeSAC does not dominate no AC: its fastest at no more memory, "
                               "TapeSAC @ midpoint peak, +5.0% step time, -37.5% memory")
    assert lines[1].startswith("met: TapeSAC dominates full AC: TapeSAC replay-only, -3.3% step time, "
                               "+0.0% memory")
    assert lines[2].startswith("met: TapeSAC dominates op SAC: TapeSAC @ op SAC peak, -7.7% step time")
    assert lines[3].startswith("met: TapeSAC replay-only vs full AC: -3.3% step time (target -3.0% or less)")
    assert lines[4].startswith("met: TapeSAC planned at op SAC's memory vs op SAC: -7.7% step time")
    assert lines[5].startswith("MISSED: TapeSAC planned at the midpoint vs no AC: +5.0% step time")
    assert lines[6] == "met: measured peak never above the limit"


def _table_cell(table: str, policy: str, column: str) -> str:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    header, body = rows[0], rows[2:]
    return next(r for r in body if r[0] == policy)[header.index(column)]


def test_table_and_text_agree_on_signs():
    """Negative is faster everywhere: the table's cell and the target line say the same number."""
    bench = _bench()
    recs = _records()
    table, lines = bench.markdown(recs), bench.check_targets(recs)
    cell = _table_cell(table, "TapeSAC replay-only", "step vs full AC")
    assert cell == "-3.3%" and f"replay-only vs full AC: {cell} step time" in lines[3]
    cell = _table_cell(table, "TapeSAC @ op SAC peak", "step vs op SAC")
    assert cell == "-7.7%" and f"vs op SAC: {cell} step time" in lines[4]
    cell = _table_cell(table, "TapeSAC @ midpoint peak", "step vs no AC")
    assert cell == "+5.0%" and f"vs no AC: {cell} step time" in lines[5]


def test_what_rounds_to_zero_has_no_minus_sign():
    bench = _bench()
    assert bench.pct(-0.0004) == "+0.0%" and bench.pct(0.0) == "+0.0%" and bench.pct(-0.034) == "-3.4%"


def test_peak_over_its_limit_is_reported():
    bench = _bench()
    recs = _records()
    recs[4]["peak_bytes"] = 201 * MiB
    assert bench.check_targets(recs)[-1] == "MISSED: measured peak never above the limit (TapeSAC @ op SAC peak)"


def bench_ratios_line() -> str:
    """The report's line that says how every ratio is computed and which sign is faster."""
    line = _bench().RATIOS
    assert "negative = faster or less memory" in line and "median over rounds" in line
    return line


def test_report_of_the_committed_run_never_prints_minus_zero():
    out = subprocess.run([sys.executable, "tools/bench.py", "--report", "docs/bench_frontier.json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "-0.0%" not in out.stdout and "faster" not in out.stdout.replace(_bench().RATIOS, "")
    assert "met: TapeSAC dominates no AC: TapeSAC @ no AC peak, -2.4% step time, -1.1% memory" in out.stdout
    assert "MISSED: TapeSAC replay-only vs full AC: -2.8% step time" in out.stdout
    assert "| TapeSAC replay-only | 1.218 | +31.8% | -2.8% |" in out.stdout


def test_report_reprints_a_saved_run(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_records()))
    out = subprocess.run([sys.executable, "tools/bench.py", "--report", str(path), "--plot-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| TapeSAC @ midpoint peak | 1.050 |" in out.stdout
    assert "met: TapeSAC replay-only vs full AC: -3.3% step time" in out.stdout
    assert bench_ratios_line() in out.stdout
    assert (tmp_path / "frontier_m.png").stat().st_size > 0


def test_report_rejects_a_file_that_is_not_a_saved_run(tmp_path):
    missing = subprocess.run([sys.executable, "tools/bench.py", "--report", str(tmp_path / "none.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "cannot read a saved run" in missing.stderr
    other = tmp_path / "policy.json"
    other.write_text(json.dumps({"version": 1, "blocks": []}))
    wrong = subprocess.run([sys.executable, "tools/bench.py", "--report", str(other)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "not a file written by --json" in wrong.stderr


def test_each_compiled_runner_compiles_its_own_blocks_under_its_own_budget():
    """Dynamo caches graphs per code object and guards neither on the activation memory budget
    nor on the instance: without a forward of their own, a second runner's blocks reuse the
    first runner's graph, and every compile budget measures compile without AC."""
    import torch

    from .loops import Block

    def saved_bytes(block, budget):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            out = torch.compile(block, fullgraph=True)(torch.randn(2, 128, 32, requires_grad=True))
        return sum(t.untyped_storage().nbytes() for t in out.grad_fn.saved_tensors)

    own = _bench()._own_forward_code
    torch._dynamo.reset()
    runners = []
    for tag in ("budget 1.0", "budget 0.1"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": Block()})
        own(model, tag)
        runners.append(model.layers["0"])
    kept_all, kept_little = saved_bytes(runners[0], 1.0), saved_bytes(runners[1], 0.1)
    assert kept_little < kept_all / 2, (kept_little, kept_all)
    assert type(runners[0]).forward.__code__ is not type(runners[1]).forward.__code__
