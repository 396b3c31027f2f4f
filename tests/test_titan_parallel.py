"""TapeSAC under torchtitan's other parallelisms, on CPU ranks (gloo): each run against the same
parallelism without TapeSAC, per-step losses equal to the bit on every rank, and after planning
a measured step peak within the limit on every rank."""

from __future__ import annotations

import pytest

from .test_torchtitan import _ok, run_titan

pytestmark = pytest.mark.slow

EP2 = "train_configs/qwen3_moe_ep2_debug_cpu.toml"
EP2_BASELINE = "train_configs/qwen3_moe_ep2_debug_cpu_baseline.toml"
STEPS = 4  # warm-up, profiled, verified, planned


def _losses(records: list[dict]) -> list[list[str]]:
    return [r["losses"] for r in records]


def _assert_planned_within_limit(records: list[dict], limit_gib: float) -> None:
    for r in records:
        assert r["planned"] and r["history"], "no plan was made and measured"
        assert all(h["measured_peak_bytes"] <= limit_gib * 2**30 for h in r["history"])
        assert any(keep for _i, keep, _s in r["policy"]), "the plan keeps nothing: the limit is not tight"
        assert any(s["ops_replayed"] > 0 for s in r["stats"].values()), "the plan replays nothing"


@pytest.fixture(scope="module")
def ep2_baseline(tmp_path_factory):
    out, records = run_titan(tmp_path_factory.mktemp("ep2"), "base", EP2_BASELINE, steps=STEPS)
    _ok(out)
    return _losses(records)


def test_expert_parallel_replay_only_matches_ep_without_tapesac(tmp_path, ep2_baseline):
    out, records = run_titan(tmp_path, "ro", EP2, "--tapesac.mode", "replay_only", steps=STEPS)
    _ok(out)
    assert _losses(records) == ep2_baseline
    assert all(s["ops_replayed"] > 0 for r in records for s in r["stats"].values())


def test_expert_parallel_planned_at_a_tight_limit_matches_and_stays_under_it(tmp_path, ep2_baseline):
    """The all-to-all dispatch and combine carry data-dependent split sizes: their outputs are
    kept (collectives are keep-only) and what replays after them runs on the recorded sizes."""
    limit_gib = 0.14
    out, records = run_titan(tmp_path, "plan", EP2, "--tapesac.limit_gib", str(limit_gib), steps=STEPS)
    _ok(out)
    assert _losses(records) == ep2_baseline
    assert records[0]["policy"] == records[1]["policy"]
    _assert_planned_within_limit(records, limit_gib)
