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
    assert "MISSED: 'no AC' dominated" in lines[0]
    assert lines[1].startswith("met: 'full AC' dominated") and "-3.3% step time" in lines[1]
    assert lines[2].startswith("met: 'op SAC' dominated") and "TapeSAC @ op SAC peak" in lines[2]
    assert lines[3].startswith("met: replay-only +3.3% faster than full AC")
    assert lines[4].startswith("met: planned at op SAC's memory +7.7% faster")
    assert lines[5].startswith("MISSED: planned at the midpoint +5.0% vs no AC")
    assert lines[6] == "met: measured peak never above the limit"


def test_peak_over_its_limit_is_reported():
    bench = _bench()
    recs = _records()
    recs[4]["peak_bytes"] = 201 * MiB
    assert bench.check_targets(recs)[-1] == "MISSED: measured peak never above the limit (TapeSAC @ op SAC peak)"


def test_report_reprints_a_saved_run(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_records()))
    out = subprocess.run([sys.executable, "tools/bench.py", "--report", str(path), "--plot-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| TapeSAC @ midpoint peak | 1.050 |" in out.stdout
    assert "met: replay-only +3.3% faster than full AC" in out.stdout
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
